"""The round loop: sample a cohort, run client work on submodels, aggregate, apply, evaluate.

Everything that differs between algorithms comes from the ``Algorithm`` (fedsub.algorithms):
the scheme's sampler and weighting, the local rule, control variates, the server optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsub import distributed, seeding, segment_sum
from fedsub.algorithms.aggregation import ServerUpdate, aggregate, aggregation_weights
from fedsub.algorithms.registry import Algorithm
from fedsub.algorithms.scaffold import ControlVariates
from fedsub.data.federated import FederatedDataset
from fedsub.dp.ledger import Ledger
from fedsub.dp.mechanism import DpMechanism, empty_update
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine import masked, placement
from fedsub.engine.backends import backend_for
from fedsub.engine.divergence import divergence_reason
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.guards import Rejection
from fedsub.engine.private_rounds import PrivateRounds
from fedsub.engine.schedule import Schedule
from fedsub.engine.server_round import Diverged, ServerRound
from fedsub.engine.split_cohort import split_cohort
from fedsub.json_values import metrics_from_json, nulled
from fedsub.masking.aggregate import MaskedCohortUpdate, aggregate_slices
from fedsub.models.base import Model
from fedsub.profiling import ROUND, timed
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params

LOG = logging.getLogger("fedsub")


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


def initial_params(model: Model, schedule: Schedule) -> Params:
    """The seeded initial model on ``schedule.device``: drawn on the CPU and copied there, so
    every device starts from the same numbers."""
    generator = torch.Generator().manual_seed(
        int(seeding.rng(schedule.seed, seeding.INIT).integers(2**62))
    )
    return model.init(generator, schedule.dtype).to(schedule.device)


def pooled(dataset: FederatedDataset) -> FederatedDataset:
    """All training data as one client (CentralSGD)."""
    offsets = np.array([0, len(dataset.train)], dtype=np.int64)
    return dataclasses.replace(dataset, name=f"{dataset.name} (pooled)", client_offsets=offsets)


def central_setup(
    dataset: FederatedDataset, schedule: Schedule
) -> tuple[FederatedDataset, SubmodelIndex, Schedule]:
    """CentralSGD as a round of one client holding every sample, batch K * B, I steps."""
    central = pooled(dataset)
    return (
        central,
        SubmodelIndex.build(central),
        dataclasses.replace(
            schedule,
            clients_per_round=1,
            batch_size=schedule.clients_per_round * schedule.batch_size,
        ),
    )


def private_rounds(
    algorithm: Algorithm, schedule: Schedule, params: Params
) -> PrivateRounds | None:
    """The round's privacy stages (``train.privacy``), or None: no privacy configured, width
    slices (config.py refuses private levels with masking), or CentralSGD (the pooled
    reference has no clients to protect)."""
    masked_run = schedule.masking is not None and schedule.masking.scheme != "none"
    if schedule.privacy is None or algorithm.central or masked_run:
        return None
    table_rows = {t: int(table.shape[0]) for t, table in params.tables.items()}
    aggregation = algorithm.aggregation.to(schedule.device)
    # [dp] at "full": the clients add the noise (distributed DP, dp/distributed.py)
    dp = schedule.dp if schedule.privacy.secure_aggregation else None
    return PrivateRounds(schedule.privacy, aggregation, table_rows, schedule.seed, dp=dp)


def round_stages(
    model: Model,
    algorithm: Algorithm,
    schedule: Schedule,
    params: Params,
    private: PrivateRounds | None = None,
    host: placement.HostTables | None = None,
) -> tuple[Callable, Callable]:
    """The round's client work (the configured backend, on width slices when masking) and how
    its updates become the server's update (through ``private`` when given; brought to the host
    tables when ``host``). Under torchrun (a joined process group) the members are split across
    the processes (engine/split_cohort.py)."""
    run_cohort = backend_for(schedule.backend, model, algorithm.name).run_cohort
    processes = distributed.joined()
    if processes is not None:
        run_cohort = split_cohort(run_cohort, processes)
    masking = schedule.masking
    if private is not None:  # config.py refuses privacy with host placement
        return private.wrap(run_cohort), private.combine
    aggregation = algorithm.aggregation
    received: Callable[[ServerUpdate], ServerUpdate] = lambda update: update  # noqa: E731
    if host is not None:  # the per-row coefficients stay on the host (HostTables.receive)
        aggregation, received = dataclasses.replace(aggregation, coefficients=None), host.receive
    aggregation = aggregation.to(schedule.device)
    if masking is None or masking.scheme == "none":
        return run_cohort, lambda update: received(aggregate(update, aggregation))

    def combine(update: MaskedCohortUpdate) -> ServerUpdate:
        weights = aggregation_weights(update, aggregation)
        return received(aggregate_slices(update, weights, params.dense, masking.aggregation))

    return functools.partial(masked.run_cohort, masking=masking, inner=run_cohort), combine


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
    divergence_factor: float = 0.0  # engine/divergence.py; 0: only non-finite losses diverge
    run: dict[str, str] = dataclasses.field(default_factory=dict)  # stamped on checkpoints
    # given the run's privacy stages before round 1 (to keep a transcript, read the costs)
    on_private_rounds: Callable[[PrivateRounds], None] | None = None


@dataclass
class Progress:
    """What a run has done so far (saved in its checkpoints): the last finished round, its
    evaluations and its training seconds."""

    round: int = 0
    history: list[Evaluation] = dataclasses.field(default_factory=list)
    elapsed: float = 0.0


def build_server_round(
    algorithm: Algorithm,
    dataset: FederatedDataset,
    index: SubmodelIndex,
    schedule: Schedule,
    params: Params,
    combine: Callable[[Any], ServerUpdate],
    control: RunControl,
) -> ServerRound:
    """The server half of the run's rounds, with every stateful stage freshly initialised."""
    variates = (
        ControlVariates(params, index, dataset.num_clients) if algorithm.control_variates else None
    )
    mechanism, ledger = None, None
    if schedule.dp is not None:
        ledger = Ledger(schedule.dp)
    distributed = schedule.privacy is not None and schedule.privacy.secure_aggregation
    if schedule.dp is not None and not distributed:  # the central Gaussian mechanism
        table_rows = {t: int(table.shape[0]) for t, table in params.tables.items()}
        heat = algorithm.aggregation.coefficients is not None  # FedSubAvg: private heat
        keep = schedule.privacy.keep if schedule.privacy is not None else 1.0
        counts = dataset.sample_counts()
        mechanism = DpMechanism(schedule.dp, table_rows, counts, heat, keep)
    return ServerRound(
        algorithm,
        schedule,
        dataset.sample_counts(),
        params,
        algorithm.make_server(params),
        combine,
        variates,
        control.max_update_norm,
        control.on_reject,
        dp=mechanism,
        ledger=ledger,
    )


def resume(rounds: ServerRound, saved: checkpoint_lib.Checkpoint) -> Progress:
    """Restore every stage of ``rounds`` from ``saved``; the run goes on after its round."""
    checkpoint_lib.restore(rounds.stages(), saved, rounds.params.device)
    rounds.last_checkpoint = saved.path  # the last good checkpoint, until this run writes one
    return Progress(saved.round, [Evaluation.from_record(e) for e in saved.history], saved.elapsed)


def save_checkpoint(
    folder: Path, rounds: ServerRound, progress: Progress, run: dict[str, str]
) -> Path:
    """Every stage's state and the progress so far, after round ``progress.round``."""
    return checkpoint_lib.save(
        folder,
        checkpoint_lib.Checkpoint(
            round=progress.round,
            stages=checkpoint_lib.capture(rounds.stages()),
            elapsed=progress.elapsed,
            history=[e.as_record() for e in progress.history],
            run=run,
        ),
    )


def evaluate(
    evaluator: Evaluator,
    params: Params,
    progress: Progress,
    divergence_factor: float,
    on_evaluation: Callable[[Evaluation], None] | None,
    ledger: Ledger | None = None,
) -> str | None:
    """Evaluate the model after ``progress.round`` and record it (with the epsilon spent so
    far under [dp]); why the run diverged (the evaluation is recorded and reported first: it
    shows why), or None."""
    metrics = evaluator.evaluate(params)
    if ledger is not None:
        metrics["epsilon"] = ledger.epsilon()
    evaluation = Evaluation(progress.round, metrics, progress.elapsed)
    initial = progress.history[0].metrics["train_loss"] if progress.history else None
    reason = divergence_reason(evaluation.metrics["train_loss"], initial, divergence_factor)
    progress.history.append(evaluation)
    if on_evaluation is not None:
        on_evaluation(evaluation)
    return reason


def keep_safe(rounds: ServerRound, progress: Progress, control: RunControl, last: int) -> None:
    """After a round: checkpoint when due or when a stop is requested, then stop if asked
    (``Interrupted``). Nothing is saved after the last round: the run is complete."""
    stop = control.stop_requested()
    if progress.round >= last:
        return
    due = control.checkpoint_every and progress.round % control.checkpoint_every == 0
    if (due or stop) and control.checkpoints is not None:
        rounds.last_checkpoint = save_checkpoint(control.checkpoints, rounds, progress, control.run)
    if stop:
        raise Interrupted(progress.round, rounds.last_checkpoint)


def stop_for_budget(
    ledger: Ledger,
    round_index: int,
    progress: Progress,
    evaluate_now: Callable[[], None],
    every: int,
) -> None:
    """Stop before round ``round_index``, whose mechanism would spend more than the budget:
    say so, and evaluate the model the run ends with (unless that round was evaluated)."""
    spent, after = ledger.epsilon(), ledger.settings.epsilon(ledger.rounds + 1)
    LOG.warning(
        "stopped before round %d: its mechanism would bring epsilon from %.4g to %.4g, over "
        "the budget %.4g (dp.epsilon_budget or dp.target_epsilon) at delta %.3g",
        round_index,
        spent,
        after,
        ledger.settings.budget,
        ledger.settings.delta,
    )
    if progress.round % every != 0:
        evaluate_now()


def train(
    model: Model,
    algorithm: Algorithm,
    dataset: FederatedDataset,
    index: SubmodelIndex,
    schedule: Schedule,
    evaluator: Evaluator | None = None,
    on_evaluation: Callable[[Evaluation], None] | None = None,
    on_round: Callable[[int], None] | None = None,
    control: RunControl | None = None,
) -> Params:
    """``run_rounds``, under ``torch.use_deterministic_algorithms`` when
    ``schedule.deterministic`` (train.deterministic; fedsub/segment_sum.py)."""
    with segment_sum.deterministic_run(schedule.deterministic):
        return run_rounds(
            model,
            algorithm,
            dataset,
            index,
            schedule,
            evaluator,
            on_evaluation,
            on_round,
            control,
        )


def run_rounds(
    model: Model,
    algorithm: Algorithm,
    dataset: FederatedDataset,
    index: SubmodelIndex,
    schedule: Schedule,
    evaluator: Evaluator | None = None,
    on_evaluation: Callable[[Evaluation], None] | None = None,
    on_round: Callable[[int], None] | None = None,
    control: RunControl | None = None,
) -> Params:
    """Run ``schedule.rounds`` rounds of ``algorithm``; evaluate at round 0, every
    ``eval_every`` rounds and at the last round. Returns the final global model.

    With ``control.resume`` the run continues after the checkpoint's round and ends with the
    same model and evaluations as an uninterrupted run. Under torchrun with [dp] every process
    adds the same noise (dp/mechanism.py draws it on the host from a generator keyed by seed
    and round, after the gather), so the processes' models stay equal."""
    control = control or RunControl()
    if algorithm.central:
        dataset, index, schedule = central_setup(dataset, schedule)
    if algorithm.whole_model:  # every client trains (and sends) every row (exact SCAFFOLD)
        index = SubmodelIndex.whole_model(dataset)
    host = None
    if schedule.table_placement == "host":  # drawn on the host, the tables never leave it
        drawn = initial_params(model, dataclasses.replace(schedule, device=placement.HOST))
        params = placement.place(drawn, schedule.device)
        host = placement.HostTables.of(algorithm, schedule.device)
    else:
        params = initial_params(model, schedule)
    private = private_rounds(algorithm, schedule, params)
    if private is not None and control.on_private_rounds is not None:
        control.on_private_rounds(private)
    run_cohort, combine = round_stages(model, algorithm, schedule, params, private, host)
    rounds = build_server_round(algorithm, dataset, index, schedule, params, combine, control)
    if host is not None:
        placement.check_row_local(algorithm, rounds.server)
    progress = Progress() if control.resume is None else resume(rounds, control.resume)

    def evaluate_and_check() -> None:
        if evaluator is None:
            return
        with timed("evaluation"):
            evaluated = params if host is None else params.to(placement.HOST)
            reason = evaluate(
                evaluator,
                evaluated,
                progress,
                control.divergence_factor,
                on_evaluation,
                rounds.ledger,
            )
        if reason is not None:
            raise Diverged(algorithm.name, progress.round, reason, rounds.last_checkpoint)

    if control.resume is None:
        evaluate_and_check()
    for r in range(progress.round + 1, schedule.rounds + 1):
        if rounds.ledger is not None and rounds.ledger.would_exceed():
            stop_for_budget(rounds.ledger, r, progress, evaluate_and_check, schedule.eval_every)
            break
        with timed(ROUND):  # fedsub/profiling.py: the phases of the round, when profiled
            started = time.perf_counter()
            with timed("cohort"):
                plan = rounds.begin(r)
            if len(plan.cohort) == 0:  # an empty Poisson draw
                if rounds.dp is not None:  # the noise is added all the same
                    rounds.finish(plan, empty_update(params))
            else:
                with timed("pull"):
                    staged = params if host is None else host.stage(params, index, plan.cohort)
                update = run_cohort(
                    model, staged, dataset, index, plan.cohort, r, schedule, plan.work
                )
                rounds.finish(plan, update)
            progress.elapsed += time.perf_counter() - started
            progress.round = r
            if r % schedule.eval_every == 0 or r == schedule.rounds:
                evaluate_and_check()
            if on_round is not None:
                on_round(r)
            with timed("checkpoint"):
                keep_safe(rounds, progress, control, schedule.rounds)
    return params
