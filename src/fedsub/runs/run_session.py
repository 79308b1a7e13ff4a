"""A run's session in its folder, for every runtime: the folder held for the run's lifetime,
where its checkpoints go and which one it continues, what a fresh start forgets of an earlier
attempt, and the trained model written.

``fedsub run``/``compare`` (runs/experiment.py: one folder per algorithm) and the Flower
ServerApp's out-dir (flower/apps.py) both keep their runs this way, around the one round loop
(engine/loop.py's ``drive``); which run a folder holds is runs/run_identity.py's. What differs
on purpose stays with the runtime: ``compare --resume`` starts an algorithm with no intact
checkpoint from round 1 (its other algorithms may have finished), a Flower run with
``resume = true`` and no checkpoint is refused; a comparison's folder counts as trained once
a round completed, a Flower out-dir once the loop ended (its result, even a failure's, kept).
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.loop import Interrupted, RunControl
from fedsub.files.run_folder import CHECKPOINTS, Claim, RunIdentity
from fedsub.files.tensor_files import write_tensors_atomic
from fedsub.submodel.params import Params

MODEL_FILE = "model.safetensors"


@contextmanager
def holding(claim: Claim | None) -> Iterator[None]:
    """Hold ``claim``'s folder (None: a process that writes nothing) while the run runs, then
    release it; a run that fails (an error; a stop after a checkpoint is not one: it is a run
    to resume) before its first round completed is undone (files/run_folder.py's rules)."""
    failed = True
    try:
        yield
        failed = False
    except Interrupted:
        failed = False
        raise
    finally:
        if claim is not None:
            claim.end(failed)


def checkpointed(
    control: RunControl,
    folder: Path | None,
    every: int,
    identity: RunIdentity,
    resume: checkpoint_lib.Checkpoint | None = None,
) -> RunControl:
    """``control`` (the runtime's own guards) with the run's checkpoints: in ``folder``'s
    checkpoints/ (None: none written) every ``every`` rounds, stamped with ``identity``,
    continuing ``resume``."""
    return dataclasses.replace(
        control,
        checkpoints=None if folder is None else folder / CHECKPOINTS,
        checkpoint_every=every,
        resume=resume,
        run=identity.as_json(),
    )


def start_fresh(folder: Path, *files: str, checkpoints: bool = True) -> None:
    """A run with no checkpoint to continue starts over in ``folder``: forget what an earlier
    attempt left there, its checkpoints (unless ``checkpoints`` is False: a runtime whose
    folder holds none then) and its progress and completion ``files``."""
    if checkpoints:
        shutil.rmtree(folder / CHECKPOINTS, ignore_errors=True)
    for name in files:
        (folder / name).unlink(missing_ok=True)


def write_model(folder: Path, params: Params) -> None:
    """The trained model, ``folder``'s model.safetensors (written whole or not at all)."""
    write_tensors_atomic(folder / MODEL_FILE, params.state_dict())
