"""Output folders in every state, driven through the real CLI (in process): a run either
succeeds or exits 2 with one `fedsub: error:` line naming the folder, and then leaves every
byte of the tree as it found it; nothing of the user's (files, other runs nested anywhere) is
ever lost; nothing half-written or temporary stays; the lock is gone afterwards.

States drawn: the --out text (missing folder, nested path, empty or blank text, the current
folder, a parent of it, the home folder, a file, a path through a file); what is in it (user
files, an earlier run, user files inside that run's folders, other runs nested in it or
beside it); held by another writer; --overwrite or not; the command (run, compare, a sweep);
a config that trains, or one that fails before its first round (a model that cannot read the
data, at load; an out-of-memory batch size, in round 1, after the folder was claimed); a
warm start from a model file beside the folder or inside the run --overwrite replaces.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fedsub.cli import main
from fedsub.files.folder_lock import LOCK_FILE, FolderLock, is_locked

TINY = [
    "data.num_users=12",
    "data.num_items=10",
    "data.mean_samples_per_user=6",
    "train.rounds=1",
    "train.clients_per_round=3",
    "train.local_steps=1",
    "train.batch_size=2",
    "train.checkpoint_every=1",
    "eval.train_loss_samples=20",
    'train.algorithms=["fedavg", "fedsubavg"]',
]
FAILING = {
    "at load": ['model.name="mlp"'],  # mlp cannot read synthetic-sparse's ids
    "in round 1": ["train.batch_size=1000000000000"],  # out of memory after the claim
}
SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (None) under ``root``, by relative path."""
    found: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        if path.is_symlink():
            found[relative] = b"link to " + os.readlink(path).encode()
        else:
            found[relative] = None if path.is_dir() else path.read_bytes()
    return found


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory) -> Path:
    """A finished run (run.json with its manifest, two algorithms, a checkpoint), copied
    into place wherever a drawn state holds one."""
    out = tmp_path_factory.mktemp("earlier") / "run"
    sets = [a for s in TINY for a in ("--set", s)]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert (
            main(["compare", "--quiet", "--out", str(out), *sets, "--set", "train.rounds=2"]) == 0
        )
    return out


@dataclass(frozen=True)
class State:
    out: str  # the --out text, relative to the current folder (the tree's "work")
    target_holds: str  # "nothing", "user files", "an earlier run", "a run and user files"
    nested_run: bool  # another run in a subfolder of the target
    linked: bool  # the target's fedavg folder is a link to the user's folder elsewhere
    sibling_runs: bool  # other runs beside the target (runs/a, runs/b)
    locked: bool
    overwrite: bool
    command: str  # "run", "compare", "sweep"
    failure: str  # "", "at load", "in round 1"
    start: str = ""  # --initial-model: "" none, "outside" a copy, "inside" runs/taken's model


# Weighted (by repetition) towards the states where data are at stake: a folder holding a
# run, the user's files and other runs, replaced with --overwrite by runs that succeed or fail.
STATES = st.builds(
    State,
    out=st.sampled_from(
        ["runs/taken"] * 3 + ["runs/new", "runs/x/y/z", "runs/taken/fedavg", "runs"]
    ),
    target_holds=st.sampled_from(
        ["a run and files"] * 3 + ["an earlier run"] * 2 + ["user files", "nothing"]
    ),
    nested_run=st.sampled_from([True, True, False]),
    linked=st.sampled_from([False, False, False, True]),
    sibling_runs=st.booleans(),
    locked=st.sampled_from([False, False, False, True]),
    overwrite=st.sampled_from([True, True, False]),
    command=st.sampled_from(["run", "compare", "compare", "sweep"]),
    failure=st.sampled_from(["", "", "", "at load", "in round 1"]),
    start=st.sampled_from(["", "", "outside", "inside"]),
)
STARTS = {"outside": "start.safetensors", "inside": "runs/taken/fedsubavg/model.safetensors"}


def build_tree(work: Path, state: State, earlier: Path) -> Path | None:
    """The drawn state under ``work`` (the current folder); the target folder when the --out
    text names one under ``work``."""
    (work / "notes.txt").write_text("the user's notes")
    (work / "runs").mkdir()
    shutil.copy(earlier / "fedsubavg" / "model.safetensors", work / STARTS["outside"])
    if state.sibling_runs:
        for name in ("a", "b"):
            shutil.copytree(earlier, work / "runs" / name)
            (work / "runs" / name / "mine.txt").write_text(f"user file in run {name}")
    taken = work / "runs" / "taken"
    holds = state.target_holds
    if holds in ("an earlier run", "a run and files"):
        shutil.copytree(earlier, taken)
    if holds in ("user files", "a run and files"):
        taken.mkdir(exist_ok=True)
        (taken / "README.txt").write_text("the user's file in the run folder")
        (taken / "fedavg").mkdir(exist_ok=True)
        (taken / "fedavg" / "analysis.ipynb").write_text("the user's notebook")
        (taken / "summary.md.bak").write_text("the user's copy")
    if state.nested_run and taken.is_dir():
        shutil.copytree(earlier, taken / "older")
    if state.linked and (taken / "fedavg").is_dir():  # the user linked an algorithm folder
        shutil.move(taken / "fedavg", work / "elsewhere")
        (taken / "fedavg").symlink_to(work / "elsewhere")
    target = (work / state.out).resolve() if state.out.strip() and state.out != "~" else None
    return target


def argv_of(state: State) -> list[str]:
    sets = [*TINY, *FAILING.get(state.failure, [])]
    argv = {
        "run": ["run", "--algorithm", "fedsubavg"],
        "compare": ["compare"],
        "sweep": ["compare", "--sweep", "train.lr=0.1,0.2"],
    }[state.command]
    argv += ["--quiet", "--out", state.out, *(a for s in sets for a in ("--set", s))]
    if state.start:
        argv += ["--initial-model", STARTS[state.start]]
    return [*argv, "--overwrite"] if state.overwrite else argv


def run_cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def check_outcome(state: State, code: int, err: str, before: dict, after: dict, earlier: set):
    """``earlier``: the files of the earlier run in runs/taken, the only ones a run may
    replace (with --overwrite, into that folder)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code in (0, 2), (state, code, err)
    if code == 2:
        assert lines[-1].startswith("fedsub: error: "), err
        assert after == before, (state, err)  # nothing written, nothing lost
        return
    leftovers = [p for p in after if p.endswith(".tmp") or "fedsub-replaced" in p]
    leftovers += [p for p in after if Path(p).name == LOCK_FILE and p not in before]
    assert not leftovers, leftovers
    replaced = state.overwrite and state.out == "runs/taken"
    kept = {p: v for p, v in before.items() if v is not None}
    if replaced:
        kept = {p: v for p, v in kept.items() if p not in earlier}
    changed = [p for p, v in kept.items() if after.get(p) != v]
    assert not changed, (state, changed)  # the user's files and other runs, byte for byte
    target = Path("work") / state.out
    record = json.loads(after[str(target / "run.json")] or b"")
    assert isinstance(record["outputs"], list)
    results = "sweep.json" if state.command == "sweep" else "summary.json"
    json.loads(after[str(target / results)] or b"")  # complete, valid JSON


@SETTINGS
@given(state=STATES)
def test_every_folder_state_runs_or_refuses_without_losing_anything(state, earlier_run):
    earlier = {f"work/runs/taken/{p}" for p, v in snapshot(earlier_run).items() if v is not None}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        work, home = root / "work", root / "home"
        work.mkdir()
        home.mkdir()
        target = build_tree(work, state, earlier_run)
        lock = None
        if state.locked and target is not None and target.is_dir() and target != work:
            lock = FolderLock.acquire(target)
        previous, previous_home = Path.cwd(), os.environ.get("HOME")
        os.chdir(work)
        os.environ["HOME"] = str(home)
        try:
            before = snapshot(root)
            code, err = run_cli(argv_of(state))
            after = snapshot(root)
        finally:
            os.chdir(previous)
            if previous_home is not None:
                os.environ["HOME"] = previous_home
            if lock is not None:
                lock.release()
        event(f"exit {code}" + (f": {err.splitlines()[-1][15:75]}" if code else ""))
        check_outcome(state, code, err, before, after, earlier)
        if target is not None and code == 0:
            assert not is_locked(target)
        assert not (lock is not None and code == 0), "a held folder was written"
        assert not (state.failure and code == 0), f"a run failing {state.failure} succeeded"
        if state.start == "inside" and state.overwrite and state.out == "runs/taken":
            assert code == 2, "a run replaced the folder of the model it starts from"
            if not state.failure and state.command != "sweep" and "run" in state.target_holds:
                assert "the run folder that --overwrite replaces" in err, err


REFUSED = {  # --out texts no run may write into, and what the refusal says
    "": "--out is empty",
    "  ": "--out is blank ('  ')",
    ".": "--out . is the current folder",
    "..": "--out .. is a parent of the current folder",
    "~": "--out ~ is your home folder",
    "notes.txt": "--out notes.txt is a file",
    "notes.txt/sub": "--out notes.txt/sub cannot be made: ",
    "runs": "--out runs holds other runs (a, b, taken)",
}


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("out", sorted(REFUSED))
def test_folders_no_run_may_write_into_are_refused_and_left_as_they_were(
    out, overwrite, earlier_run
):
    state = State(out, "a run and files", True, False, True, False, overwrite, "compare", "")
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "work").mkdir()
        (root / "home").mkdir()
        build_tree(root / "work", state, earlier_run)
        previous, previous_home = Path.cwd(), os.environ.get("HOME")
        os.chdir(root / "work")
        os.environ["HOME"] = str(root / "home")
        try:
            before = snapshot(root)
            code, err = run_cli(argv_of(state))
            after = snapshot(root)
        finally:
            os.chdir(previous)
            if previous_home is not None:
                os.environ["HOME"] = previous_home
    assert code == 2 and REFUSED[out] in err and "Traceback" not in err
    assert after == before


def test_a_filesystem_root_is_refused_before_anything(capsys):
    assert main(["compare", "--quiet", "--out", "/", "--overwrite"]) == 2
    assert "--out / is a filesystem root" in capsys.readouterr().err


@pytest.mark.skipif(
    not Path("/sys/kernel").is_dir(),
    reason="needs Linux's /sys, where not even root may create a file",
)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "--out", "/sys/fedsub-out"], "output folder /sys/fedsub-out cannot be made"),
        (
            ["data", "stats", "synthetic-sparse", "--plot", "/sys/heat.png"],
            "--plot /sys/heat.png: cannot write in /sys",
        ),
    ],
)
def test_a_place_that_takes_no_file_is_refused_before_work(argv, message):
    """A read-only place (here /sys, read-only even for root, who ignores permissions)."""
    code, err = run_cli([*argv, "--set", "data.num_users=100000"])  # refused before made
    assert code == 2 and message in err and "Traceback" not in err
