"""The round loop, for every runtime: sample a cohort, run the client work where the runtime
runs it, combine and apply the updates (engine/server_round.py), evaluate, checkpoint, resume.

It names no feature: what a feature adds to a round (a combine override, hooks before and
after a round, checkpoint stages, metrics) comes in ``ServerRound.features``
(engine/contribution.py); the in-process engine assembles them in engine/in_process.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.guards import Diverged, Rejection, divergence_reason
from fedsub.engine.round_runtime import RoundFailed, RoundRuntime
from fedsub.engine.schedule import Schedule
from fedsub.engine.server_round import ServerRound
from fedsub.files.json_values import metrics_from_json, nulled
from fedsub.profiling import ROUND, timed

__all__ = ["Diverged", "Evaluation", "Interrupted", "Progress", "RunControl", "drive"]


@dataclass(frozen=True)
class Evaluation:
    round: int
    metrics: dict[str, float]
    elapsed_train_seconds: float

    def as_json(self) -> dict:
        """One line of metrics.jsonl (an undefined metric, e.g. AUC with one class, is null)."""
        return nulled({"round": self.round, **self.metrics, "elapsed": self.elapsed_train_seconds})

    def as_record(self) -> dict:
        return nulled(
            {"round": self.round, "metrics": self.metrics, "elapsed": self.elapsed_train_seconds}
        )

    @staticmethod
    def from_record(record: dict) -> Evaluation:
        """The inverse of ``as_record`` (null metrics are NaN again)."""
        return Evaluation(record["round"], metrics_from_json(record["metrics"]), record["elapsed"])


class Interrupted(Exception):
    """Training stopped on request after a round, with a checkpoint to resume from."""

    def __init__(self, round_index: int, checkpoint: Path | None) -> None:
        super().__init__(f"stopped after round {round_index}")
        self.round = round_index
        self.checkpoint = checkpoint


@dataclass
class RunControl:
    """How a run is kept safe: checkpoints, a stop request, rejected updates."""

    checkpoints: Path | None = None
    checkpoint_every: int = 0
    max_update_norm: float = 0.0
    resume: checkpoint_lib.Checkpoint | None = None
    stop_requested: Callable[[], bool] = lambda: False
    on_reject: Callable[[Rejection], None] | None = None
    divergence_factor: float = 0.0  # guards.divergence_reason's; 0: only NaN / Inf diverge
    run: dict[str, str] = dataclasses.field(default_factory=dict)  # stamped on checkpoints
    # by feature name, given its handle before round 1 (engine/features/assembly.py: e.g. to
    # keep a transcript and read the costs)
    watch: Mapping[str, Callable[[object], None]] = dataclasses.field(default_factory=dict)


@dataclass
class Progress:
    """What a run has done so far (saved in its checkpoints): the last finished round, its
    evaluations and its training seconds."""

    round: int = 0
    history: list[Evaluation] = dataclasses.field(default_factory=list)
    elapsed: float = 0.0


def resume(rounds: ServerRound, saved: checkpoint_lib.Checkpoint) -> Progress:
    """Restore every stage of ``rounds`` from ``saved``; the run goes on after its round."""
    checkpoint_lib.restore(rounds.stages(), saved, rounds.params.device)
    rounds.checkpointed(saved.path)  # the last good checkpoint, until this run writes one
    return Progress(saved.round, evaluations_of(saved.history), saved.elapsed)


def evaluations_of(history: list[dict]) -> list[Evaluation]:
    """The evaluations of a checkpoint's history: ``Evaluation.as_record``'s entries, or (a
    Flower checkpoint written before Flower ran this loop) ``{"evaluation": r, "metrics": m}``;
    a runtime's ``{"record": ...}`` entries are its own (``RoundRuntime.restore_history``)."""
    evaluations = []
    for entry in history:
        if "evaluation" in entry:
            metrics = metrics_from_json(entry["metrics"])
            evaluations.append(Evaluation(int(entry["evaluation"]), metrics, 0.0))
        elif "record" not in entry:
            evaluations.append(Evaluation.from_record(entry))
    return evaluations


def save_checkpoint(
    folder: Path | None,
    rounds: ServerRound,
    progress: Progress,
    run: dict[str, str],
    records: list[dict] | None = None,
) -> Path:
    """Every stage's state and the progress so far, after round ``progress.round`` (and a
    runtime's own ``records``, after the evaluations in its history), written the features'
    way (``RoundFeatures.saver``: e.g. a shard each process) or into ``folder``."""
    checkpoint = checkpoint_lib.Checkpoint(
        round=progress.round,
        stages=checkpoint_lib.capture(rounds.stages()),
        elapsed=progress.elapsed,
        history=[*(e.as_record() for e in progress.history), *(records or [])],
        run=run,
    )
    if rounds.features.saver is not None:
        return rounds.features.saver.save(folder, checkpoint)
    assert folder is not None
    return checkpoint_lib.save(folder, checkpoint)


def evaluate(
    runtime: RoundRuntime,
    progress: Progress,
    divergence_factor: float,
    on_evaluation: Callable[[Evaluation], None] | None,
    rounds: ServerRound,
) -> str | None:
    """Evaluate the model after ``progress.round`` (the runtime's metrics; none: nothing is
    recorded) and record it (with the features' metrics, e.g. the epsilon spent); why the run
    diverged (the evaluation is recorded and reported first: it shows why), or None. A runtime that
    reports no train loss (Flower's nodes without held samples) is not checked."""
    metrics = runtime.evaluate(progress.round, rounds.params)
    if metrics is None:
        return None
    metrics.update(rounds.features.metrics())
    evaluation = Evaluation(progress.round, metrics, progress.elapsed)
    reason = None
    if "train_loss" in metrics:
        first = [e.metrics.get("train_loss") for e in progress.history[:1]]
        initial = first[0] if first else None
        reason = divergence_reason(metrics["train_loss"], initial, divergence_factor)
    progress.history.append(evaluation)
    if on_evaluation is not None:
        on_evaluation(evaluation)
    return reason


def keep_safe(
    rounds: ServerRound,
    progress: Progress,
    control: RunControl,
    last: int,
    records: Callable[[], list[dict]] = list,
) -> None:
    """After a round: checkpoint when due or when a stop is requested, then stop if asked
    (``Interrupted``); at round 0 (a run holding a secret, ``drive``) only checkpoint when the
    run does. Nothing is saved after the last round: the run is complete.
    ``records``: the runtime's own records, saved in the checkpoint's history. The features'
    saver decides whether this process writes (e.g. as the process holding the folder says)."""
    stop = progress.round > 0 and control.stop_requested()
    if progress.round >= last:
        return
    due = control.checkpoint_every and progress.round % control.checkpoint_every == 0
    writes = (due or stop) and control.checkpoints is not None
    saver = rounds.features.saver
    if (due or stop) and saver is not None:
        writes = saver.writes(writes)
    if writes:
        rounds.checkpointed(
            save_checkpoint(control.checkpoints, rounds, progress, control.run, records())
        )
    if stop:
        raise Interrupted(progress.round, rounds.last_checkpoint)


def run_round(rounds: ServerRound, runtime: RoundRuntime, round_index: int) -> None:
    """Round ``round_index``: who takes part, their work, and the checked server step. A round
    whose work did not come back (``RoundFailed``) leaves the model unchanged, except where a
    feature combines an empty round all the same (``ServerRound.fail``)."""
    with timed("cohort"):
        plan = rounds.begin(round_index, runtime.available(round_index, rounds))
    update = runtime.run_cohort(plan, rounds.params)
    try:
        with timed("aggregation"):  # screened and combined; the step applies it
            if isinstance(update, RoundFailed):
                step = rounds.fail(plan)
            else:
                step = rounds.server_step(plan, update)
        with timed("server step"):
            updated = step is not None and step()
    except Diverged as error:  # the runtime records it, then the run ends with it
        runtime.close_round(round_index, False, error.reason)
        raise
    runtime.close_round(round_index, updated, None)


def drive(
    rounds: ServerRound,
    runtime: RoundRuntime,
    schedule: Schedule,
    control: RunControl,
    on_evaluation: Callable[[Evaluation], None] | None = None,
    on_round: Callable[[int], None] | None = None,
) -> Progress:
    """The round loop, for every runtime: rounds after the resumed one (``control.resume``)
    up to ``schedule.rounds``, evaluated at round 0, every ``eval_every`` rounds and at the
    last, checkpointed and stopped as ``control`` says, stopped before a round a feature stops
    it at (``RoundContribution.stop_before``: a spent privacy budget)."""
    if control.resume is None:
        progress = Progress()
    else:
        progress = resume(rounds, control.resume)
        runtime.restore_history(control.resume.history)

    def evaluate_and_check() -> None:
        with timed("evaluation"):
            reason = evaluate(runtime, progress, control.divergence_factor, on_evaluation, rounds)
        if reason is not None:
            raise Diverged(rounds.algorithm.name, progress.round, reason, rounds.last_checkpoint)

    if control.resume is None:
        evaluate_and_check()
        if rounds.features.keep_from_the_start():  # a restart redraws no secret stream
            keep_safe(rounds, progress, control, schedule.rounds, runtime.history)
    for r in range(progress.round + 1, schedule.rounds + 1):
        if rounds.features.stop_before(r):  # the feature says why
            if progress.round % schedule.eval_every != 0:  # the model the run ends with
                evaluate_and_check()
            break
        with timed(ROUND):  # fedsub/profiling.py: the phases of the round, when profiled
            started = time.perf_counter()
            run_round(rounds, runtime, r)
            progress.elapsed += time.perf_counter() - started
            progress.round = r
            if r % schedule.eval_every == 0 or r == schedule.rounds:
                evaluate_and_check()
            if on_round is not None:
                on_round(r)
            with timed("checkpoint"):
                keep_safe(rounds, progress, control, schedule.rounds, runtime.history)
    return progress
