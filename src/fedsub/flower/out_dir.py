"""What the Flower ServerApp keeps in its out-dir. The folder's rules and session are
``fedsub run``'s (runs/run_identity.py, runs/run_session.py); Flower's own are the config kept
in run.json and hashed with the Flower settings that decide the model (``started_with``), one
run id for every ``flwr run`` of a config (``RUN_ID``), ``resume = true`` refused without a
checkpoint (``latest``) and the result (flower-result.json, heat.safetensors)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import cast

import torch

from fedsub.engine.checkpoint import Checkpoint
from fedsub.engine.loop import Progress, RunControl
from fedsub.engine.round_records import RoundsFailed, run_costs
from fedsub.engine.server_round import Diverged
from fedsub.errors import FedsubError
from fedsub.files.atomic_files import TEMP_PATTERN
from fedsub.files.json_values import dumps
from fedsub.files.run_folder import (
    CHECKPOINTS,
    RUN_FILE,
    Claim,
    RunIdentity,
    checkpoint_outputs,
    hash_config,
)
from fedsub.files.tensor_files import write_tensors_atomic
from fedsub.flower.heat_exchange import HeatReport, Transcript
from fedsub.flower.run_model import RunModel
from fedsub.flower.server_runtime import FlowerRuntime
from fedsub.flower.settings import OUT_DIR_FLAGS, FlowerSettings
from fedsub.privacy.levels import Privacy, describe
from fedsub.runs.report import write_atomic
from fedsub.runs.run_identity import (
    StartedWith,
    claim_folder,
    newest_checkpoint,
    resumed_identity,
    start_run,
)
from fedsub.runs.run_session import MODEL_FILE, checkpointed, start_fresh, write_model

LOG = logging.getLogger("fedsub")


PROGRESS = "progress.jsonl"  # every round's record, as it ends
RUN_ID = "flower"  # Flower gives each `flwr run` a new run id: the config hash identifies it
CONFIG_KEY = "config"  # run.json's key of the fedsub config as written

# What a Flower run writes in its out-dir (its run.json manifest; files/run_folder.py).
FLOWER_OUTPUTS = [
    RUN_FILE,
    PROGRESS,
    "flower-result.json",
    MODEL_FILE,
    "heat.safetensors",
    "heat-transcript.json",
    TEMP_PATTERN,
    *checkpoint_outputs(CHECKPOINTS),
]


def claim_out_dir(settings: FlowerSettings) -> Claim | None:
    """The out-dir, held for the run (run_folder's rules, as ``fedsub run``), or None."""
    if not settings.output.out_dir:
        return None
    output = settings.output
    return claim_folder(Path(output.out_dir), output.resume, output.overwrite, OUT_DIR_FLAGS)


def started_with(settings: FlowerSettings, algorithm: str) -> StartedWith:
    """How an out-dir keeps the config its run was started with: in run.json, its identity
    the hash of the config's description with the Flower settings that decide the model."""
    return StartedWith(
        key=CONFIG_KEY,
        describe=functools.partial(settings.description, algorithm=algorithm),
        settings=(
            " with this run config's algorithm, payload, heat-refresh-every and initial-model "
            "(the file's bytes)"
        ),
        flags=OUT_DIR_FLAGS,
    )


def run_stamp(settings: FlowerSettings, claim: Claim | None, text: str, name: str) -> RunIdentity:
    """The stamp of the run's checkpoints: its config hash (runs/run_identity.py; ``text``, the
    fedsub config as written), a resumed run's after checking that the config given is that
    run's, a new run's written to its out-dir (``claim``)."""
    started = started_with(settings, name)
    if claim is None:
        return RunIdentity(RUN_ID, hash_config(started.describe(text)))
    if settings.output.resume:
        identity = resumed_identity(claim.folder, text, started)
    else:
        identity = start_run(claim, text, {"kind": "flower", "outputs": FLOWER_OUTPUTS}, started)
    return RunIdentity(RUN_ID, identity.config_hash)


def run_control(settings: FlowerSettings, run: RunModel, stamp: RunIdentity) -> RunControl:
    """How the loop keeps a Flower run safe: checkpoints in out-dir every checkpoint-every
    rounds (stamped ``stamp``), the newest of them continued with ``resume``. Divergence is a
    non-finite train loss only: a Flower run has no round-0 evaluation (no node has
    registered yet) for the rising-loss rule."""
    guards = RunControl(max_update_norm=run.config.train.max_update_norm, divergence_factor=0.0)
    output = settings.output
    if not output.out_dir:
        return checkpointed(guards, None, 0, stamp)
    out = Path(output.out_dir)
    if not output.resume:  # a new run: its claim moved a replaced run's checkpoints aside
        start_fresh(out, PROGRESS, checkpoints=False)
        return checkpointed(guards, out, output.checkpoint_every, stamp)
    saved = latest(out / CHECKPOINTS, stamp)
    LOG.info("resuming after round %d from %s", saved.round, saved.path)
    return checkpointed(guards, out, output.checkpoint_every, stamp, saved)


def latest(folder: Path, stamp: RunIdentity) -> Checkpoint:
    """The newest intact checkpoint in ``folder`` of the run ``stamp``: a resumed Flower run
    has one to continue (``resume = true`` with none is refused)."""
    saved = newest_checkpoint(folder, stamp, OUT_DIR_FLAGS)
    if saved is None:
        raise FedsubError(
            f"Flower run config: resume = true, but {folder} holds no checkpoint "
            "(set checkpoint-every > 0 in the run to resume, or drop resume to start over)"
        )
    return saved


def write_result(
    out: Path,
    settings: FlowerSettings,
    run: RunModel,
    name: str,
    runtime: FlowerRuntime,
    progress: Progress | None,
    failure: Diverged | RoundsFailed | None,
) -> None:
    """flower-result.json (the rounds' records, the costs, the evaluations or why the run
    failed), the model, and what a private heat source measured."""
    observers = runtime.observers
    if runtime.heat.report is not None:
        transcript = cast(Transcript | None, observers.on_heat_reply)
        train_transcript = cast(Transcript | None, observers.on_train_reply)
        write_heat(out, runtime.heat.report, transcript, train_transcript)
    assert observers.meter is not None  # the ServerApp measures its grid
    totals = observers.meter.totals
    result: dict[str, object] = {
        "algorithm": name,
        "payload": settings.payload,
        "succeeded": failure is None,
        "rounds": runtime.rounds,
        "costs": {
            **describe(run.schedule.privacy or Privacy()),
            **run_costs(runtime.rounds, totals),
        },
    }
    if failure is None and progress is not None:
        write_model(out, runtime.params)
        result["evaluations"] = {str(e.round): e.metrics for e in progress.history}
    elif failure is not None:
        kind = "diverged" if isinstance(failure, Diverged) else "failed"
        result[kind] = {"round": failure.round, "reason": failure.reason}
    write_atomic(out / "flower-result.json", dumps(result, indent=2) + "\n")


def write_heat(
    out: Path,
    report: HeatReport,
    transcript: Transcript | None,
    train_transcript: Transcript | None = None,
) -> None:
    """What the private heat exchange measured (``heat.safetensors``: per table the heat of
    every row) and, if recorded, everything the server received: in the queries, the heat
    exchange and the secure row sums (``replies``), and in the train replies
    (``train_replies``)."""
    measured = report.measured
    tensors = {f"heat.{t}": torch.from_numpy(h) for t, h in measured.heat.items()}
    write_tensors_atomic(out / "heat.safetensors", tensors)
    if transcript is not None:
        recorded = {"source": measured.source, "replies": transcript.entries}
        if train_transcript is not None:
            recorded["train_replies"] = train_transcript.entries
        write_atomic(out / "heat-transcript.json", dumps(recorded) + "\n")
