"""Experiment tracking as after-round hooks: every round's metrics and the config, written to
TensorBoard and MLflow by those libraries themselves (the ``tracking`` extra).

A ``RunCallback`` sees one algorithm's run: ``on_train_begin`` (the run's name, its config as
flat parameters, the round it resumes after), ``after_round`` (the round's metrics: the
evaluation's, as metrics.jsonl has them, when the round was evaluated; epsilon under [dp];
the runtime's own per-round record, e.g. a Flower round's replies, bytes and seconds) and
``on_train_end`` (``"finished"``, ``"diverged"``, ``"stopped"`` or ``"failed"``). The config's
``[tracking]`` chooses the built-in writers (``writers_of``); the Python API takes any
callbacks (``fedsub.train(..., callbacks=[...])``). ``RoundFeed`` turns the round loop's hooks
(engine/loop.py's ``on_evaluation`` and ``on_round``, a runtime's round records) into those
calls, for every runtime. No writer changes a number the run computes.
"""

from __future__ import annotations

import math
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsub.config import Config, TrackingConfig
from fedsub.engine.loop import Evaluation, Interrupted
from fedsub.engine.server_round import Diverged
from fedsub.errors import ConfigError, FedsubError

EXTRA = "pip install 'fedsub[tracking]'"
TENSORBOARD_FOLDER = "tensorboard"  # in an algorithm's folder, by default
MLFLOW_FILE = "mlflow.db"  # at the top of the run folder, by default
MLFLOW_MAX_PARAM = 6000  # MLflow's longest parameter value (characters)
# a writer whose default place is the run folder, in a run without one
NO_FOLDER = {
    "tensorboard": (
        "tracking.tensorboard = true writes into the run folder (<algorithm>/tensorboard/, a "
        "Flower out-dir's tensorboard/), and this run has none: set tracking.tensorboard_dir, "
        "or give the run a folder (out=, --out, out-dir)"
    ),
    "mlflow": (
        "tracking.mlflow = true keeps its store in the run folder (mlflow.db), and this run has "
        "none: set tracking.mlflow_uri (e.g. 'sqlite:///mlflow.db'), or give the run a folder "
        "(out=, --out, out-dir)"
    ),
}


@dataclass(frozen=True)
class TrackedRun:
    """One algorithm's run as the trackers see it: ``algorithm``; ``name`` (the run's name:
    ``[tracking] run_name`` + a sweep's value + the algorithm); ``params``, the config as flat
    ``section.key`` parameters; ``folder``, where the run's own files go in the run folder
    (an algorithm's folder; a Flower out-dir) and ``run_folder`` the run folder itself (None:
    a run without one); ``resumed_after``, the round a resumed run continues after (0: a new
    run); ``runtime``: ``"in-process"`` or ``"flower"``."""

    algorithm: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    folder: Path | None = None
    run_folder: Path | None = None
    resumed_after: int = 0
    runtime: str = "in-process"


class RunCallback:
    """An after-round hook: override what you need (each does nothing here)."""

    def on_train_begin(self, run: TrackedRun) -> None:
        """Before the run's first round (a resumed run's first round after its checkpoint)."""

    def after_round(self, run: TrackedRun, round_index: int, metrics: Mapping[str, float]) -> None:
        """After round ``round_index`` (round 0: the initial model's evaluation): its metrics."""

    def on_train_end(self, run: TrackedRun, status: str) -> None:
        """After the run: ``finished``, ``diverged``, ``stopped`` (a checkpoint to resume
        from) or ``failed``."""


def flat_params(config: Config) -> dict[str, Any]:
    """The config as flat parameters, ``section.key`` -> value, as config.toml writes it."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, table: Mapping[str, Any]) -> None:
        for key, value in table.items():
            if isinstance(value, Mapping):
                walk(f"{prefix}{key}.", value)
            else:
                flat[f"{prefix}{key}"] = value

    walk("", tomllib.loads(config.to_toml()))
    return flat


def _missing(package: str, what: str) -> FedsubError:
    return FedsubError(f"{what} needs the {package} package, which is not installed: {EXTRA}")


class TensorBoardWriter(RunCallback):
    """TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``), one folder per run:
    ``log_dir/<algorithm>`` (``log_dir`` None: the run folder's ``<algorithm>/tensorboard``);
    each metric a scalar by round, the config a text summary. A resumed run purges the events
    after its checkpoint's round (``purge_step``), so the curves read as one run's."""

    def __init__(self, log_dir: str | Path | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard", "TensorBoardWriter ([tracking] tensorboard)") from None
        self._writer_class = SummaryWriter
        self.log_dir = None if log_dir is None else Path(log_dir)
        self._writers: dict[str, Any] = {}

    def folder_of(self, run: TrackedRun) -> Path:
        """Where ``run``'s event files go."""
        if self.log_dir is not None:
            return self.log_dir / run.name.replace("/", "%2F")
        if run.folder is None:
            raise ConfigError(NO_FOLDER["tensorboard"])
        return run.folder / TENSORBOARD_FOLDER

    def on_train_begin(self, run: TrackedRun) -> None:
        purge = run.resumed_after + 1 if run.resumed_after else None
        writer = self._writer_class(log_dir=str(self.folder_of(run)), purge_step=purge)
        self._writers[run.name] = writer
        table = "\n".join(f"| {k} | {v} |" for k, v in run.params.items())
        writer.add_text("config", f"| key | value |\n|---|---|\n{table}", 0)

    def after_round(self, run: TrackedRun, round_index: int, metrics: Mapping[str, float]) -> None:
        writer = self._writers[run.name]
        for key, value in metrics.items():
            writer.add_scalar(key, value, round_index)
        writer.flush()

    def on_train_end(self, run: TrackedRun, status: str) -> None:
        writer = self._writers.pop(run.name, None)
        if writer is not None:
            writer.close()


class MlflowWriter(RunCallback):
    """One MLflow run per algorithm's run (``mlflow.tracking.MlflowClient``) in ``experiment``
    at ``tracking_uri`` (None: the SQLite store ``sqlite:///<run folder>/mlflow.db``): the
    config as parameters, every metric by round (``step``), tags naming the algorithm and the
    runtime. A resumed run is a new MLflow run (tagged ``fedsub.resumed_after``) that logs the
    rounds its checkpoint kept again, so each run holds every evaluation, as metrics.jsonl."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = "fedsub") -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow-skinny", "MlflowWriter ([tracking] mlflow)") from None
        self._client_class = MlflowClient
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self._runs: dict[str, tuple[Any, str]] = {}  # run name -> (client, MLflow run id)

    def uri_of(self, run: TrackedRun) -> str:
        """The tracking URI ``run`` writes to."""
        if self.tracking_uri:
            return self.tracking_uri
        if run.run_folder is None:
            raise ConfigError(NO_FOLDER["mlflow"])
        return f"sqlite:///{(run.run_folder / MLFLOW_FILE).resolve()}"

    def on_train_begin(self, run: TrackedRun) -> None:
        from mlflow.entities import Param

        client = self._client_class(tracking_uri=self.uri_of(run))
        found = client.get_experiment_by_name(self.experiment)
        experiment = found.experiment_id if found else client.create_experiment(self.experiment)
        tags = {"fedsub.algorithm": run.algorithm, "fedsub.runtime": run.runtime}
        if run.resumed_after:
            tags["fedsub.resumed_after"] = str(run.resumed_after)
        created = client.create_run(experiment, run_name=run.name, tags=tags)
        params = [Param(k, str(v)[:MLFLOW_MAX_PARAM]) for k, v in run.params.items()]
        for start in range(0, len(params), 100):  # MLflow's most parameters per batch
            client.log_batch(created.info.run_id, params=params[start : start + 100])
        self._runs[run.name] = (client, created.info.run_id)

    def after_round(self, run: TrackedRun, round_index: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        client, run_id = self._runs[run.name]
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, round_index) for k, v in metrics.items()]
        client.log_batch(run_id, metrics=batch)

    def on_train_end(self, run: TrackedRun, status: str) -> None:
        entry = self._runs.pop(run.name, None)
        if entry is None:
            return
        client, run_id = entry
        ended = {"finished": "FINISHED", "stopped": "KILLED"}.get(status, "FAILED")
        client.set_tag(run_id, "fedsub.status", status)
        client.set_terminated(run_id, ended)


def writers_of(tracking: TrackingConfig, has_folder: bool = True) -> list[RunCallback]:
    """The writers ``[tracking]`` chooses (a missing library: an error naming the extra; a
    writer whose default place is the run folder, in a run without one: an error naming the
    key to set)."""
    if not has_folder and tracking.tensorboard and not tracking.tensorboard_dir:
        raise ConfigError(NO_FOLDER["tensorboard"])
    if not has_folder and tracking.mlflow and not tracking.mlflow_uri:
        raise ConfigError(NO_FOLDER["mlflow"])
    writers: list[RunCallback] = []
    if tracking.tensorboard:
        writers.append(TensorBoardWriter(tracking.tensorboard_dir or None))
    if tracking.mlflow:
        writers.append(MlflowWriter(tracking.mlflow_uri or None, tracking.mlflow_experiment))
    return writers


def tracking_outputs(tracking: TrackingConfig, folders: Sequence[str]) -> list[str]:
    """What the writers put in the run folder (its run.json manifest's entries); ``folders``:
    the runs' own folders in it (an algorithm's; "" the run folder itself, Flower's)."""
    outputs: list[str] = []
    if tracking.tensorboard and not tracking.tensorboard_dir:
        for name in folders:
            where = f"{name}/{TENSORBOARD_FOLDER}" if name else TENSORBOARD_FOLDER
            outputs += [f"{where}/events.*", f"{where}/"]
    if tracking.mlflow and not tracking.mlflow_uri:
        outputs.append(MLFLOW_FILE)
    return outputs


def numbers(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """A record's numbers as metrics (nested records' keys joined by ``/``; texts, lists and
    None left out; a bool is 0 or 1)."""
    found: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, Mapping):
            found.update(numbers(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and key != "round":
            found[f"{prefix}{key}"] = float(value)
    return found


class RoundFeed:
    """The round loop's hooks, fed to ``callbacks`` for one run: ``evaluation`` (the loop's
    ``on_evaluation``), ``record`` (a runtime's round record, e.g. Flower's progress lines),
    ``round_done`` (the loop's ``on_round``: the round's metrics go out, with ``extra()``'s:
    epsilon under [dp], a private level's costs) and ``end``. Round 0's evaluation goes out
    at once; a round's evaluation after its last ``round_done`` (a [dp] budget stop, a
    divergence) goes out at ``end``."""

    def __init__(self, callbacks: Sequence[RunCallback], run: TrackedRun) -> None:
        self.callbacks, self.run = list(callbacks), run
        self._pending: dict[int, dict[str, float]] = {}
        self._last = time.perf_counter()
        self._open = False

    def begin(self, earlier: Sequence[Evaluation] = ()) -> None:
        """The run starts; a tracker that keeps each attempt apart (MLflow) gets the
        evaluations a resumed run's checkpoint kept again."""
        for callback in self.callbacks:
            callback.on_train_begin(self.run)
        self._open = True
        replayed = [c for c in self.callbacks if not isinstance(c, TensorBoardWriter)]
        for evaluation in earlier:
            for callback in replayed:
                callback.after_round(self.run, evaluation.round, _metrics_of(evaluation))
        self._last = time.perf_counter()

    def evaluation(self, evaluation: Evaluation) -> None:
        self._pending.setdefault(evaluation.round, {}).update(_metrics_of(evaluation))
        if evaluation.round == 0:
            self._flush(0)

    def record(self, record: Mapping[str, Any]) -> None:
        """A runtime's record of a finished round (its ``round`` key): its numbers."""
        if "round" in record:
            self._pending.setdefault(int(record["round"]), {}).update(numbers(record))

    def round_done(self, round_index: int, extra: Mapping[str, float] | None = None) -> None:
        now = time.perf_counter()
        metrics = self._pending.setdefault(round_index, {})
        metrics.setdefault("round_wall_seconds", now - self._last)
        for key, value in (extra or {}).items():
            metrics.setdefault(key, value)
        self._last = now
        for r in sorted(self._pending):
            self._flush(r)

    def end(self, status: str) -> None:
        if not self._open:
            return
        for r in sorted(self._pending):
            self._flush(r)
        self._open = False
        for callback in self.callbacks:
            callback.on_train_end(self.run, status)

    def _flush(self, round_index: int) -> None:
        metrics = self._pending.pop(round_index, {})
        if metrics:
            for callback in self.callbacks:
                callback.after_round(self.run, round_index, metrics)


def _metrics_of(evaluation: Evaluation) -> dict[str, float]:
    """An evaluation's metrics as metrics.jsonl has them (``elapsed``: training seconds so
    far); an undefined one (NaN) left out."""
    row = {**evaluation.metrics, "elapsed": evaluation.elapsed_train_seconds}
    return {k: float(v) for k, v in row.items() if not math.isnan(float(v))}


def status_of(error: BaseException | None) -> str:
    """How a run ended, for ``on_train_end``: by its error (None: finished)."""
    if error is None:
        return "finished"
    if isinstance(error, Diverged):
        return "diverged"
    return "stopped" if isinstance(error, Interrupted) else "failed"


def feed_of(
    callbacks: Sequence[RunCallback],
    run: TrackedRun,
) -> RoundFeed | None:
    """The run's feed, or None without callbacks (the loop's hooks then stay as they were)."""
    return RoundFeed(callbacks, run) if callbacks else None
