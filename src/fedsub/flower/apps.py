"""Flower ``ServerApp`` running fedsub's algorithms, and what it keeps in its out-dir: the
engine's round loop over the Flower runtime (flower/server_runtime.py); the nodes'
``make_client_app`` (flower/client_app.py) is importable from here too.

The ServerApp sizes the model from the config and the spec (flower/run_model.py) and never
reads a client's samples: index sets and sample counts come from the nodes' query replies,
evaluation is federated (flower/federated_eval.py), plus an optional ``server-test-file`` the
server reads with the spec. ``FlowerSettings`` given to the factories fix the settings in code
(tests, scripts); without them they are read from the run config (``flwr run ...
--run-config``).

The out-dir's rules and session are ``fedsub run``'s (runs/run_identity.py,
runs/run_session.py); Flower's own are the config kept in run.json and hashed with the Flower
settings that decide the model (``started_with``), one run id for every ``flwr run`` of a
config (``RUN_ID``), ``resume = true`` refused without a checkpoint (``latest``) and the result
(flower-result.json, heat.safetensors)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import cast

import torch
from flwr.app import Context
from flwr.common.logger import FLOWER_LOGGER
from flwr.serverapp import Grid, ServerApp

from fedsub import config as config_lib
from fedsub.algorithms.registry import MeasuredHeat
from fedsub.config import Config
from fedsub.engine.checkpoint import Checkpoint
from fedsub.engine.features.private import server_heat
from fedsub.engine.federated_metrics import server_test_metrics
from fedsub.engine.loop import Progress, RunControl
from fedsub.engine.round_records import RoundsFailed, run_costs
from fedsub.engine.server_round import Diverged, ServerRound
from fedsub.errors import FedsubError
from fedsub.files.atomic_files import TEMP_PATTERN
from fedsub.files.json_values import dumps
from fedsub.files.run_folder import (
    CHECKPOINTS,
    FLOWER_PROGRESS,
    FLOWER_RESULT,
    RUN_FILE,
    RunIdentity,
    checkpoint_outputs,
)
from fedsub.files.tensor_files import write_tensors_atomic
from fedsub.flower.client_app import make_client_app, settings_of
from fedsub.flower.costs import MeteredGrid
from fedsub.flower.fedbuff_server import asynchronous
from fedsub.flower.polls import quick_object_pulls, wide_object_transfers
from fedsub.flower.protocols import Transcript
from fedsub.flower.run_model import RunModel, run_model
from fedsub.flower.server_runtime import FlowerRuntime, Observers, Served
from fedsub.flower.settings import INITIAL_MODEL, OUT_DIR_FLAGS, FlowerSettings
from fedsub.runs.initial_model import starting_params
from fedsub.runs.report import JsonLines, write_atomic
from fedsub.runs.run_identity import (
    StartedWith,
    newest_checkpoint,
)
from fedsub.runs.run_session import MODEL_FILE, Attempt, Keeps, RunSession, Tracked, write_model
from fedsub.runs.run_setup import heat_privacy_of
from fedsub.runs.tracking import (
    RunCallback,
    tracking_outputs,
    writers_of,
)
from fedsub.submodel.heat import HeatKind
from fedsub.submodel.params import Params

__all__ = ["make_client_app", "make_server_app"]
LOG = logging.getLogger("fedsub")

RUN_ID = "flower"  # Flower gives each `flwr run` a new run id: the config hash identifies it
CONFIG_KEY = "config"  # run.json's key of the fedsub config as written

# What a Flower run writes in its out-dir (its run.json manifest; files/run_folder.py).
FLOWER_OUTPUTS = [
    RUN_FILE,
    FLOWER_PROGRESS,
    FLOWER_RESULT,
    MODEL_FILE,
    "heat.safetensors",
    "heat-transcript.json",
    TEMP_PATTERN,
    *checkpoint_outputs(CHECKPOINTS),
]


def make_server_app(
    fixed: FlowerSettings | None = None, callbacks: Sequence[RunCallback] = ()
) -> ServerApp:
    """The ServerApp (``fixed``: its settings in code, else the run config's); ``callbacks``:
    after-round hooks (runs/tracking.py) beside the config's ``[tracking]``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        one_line_errors()
        quick_object_pulls()  # replies read as their objects arrive (flower/polls.py)
        wide_object_transfers()  # a message's objects sent and read 8 at a time (polls.py)
        _serve(grid, settings_of(fixed, context), tuple(callbacks))

    return app


class OneLineErrors(logging.Filter):
    """Flower logs a ServerApp's exception with its traceback ("ServerApp raised an
    exception"); a ``FedsubError`` (a config the ServerApp refuses, a run that failed) is the
    operator's, not a bug: it becomes one ``fedsub: error: ...`` line, as the CLI prints it.
    Flower still marks the run failed with the error's text."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, FedsubError):
            record.msg, record.args = "fedsub: error: %s", (str(error),)
            record.exc_info, record.exc_text = None, None
        return True


def one_line_errors() -> None:
    """Install ``OneLineErrors`` on Flower's logger (once per process)."""
    if not any(isinstance(f, OneLineErrors) for f in FLOWER_LOGGER.filters):
        FLOWER_LOGGER.addFilter(OneLineErrors())


def _serve(grid: Grid, settings: FlowerSettings, callbacks: tuple[RunCallback, ...] = ()) -> None:
    """The ServerApp's run: the model's sizes (the server reads no client's samples) and the
    algorithm from the run config, the out-dir claimed, the engine's round loop over the
    Flower runtime in the run's session (runs/run_session.py), then the result (a run that
    fails before it has a result leaves the out-dir as it found it)."""
    run = run_model(settings)
    name = settings.algorithm_name(run.config)
    # round 0's model, a model file checked before the out-dir is touched
    start = starting_params(
        run.model, run.schedule, settings.deployment.initial_model, INITIAL_MODEL
    )
    output = settings.output  # the out-dir, held for the run (run_folder's rules)
    trackers = (*writers_of(run.config.tracking, bool(output.out_dir)), *callbacks)
    out = Path(output.out_dir) if output.out_dir else None
    opened = RunSession.opened(out, output.resume, output.overwrite, OUT_DIR_FLAGS)
    with opened as session:
        run_stamp(settings, session, config_lib.to_toml(run.config), name, run.config)
        attempt = open_attempt(settings, session, run, trackers, name)
        runtime = _runtime(grid, settings, run, start, name, attempt)
        # divergence is a non-finite train loss only: a Flower run has no round-0 evaluation
        # (no node has registered yet) for the rising-loss rule
        guards = RunControl(max_update_norm=run.config.train.max_update_norm, divergence_factor=0.0)
        failure: Diverged | RoundsFailed | None = None
        progress = None
        # after its first round a run keeps what it wrote whatever happens next (run.json,
        # progress.jsonl, checkpoints), as `fedsub run` does: files/run_folder.py's Claim
        try:
            driven = asynchronous(runtime, run.config.clock)  # FedBuff: fedbuff_server.py
            progress = attempt.drive(driven.open, driven, runtime.schedule, guards)
        except (Diverged, RoundsFailed) as error:  # the run fails; the result says why
            failure = error
        except Exception as error:
            attempt.end(error)
            if session.trained:
                LOG.error("%s", stopped_line(error, settings, runtime, attempt.rounds))
            raise
        attempt.end(failure)
        session.training_started()  # a result to keep, even a failure's
        if out is not None:
            write_result(out, runtime, progress, failure)
        if failure is not None:  # the ServerApp exits with an error: the run did not succeed
            # nodes that failed may be back: a resume retries; a diverged run would again
            failed = isinstance(failure, RoundsFailed)
            hint = resume_hint(settings, attempt.rounds) if failed else ""
            raise FedsubError(f"Flower: {failure}{hint}") from failure


def open_attempt(
    settings: FlowerSettings,
    session: RunSession,
    run: RunModel,
    trackers: Sequence[RunCallback],
    name: str,
) -> Attempt:
    """The run's rounds in its out-dir (``session``): checkpoints every checkpoint-every
    rounds, the newest of them continued with ``resume`` (refused without one: ``latest``);
    a new run forgets an earlier progress.jsonl (its claim moved a replaced run's
    checkpoints aside). Evaluations are kept in flower-result.json, not metrics.jsonl."""
    output = settings.output
    saved = None
    if output.out_dir and output.resume:
        assert session.identity is not None
        saved = latest(Path(output.out_dir) / CHECKPOINTS, session.identity)
        LOG.info("resuming after round %d from %s", saved.round, saved.path)
    every = output.checkpoint_every if output.out_dir else 0
    keeps = Keeps(metrics=False, fresh=(FLOWER_PROGRESS,), fresh_checkpoints=False)
    tracked = Tracked.of(trackers, run.config, name, name, "flower")
    return session.attempt("", saved, every, keeps, tracked)


def resume_hint(settings: FlowerSettings, rounds: ServerRound | None) -> str:
    """How to continue a run that stopped: from its newest checkpoint, if it wrote one."""
    output = settings.output
    saved = rounds.last_checkpoint if rounds is not None else None
    if not output.out_dir:
        return ""
    if saved is None:
        none = " (checkpoint-every = 0)" if not output.checkpoint_every else ""
        return (
            f"; {output.out_dir} keeps what the run wrote, but no checkpoint to resume "
            f"from{none}: start again with overwrite = true"
        )
    return (
        f"; {output.out_dir} keeps what the run wrote: to continue after its newest "
        f"checkpoint ({saved.name}), run `flwr run` again with the same run config and "
        "resume=true"
    )


def stopped_line(
    error: Exception, settings: FlowerSettings, runtime: FlowerRuntime, rounds: ServerRound | None
) -> str:
    """The line a run that stopped after training began logs before its error: the last
    round it finished, that nothing it wrote is lost, and how to resume."""
    done = runtime.rounds[-1]["round"] if runtime.rounds else 0
    what = f"{type(error).__name__}: {error}"
    return f"fedsub: the run stopped after round {done} ({what}){resume_hint(settings, rounds)}"


def _runtime(
    grid: Grid,
    settings: FlowerSettings,
    run: RunModel,
    start: Params,
    name: str,
    attempt: Attempt,
) -> FlowerRuntime:
    """The run's Flower runtime of algorithm ``name`` from round 0's model ``start``: its nodes
    through ``grid``, measured (flower/costs.py); its round records to progress.jsonl and
    ``attempt``'s trackers."""
    privacy = heat_privacy_of(run.config)
    transcripts = settings.output.heat_transcript and privacy.source != "exact"
    out = settings.output.out_dir
    observers = Observers(
        on_progress=attempt.reporting(JsonLines(Path(out) / FLOWER_PROGRESS) if out else None),
        transcript=Transcript() if transcripts else None,
        meter=MeteredGrid(grid),
    )
    query: dict[str, int | str] = {}
    server_test = None  # read before any node is asked: a bad file fails the run at once
    if run.spec is not None:  # every node checks its spec against the run's
        query = {"spec-version": run.spec.version, "spec-hash": run.spec.hash}
        if settings.deployment.server_test_file:
            samples = run.spec.encode(Path(settings.deployment.server_test_file))
            server_test = functools.partial(server_test_metrics, run.model, samples=samples)
    min_nodes = settings.nodes.min_nodes or run.num_clients
    heat = cast(HeatKind, run.config.train.heat)
    return FlowerRuntime(
        cast(Grid, observers.meter),  # a Grid: its methods, measured (flower/costs.py)
        start,
        Served(name, run.config.algorithm_options(name), heat),
        run.schedule,
        replace(settings, nodes=replace(settings.nodes, min_nodes=min_nodes)),
        server_heat(privacy),
        query,
        observers,
        server_test,
        partitions=run.num_clients,
    )


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


def run_stamp(
    settings: FlowerSettings,
    session: RunSession,
    text: str,
    name: str,
    config: Config | None = None,
) -> RunIdentity:
    """The stamp of the run's checkpoints: its config hash (runs/run_identity.py; ``text``, the
    fedsub config as written), a resumed run's after checking that the config given is that
    run's, a new run's written to its out-dir (``session``; with what ``config``'s trackers
    write there); its run id Flower's one (``RUN_ID``)."""
    started = started_with(settings, name)
    tracked = [] if config is None else tracking_outputs(config.tracking, [""])
    record = {"kind": "flower", "outputs": [*FLOWER_OUTPUTS, *tracked]}
    session.begin(text, started, record)
    return session.stamped(RUN_ID)


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
    runtime: FlowerRuntime,
    progress: Progress | None,
    failure: Diverged | RoundsFailed | None,
) -> None:
    """flower-result.json (the rounds' records, the costs, the evaluations or why the run
    failed), the model, and what a private heat source measured."""
    observers = runtime.observers
    if runtime.heat.report is not None:
        write_heat(out, runtime.heat.report.measured, observers.transcript)
    assert observers.meter is not None  # the ServerApp measures its grid
    result: dict[str, object] = {
        "algorithm": runtime.served.name,
        "payload": runtime.settings.payload,
        "succeeded": failure is None,
        "rounds": runtime.rounds,
        "costs": {
            **runtime.privacy_described(),
            **run_costs(runtime.rounds, observers.meter.totals),
        },
    }
    # [dp]: the model's epsilon after the rounds run, where the noise and cohorts came from
    result.update(runtime.dp_result())
    if failure is None and progress is not None:
        write_model(out, runtime.params)
        result["evaluations"] = {str(e.round): e.metrics for e in progress.history}
    elif failure is not None:
        kind = "diverged" if isinstance(failure, Diverged) else "failed"
        result[kind] = {"round": failure.round, "reason": failure.reason}
    write_atomic(out / FLOWER_RESULT, dumps(result, indent=2) + "\n")


def write_heat(out: Path, measured: MeasuredHeat, transcript: Transcript | None) -> None:
    """What the private heat exchange measured (``heat.safetensors``: per table the heat of
    every row) and, if recorded, everything the server received: in the queries, the heat
    exchange and the secure row sums (``replies``), and in the train replies
    (``train_replies``)."""
    tensors = {f"heat.{t}": torch.from_numpy(h) for t, h in measured.heat.items()}
    write_tensors_atomic(out / "heat.safetensors", tensors)
    if transcript is not None:
        entries = transcript.entries
        recorded = {
            "source": measured.source,
            "replies": [e for e in entries if e["stage"] != "train"],
            "train_replies": [e for e in entries if e["stage"] == "train"],
        }
        write_atomic(out / "heat-transcript.json", dumps(recorded) + "\n")
