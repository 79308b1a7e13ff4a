"""A run owns its output folder.

Every run writes ``run.json`` (a random run id and the hash of its resolved config) into its
folder, and stamps the same pair on every checkpoint (state.json) and every algorithm's
``done`` marker (which also holds the digests of the algorithm's metrics.jsonl and model).
A new run refuses a folder that holds another run unless asked to replace it (``--overwrite``),
and a resume checks every piece it reads back against ``run.json``, so results of two
different runs are never mixed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from fedsub.errors import FedsubError

RUN_FILE = "run.json"
DONE = "done"
LOG = logging.getLogger("fedsub")

# What fedsub writes at the top of a run folder (anything else there is the user's and stays).
RUN_FILES = (
    RUN_FILE,
    "config.toml",
    "summary.json",
    "summary.md",
    "curves.png",
    "heat_source.json",
    "feature_scaling.json",
    "sweep.json",
    "sweep.md",
)
# What fedsub writes in an algorithm's folder.
ALGORITHM_FILES = (DONE, "metrics.jsonl", "rejections.jsonl", "model.safetensors", "checkpoints")


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


def _file_digest(path: Path) -> str | None:
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
        "metrics_sha256": _file_digest(folder / "metrics.jsonl"),
        "model_sha256": _file_digest(folder / "model.safetensors"),
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
        if _file_digest(folder / piece) != record.get(key):
            raise FedsubError(
                f"{folder / piece} is not the file run {identity.run_id} finished with "
                f"(its digest differs from the one in {marker}); refusing to read it back"
            )


def check_checkpoint(path: Path, stamp: dict, identity: RunIdentity) -> None:
    if not identity.matches(stamp):
        raise FedsubError(
            f"checkpoint {path} belongs to another run than the one in this folder's {RUN_FILE} "
            f"(run {identity.run_id}, config {identity.config_hash}); refusing to continue it. "
            f"Start again with --overwrite"
        )


def _is_algorithm_folder(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in ALGORITHM_FILES)


def _is_run_root(path: Path) -> bool:
    """A folder a run wrote: its run.json, or (older fedsub) results beside algorithm folders."""
    if (path / RUN_FILE).exists():
        return True
    results = any((path / name).exists() for name in RUN_FILES)
    return results and any(_is_algorithm_folder(p) for p in path.iterdir())


def holds_a_run(folder: Path) -> bool:
    """Whether ``folder`` holds outputs of a fedsub run, or of a sweep of runs (looks one
    level down only, so pointing --out at a large tree stays cheap)."""
    if not folder.is_dir():
        return False
    if _is_run_root(folder):
        return True
    return any(_is_algorithm_folder(p) or _is_run_root(p) for p in folder.iterdir() if p.is_dir())


def refuse_if_taken(folder: Path, overwrite: bool) -> None:
    """A new run may not write into a folder that holds another run, unless ``overwrite``."""
    if not overwrite and holds_a_run(folder):
        raise FedsubError(
            f"output folder {folder} already holds a run; pass --overwrite to replace it, "
            f"--resume {folder} to continue it, or choose another --out"
        )


def clear_run(folder: Path) -> None:
    """Remove a run's outputs from ``folder`` (for ``--overwrite``): only what fedsub writes,
    i.e. its files and the algorithm and sweep-value folders; anything else stays."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            if _is_algorithm_folder(entry) or _is_run_root(entry):
                shutil.rmtree(entry)
        elif entry.name in RUN_FILES or (entry.name.startswith(".") and entry.suffix == ".tmp"):
            entry.unlink()
    left = sorted(p.name for p in folder.iterdir())
    if left:
        LOG.warning("--overwrite kept what fedsub did not write in %s: %s", folder, ", ".join(left))


def missing_ancestors(folder: Path) -> list[Path]:
    """``folder`` and its parents that do not exist yet, deepest first."""
    missing = []
    for path in [folder, *folder.parents]:
        if path.exists():
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
