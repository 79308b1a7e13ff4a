"""A run owns its output folder, and only what it wrote there.

Every run writes ``run.json`` into its folder: a random run id and the hash of its resolved
config, stamped on every checkpoint (state.json) and every algorithm's ``done`` marker (which
also holds the digests of the algorithm's metrics.jsonl and model), so results of two runs are
never mixed; and ``outputs``, the manifest of what the run writes (glob patterns relative to
the folder; a pattern ending in ``/`` is a folder it made) plus ``runs``, the folders of its own
nested runs (a sweep's values), each with its own run.json.

The rules every command that writes a run folder follows (``fedsub run``/``compare``, sweeps,
the Flower ServerApp's ``out-dir``):

- a new run refuses a folder that is empty or blank text, the current folder or one holding
  it, the home folder, a filesystem root, a file, or a folder holding other runs;
- it refuses a folder holding a run unless asked to replace it (``--overwrite``), and then
  removes only what that run's manifest lists: never another run nested in it, never a file
  fedsub did not write;
- a run holds the folder's lock (``folder_lock``) for its lifetime: a second writer is
  refused, naming the holder;
- a new run that fails before its first round completes leaves nothing behind: what it wrote
  is removed, the folders it made too, and a run it was replacing is put back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fedsub.errors import FedsubError
from fedsub.files.atomic_files import TEMP_PATTERN, create_temp_dir, is_temp_name, write_atomic
from fedsub.files.folder_lock import LOCK_FILE, FolderLock

RUN_FILE = "run.json"
DONE = "done"
LOG = logging.getLogger("fedsub")

# What a comparison writes at the top of its folder, and in each algorithm's folder.
RUN_FILES = (
    RUN_FILE,
    "config.toml",
    "summary.json",
    "summary.md",
    "curves.png",
    "curves_time.png",  # [clock]: the curves against virtual time (fedsub/clock)
    "heat_source.json",
    "feature_scaling.json",
)
SWEEP_FILES = (RUN_FILE, "sweep.json", "sweep.md", "curves.png", "curves_time.png")
ALGORITHM_FILES = (
    DONE,
    "metrics.jsonl",
    "rejections.jsonl",
    "model.safetensors",
    "privacy.json",
    "profile.json",  # --profile (fedsub/profiling.py)
)
CHECKPOINTS = "checkpoints"
# What a Flower ServerApp's out-dir holds at its top, with or without run.json (an out-dir of a
# fedsub from before run.json has only these, beside its model and checkpoints).
FLOWER_RESULT, FLOWER_PROGRESS = "flower-result.json", "progress.jsonl"
FLOWER_RUN_FILES = (FLOWER_RESULT, FLOWER_PROGRESS)


def checkpoint_outputs(folder: str) -> list[str]:
    """A checkpoint folder's manifest entries (engine/checkpoint.py: round-NNNNNN folders,
    staged through temporary ones)."""
    return [f"{folder}/round-*", f"{folder}/{TEMP_PATTERN}", f"{folder}/"]


def comparison_outputs(algorithms: list[str]) -> list[str]:
    """The manifest of a comparison of ``algorithms``."""
    outputs = [*RUN_FILES, TEMP_PATTERN]
    for name in algorithms:
        outputs += [f"{name}/{f}" for f in ALGORITHM_FILES]
        outputs += [f"{name}/{TEMP_PATTERN}", *checkpoint_outputs(f"{name}/{CHECKPOINTS}")]
        outputs.append(f"{name}/")
    return outputs


def sweep_outputs() -> list[str]:
    """The manifest of a sweep's own files (its values' folders are its nested ``runs``)."""
    return [*SWEEP_FILES, TEMP_PATTERN]


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    config_hash: str

    def as_json(self) -> dict[str, str]:
        return {"run_id": self.run_id, "config_hash": self.config_hash}

    def matches(self, stamp: object) -> bool:
        return (
            isinstance(stamp, dict)
            and stamp.get("run_id") == self.run_id
            and (stamp.get("config_hash") == self.config_hash)
        )


def hash_config(config_text: str) -> str:
    return hashlib.sha256(config_text.encode("utf-8")).hexdigest()[:16]


def new_identity(config_text: str) -> RunIdentity:
    return RunIdentity(uuid.uuid4().hex[:12], hash_config(config_text))


def read_run_file(folder: Path) -> dict:
    """``folder/run.json``; a clear error when it is missing or unreadable."""
    path = folder / RUN_FILE
    if not path.exists():
        raise FedsubError(
            f"{folder} has no {RUN_FILE}, so its pieces cannot be checked to belong to one run "
            f"(written by an older fedsub, or not a run folder); start again with --overwrite"
        )
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        RunIdentity(str(record["run_id"]), str(record["config_hash"]))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise FedsubError(f"{path}: not a readable fedsub run file ({error})") from None
    return record


def identity_of(record: dict) -> RunIdentity:
    return RunIdentity(str(record["run_id"]), str(record["config_hash"]))


def file_digest(path: Path) -> str | None:
    """The sha256 of the file's bytes (hex), read in blocks; None when it does not exist."""
    if not path.exists():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def done_record(folder: Path, identity: RunIdentity) -> str:
    """The ``done`` marker's text: the run's identity and digests of what it finished with."""
    record = {
        **identity.as_json(),
        "metrics_sha256": file_digest(folder / "metrics.jsonl"),
        "model_sha256": file_digest(folder / "model.safetensors"),
    }
    return json.dumps(record, indent=2) + "\n"


def check_done(folder: Path, identity: RunIdentity) -> None:
    """Refuse, naming the piece, a finished algorithm that another run (or a hand edit) left."""
    marker = folder / DONE
    try:
        record = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = None
    if not identity.matches(record):
        raise FedsubError(
            f"{marker} belongs to another run than {folder.parent / RUN_FILE} "
            f"(run {identity.run_id}, config {identity.config_hash}); refusing to read back "
            f"its results. Start again with --overwrite, or resume the run it belongs to"
        )
    for piece, key in (("metrics.jsonl", "metrics_sha256"), ("model.safetensors", "model_sha256")):
        if file_digest(folder / piece) != record.get(key):
            raise FedsubError(
                f"{folder / piece} is not the file run {identity.run_id} finished with "
                f"(its digest differs from the one in {marker}); refusing to read it back"
            )


def check_checkpoint(
    path: Path, stamp: dict, identity: RunIdentity, flags: Flags | None = None
) -> None:
    """Refuse a checkpoint stamped with another run than ``identity`` (``flags``: how the
    command names its options; the command line's when None)."""
    if not identity.matches(stamp):
        flags = CLI_FLAGS if flags is None else flags
        raise FedsubError(
            f"checkpoint {path} belongs to another run than the one in this folder's {RUN_FILE} "
            f"(run {identity.run_id}, config {identity.config_hash}): written by another "
            f"configuration or run; refusing to continue it. Start again with {flags.overwrite}, "
            f"or choose another {flags.folder}"
        )


# --- which folders a new run may take --------------------------------------------------------
def _is_algorithm_folder(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in ALGORITHM_FILES)


def _is_run_root(path: Path) -> bool:
    """A folder a run wrote: its run.json, or (older fedsub) results beside algorithm folders
    or a Flower out-dir's results."""
    if any((path / name).exists() for name in (RUN_FILE, *FLOWER_RUN_FILES)):
        return True
    if not any((path / name).exists() for name in RUN_FILES):
        return False
    return any(_is_algorithm_folder(p) for p in _subfolders(path))


def _subfolders(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:  # unreadable: nothing can be seen in it (writing there fails clearly later)
        return []


def holds_a_run(folder: Path) -> bool:
    """Whether ``folder`` holds outputs of a fedsub run, or of a sweep of runs (looks one
    level down only, so pointing --out at a large tree stays cheap)."""
    if not folder.is_dir():
        return False
    if _is_run_root(folder):
        return True
    return any(_is_algorithm_folder(p) for p in _subfolders(folder))


def check_folder_text(text: str, flag: str) -> None:
    """An output folder given as text: empty or blank text is refused (``--out ""`` would be
    the current folder)."""
    if not text.strip():
        shown = "empty" if not text else f"blank ({text!r})"
        raise FedsubError(
            f"{flag} is {shown}; give the folder for this run's results, e.g. {flag} runs/NAME"
        )


def _is_inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


@dataclass(frozen=True)
class Flags:
    """How a command names a run's folder and its options, for its error messages; and
    whether the current folder is the user's (``cwd_rule``: not in a process such as
    Flower's ServerApp, whose current folder the user did not choose)."""

    folder: str = "--out"
    example: str = "--out runs/NAME"
    overwrite: str = "--overwrite"
    resume: str = "--resume {folder}"
    cwd_rule: bool = True


CLI_FLAGS = Flags()


def check_new_folder(folder: Path, flags: Flags = CLI_FLAGS) -> None:
    """Refuse, saying what to do instead, a folder no new run may write into: a filesystem
    root, the home folder, the current folder or one holding it, a file (or a path through
    one), a folder holding other runs."""
    resolved = folder.expanduser().resolve()
    cwd = Path.cwd().resolve()
    flag = flags.folder
    instead = f"give this run a folder of its own, e.g. {flags.example}"
    if resolved.parent == resolved:
        raise FedsubError(f"{flag} {folder} is a filesystem root; {instead}")
    if resolved == Path.home().resolve():
        raise FedsubError(f"{flag} {folder} is your home folder; {instead}")
    if flags.cwd_rule and _is_inside(cwd, resolved):
        what = "the current folder" if resolved == cwd else "a parent of the current folder"
        raise FedsubError(f"{flag} {folder} is {what}; {instead}")
    for path in [resolved, *resolved.parents]:
        if path.exists() and not path.is_dir():
            where = "is a file" if path == resolved else f"cannot be made: {path} is a file"
            raise FedsubError(f"{flag} {folder} {where}; {instead}")
    if resolved.is_dir() and not _is_run_root(resolved):
        nested = [p.name for p in _subfolders(resolved) if _is_run_root(p)]
        if nested:
            more = f" and {len(nested) - 5} more" if len(nested) > 5 else ""
            resume = flags.resume.format(folder=folder / nested[0])
            raise FedsubError(
                f"{flag} {folder} holds other runs ({', '.join(nested[:5])}{more}); give this "
                f"run a folder of its own inside it, e.g. {folder / 'NAME'}, or continue one "
                f"({resume})"
            )


def refuse_if_taken(folder: Path, overwrite: bool, flags: Flags = CLI_FLAGS) -> None:
    """A new run may not write into a folder that holds another run, unless ``overwrite``;
    and ``overwrite`` needs that run's manifest (an older fedsub wrote none)."""
    if not holds_a_run(folder):
        return
    if not overwrite:
        raise FedsubError(
            f"output folder {folder} already holds a run; pass {flags.overwrite} to replace "
            f"it, {flags.resume.format(folder=folder)} to continue it, or choose another "
            f"{flags.folder}"
        )
    record = read_run_file(folder) if (folder / RUN_FILE).exists() else {}
    if not isinstance(record.get("outputs"), list):
        raise FedsubError(
            f"output folder {folder} holds a run written by an older fedsub, which did not list "
            f"the files it wrote, and {flags.overwrite} removes only files a run listed; delete "
            f"that run yourself, or choose another {flags.folder}"
        )


# --- what a run wrote: its manifest -----------------------------------------------------------
def _checked_entry(folder: Path, entry: object) -> str:
    """A manifest entry, refused when it could reach outside ``folder``."""
    parts = Path(str(entry)).parts
    if not isinstance(entry, str) or not entry or Path(entry).is_absolute() or ".." in parts:
        raise FedsubError(
            f"{folder / RUN_FILE} lists {entry!r} among its outputs, which is not a path inside "
            "the folder; refusing to remove anything (was it edited?)"
        )
    return entry


@dataclass
class Owned:
    """What a run's manifest matches in its folder: entries to remove (files and fedsub's
    own folders such as checkpoints), and folders it made, removed when left empty."""

    entries: list[Path] = field(default_factory=list)
    folders: list[Path] = field(default_factory=list)  # shallowest first


def owned(folder: Path, record: dict | None = None) -> Owned:
    """Everything in ``folder`` its run (``record``: its run.json, read when not given) wrote,
    its nested runs' included; run.json itself comes last."""
    record = read_run_file(folder) if record is None else record
    outputs, runs = record.get("outputs"), record.get("runs", [])
    if not isinstance(outputs, list) or not isinstance(runs, list):
        raise FedsubError(f"{folder / RUN_FILE} lists no outputs; it cannot be cleared")
    found = Owned()
    root = folder.resolve()
    for name in runs:
        nested = folder / _checked_entry(folder, name)
        if nested.is_dir() and not nested.is_symlink() and (nested / RUN_FILE).exists():
            inner = owned(nested)
            found.entries += inner.entries
            found.folders += [*inner.folders, nested]
    run_file = None
    for entry in (_checked_entry(folder, e) for e in outputs):
        if entry.endswith("/"):
            path = folder / entry.rstrip("/")
            if path.is_dir() and not path.is_symlink():
                found.folders.append(path)
            continue
        for path in sorted(folder.glob(entry)):
            if not path.parent.resolve().is_relative_to(root):
                continue  # reached through a link out of the folder: not the run's
            if path.name == LOCK_FILE:
                continue  # the lock belongs to whoever holds it, not to a run
            if entry.endswith(TEMP_PATTERN) and not is_temp_name(path.name):
                continue  # a name only resembling fedsub's temporary files
            if path.name == RUN_FILE and path.parent == folder:
                run_file = path
            elif path not in found.entries:
                found.entries.append(path)
    found.folders.sort(key=lambda p: len(p.parts))
    if run_file is not None:
        found.entries.append(run_file)
    return found


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _remove_empty(folders: list[Path]) -> None:
    for path in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):  # not empty (the user's files), or already gone
            path.rmdir()


def missing_ancestors(folder: Path) -> list[Path]:
    """``folder`` and its parents that do not exist yet, deepest first."""
    missing = []
    for path in [folder, *folder.parents]:
        if path.exists() or path.is_symlink():
            break
        missing.append(path)
    return missing


def remove_if_empty(created: list[Path]) -> None:
    """Undo ``mkdir -p`` of a run that failed before it wrote anything (deepest first)."""
    for path in created:
        try:
            path.rmdir()
        except OSError:
            return


# --- a run's hold on its folder ---------------------------------------------------------------
@dataclass
class Claim:
    """A run's folder from its start to its end: the lock, the folders made for it, and (a new
    run replacing another with --overwrite) the earlier run, moved aside until this run's first
    round completes, so a run that fails before training leaves the folder as it found it."""

    folder: Path
    lock: FolderLock
    new: bool  # a new run (a failure before training undoes it), not a resume
    created: list[Path] = field(default_factory=list)
    record: dict | None = None  # this run's run.json, once written
    aside: Path | None = None  # the replaced run's entries, until this run trains
    moved: list[tuple[Path, Path]] = field(default_factory=list)  # (original, aside)
    trained: bool = False

    def write_run_file(self, record: dict) -> None:
        """Write run.json (the manifest first, before anything it lists), moving a replaced
        run's entries aside first (``claim_new`` let it be replaced: ``--overwrite``)."""
        if self.new and (self.folder / RUN_FILE).exists():
            self._move_aside()
        _refuse_what_is_in_the_way(self.folder, record)
        self.record = record
        write_atomic(self.folder / RUN_FILE, json.dumps(record, indent=2, default=str) + "\n")

    def _move_aside(self) -> None:
        found = owned(self.folder)
        self.aside = create_temp_dir(self.folder, "fedsub-replaced")
        for path in found.entries:
            target = self.aside / path.relative_to(self.folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
            self.moved.append((path, target))
        _remove_empty(found.folders)
        left = sorted(
            p.name for p in self.folder.iterdir() if p.name != LOCK_FILE and p != self.aside
        )
        if left:
            LOG.warning(
                "--overwrite keeps what the replaced run did not write in %s: %s",
                self.folder,
                ", ".join(left),
            )

    def training_started(self) -> None:
        """The first round completed: a replaced run is gone for good."""
        if self.trained:
            return
        self.trained = True
        if self.aside is not None:
            shutil.rmtree(self.aside, ignore_errors=True)
            self.aside, self.moved = None, []

    def end(self, failed: bool) -> None:
        """Release the folder. A new run that failed before training is undone first."""
        try:
            if failed and self.new and not self.trained:
                self._undo()
            else:
                self.training_started()
        finally:
            self.lock.release()
            if failed and self.new and not self.trained:
                remove_if_empty(self.created)

    def _undo(self) -> None:
        if self.record is not None:
            found = owned(self.folder, self.record)
            for path in found.entries:
                if path != self.aside:
                    _remove(path)
            _remove_empty(found.folders)
        for original, target in reversed(self.moved):
            original.parent.mkdir(parents=True, exist_ok=True)
            os.replace(target, original)
        if self.aside is not None:
            shutil.rmtree(self.aside, ignore_errors=True)


def _refuse_what_is_in_the_way(folder: Path, record: dict) -> None:
    """A name the new run writes that is the user's: a link (the run would write through it,
    into whatever it points at), or a file where the run makes a folder (or the reverse)."""
    for entry in [*record.get("outputs", []), *(f"{r}/" for r in record.get("runs", []))]:
        top, _, rest = entry.partition("/")
        path = folder / top
        if any(c in top for c in "*?[") or not (path.exists() or path.is_symlink()):
            continue
        wanted = "a folder" if rest or entry.endswith("/") else "a file"
        if path.is_symlink():
            problem = f"is a link (to {os.readlink(path)}); the run would write through it"
        elif (wanted == "a folder") != path.is_dir():
            problem = f"is not {wanted}, which the run writes there"
        else:
            continue
        raise FedsubError(
            f"{path} {problem}: it is not fedsub's; move it away or choose another folder"
        )


def claim_new(folder: Path, overwrite: bool = False, flags: Flags = CLI_FLAGS) -> Claim:
    """Take ``folder`` for a new run: the rules above, checked under the folder's lock (so two
    runs started together cannot both pass them)."""
    check_new_folder(folder, flags)
    created = missing_ancestors(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        remove_if_empty(created)
        raise FedsubError(f"output folder {folder} cannot be made: {error}") from None
    try:
        lock = FolderLock.acquire(folder)
    except BaseException:
        remove_if_empty(created)
        raise
    claim = Claim(folder, lock, new=True, created=created)
    try:
        refuse_if_taken(folder, overwrite, flags)
    except BaseException:
        claim.end(failed=True)
        raise
    return claim


def claim_existing(folder: Path) -> Claim:
    """Take the folder of a run to resume (it must exist), under its lock."""
    if not folder.is_dir():
        raise FedsubError(f"{folder} is not a fedsub run folder: it does not exist")
    return Claim(folder, FolderLock.acquire(folder, "run folder"), new=False)
