"""The round loop: sample a cohort, run client work on submodels, aggregate, apply, evaluate.

Everything that differs between algorithms comes from the ``Algorithm`` (fedsub.algorithms):
the scheme's sampler and weighting, the local rule, control variates, the server optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec

import numpy as np
import torch

from fedsub import distributed
from fedsub.algorithms.aggregation import ServerUpdate, aggregate, aggregation_weights
from fedsub.algorithms.registry import Algorithm
from fedsub.algorithms.scaffold import ControlVariates
from fedsub.data.federated import FederatedDataset, Population
from fedsub.dp.ledger import Ledger
from fedsub.dp.mechanism import DpMechanism, empty_update
from fedsub.dp.randomness import DpStreams, streams_of
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine import masked, placement
from fedsub.engine.backends import backend_for
from fedsub.engine.cohort_job import CohortJob, RunCohort, composed
from fedsub.engine.divergence import divergence_reason
from fedsub.engine.evaluate import Evaluator, eval_chunks
from fedsub.engine.guards import Rejection
from fedsub.engine.private_rounds import PrivateRounds
from fedsub.engine.round_runtime import RoundFailed, RoundRuntime
from fedsub.engine.schedule import Schedule
from fedsub.engine.server_round import Diverged, RoundPlan, ServerRound
from fedsub.engine.split_cohort import split_cohort
from fedsub.errors import ConfigError
from fedsub.files.json_values import metrics_from_json, nulled
from fedsub.masking.aggregate import MaskedCohortUpdate, aggregate_slices
from fedsub.models.base import Model
from fedsub.numerics import seeding, segment_sum
from fedsub.numerics.float32 import ieee_float32
from fedsub.profiling import ROUND, timed
from fedsub.sharding.evaluation import ShardedScoring
from fedsub.sharding.initial import sharded_init
from fedsub.sharding.model_file import WrittenModel
from fedsub.sharding.rounds import ShardedTables, ShardParams, agree, all_rejected
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params

LOG = logging.getLogger("fedsub")
P = ParamSpec("P")


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


def init_generator(seed: int) -> torch.Generator:
    """The generator the initial model is drawn with (on the CPU)."""
    return torch.Generator().manual_seed(int(seeding.rng(seed, seeding.INIT).integers(2**62)))


def initial_params(model: Model, schedule: Schedule) -> Params:
    """The seeded initial model on ``schedule.execution.device``: drawn on the CPU and copied
    there, so every device starts from the same numbers."""
    execution = schedule.execution
    return model.init(init_generator(schedule.seed), execution.dtype).to(execution.device)


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


def dp_streams(schedule: Schedule) -> DpStreams | None:
    """[dp]'s random streams for this run (dp/randomness.py): a fresh secret (process 0's in
    every process), or train.seed in seeded mode; None without [dp]. A resumed run's secret
    is read back from its checkpoint (the ``dp_secret`` stage)."""
    if schedule.dp is None:
        return None
    return streams_of(schedule.dp.randomness, schedule.seed)


def private_rounds(
    algorithm: Algorithm, schedule: Schedule, params: Params, streams: DpStreams | None = None
) -> PrivateRounds | None:
    """The round's privacy stages (``privacy.level``), or None: no privacy configured, width
    slices (config.py refuses private levels with masking), or CentralSGD (the pooled
    reference has no clients to protect)."""
    masked_run = schedule.masking is not None and schedule.masking.scheme != "none"
    if schedule.privacy is None or algorithm.central or masked_run:
        return None
    table_rows = {t: int(table.shape[0]) for t, table in params.tables.items()}
    aggregation = algorithm.aggregation.to(schedule.execution.device)
    # [dp] at "full": the clients add the noise (distributed DP, dp/distributed.py)
    dp = schedule.dp if schedule.privacy.secure_aggregation else None
    return PrivateRounds(
        schedule.privacy, aggregation, table_rows, schedule.seed, dp=dp, streams=streams
    )


def round_stages(
    model: Model,
    algorithm: Algorithm,
    schedule: Schedule,
    params: Params,
    private: PrivateRounds | None = None,
    host: placement.HostTables | None = None,
    sharded: ShardedTables | None = None,
) -> tuple[RunCohort, Callable[[Any], ServerUpdate]]:
    """The round's client work and how its updates become the server's update: the configured
    backend inside the run's stages, innermost first (split across the processes of a joined
    torchrun group, engine/split_cohort.py; on width slices when masking; through the
    members' requests when ``private``; on the rows staged on the device when ``host``); with
    ``sharded`` tables the members run where their process is and their row updates are
    routed to the rows' owners (fedsub/sharding)."""
    if sharded is not None:  # config.py refuses masking and privacy with row sharding
        backend = backend_for(schedule.execution.backend, model, algorithm.name).run_cohort
        aggregation = dataclasses.replace(algorithm.aggregation, coefficients=None)
        return sharded.run(backend), sharded.combine(aggregation.to(schedule.execution.device))
    processes = distributed.joined()
    run_cohort = composed(
        backend_for(schedule.execution.backend, model, algorithm.name).run_cohort,
        [
            None if processes is None else functools.partial(split_cohort, processes=processes),
            masked.on_slices(schedule.masking),  # config.py refuses privacy with masking
            None if private is None else private.wrap,
            None if host is None else host.wrap,  # config.py refuses privacy with host tables
        ],
    )
    return run_cohort, round_combine(algorithm, schedule, params, private, host)


def round_combine(
    algorithm: Algorithm,
    schedule: Schedule,
    params: Params,
    private: PrivateRounds | None,
    host: placement.HostTables | None,
) -> Callable[[Any], ServerUpdate]:
    """How the round's cohort update becomes the server's update: the private aggregation,
    the slices' aggregation when masking, or the plain one; the per-row coefficients applied
    on the host (``HostTables.receive``) when the tables stay there."""
    if private is not None:
        return private.combine
    aggregation = algorithm.aggregation
    received: Callable[[ServerUpdate], ServerUpdate] = lambda update: update  # noqa: E731
    if host is not None:
        aggregation, received = dataclasses.replace(aggregation, coefficients=None), host.receive
    aggregation = aggregation.to(schedule.execution.device)
    masking = schedule.masking
    if masking is None or masking.scheme == "none":
        return lambda update: received(aggregate(update, aggregation))

    def combine(update: MaskedCohortUpdate) -> ServerUpdate:
        weights = aggregation_weights(update, aggregation)
        return received(aggregate_slices(update, weights, params.dense, masking.aggregation))

    return combine


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
    # row-sharded tables (set by run_rounds): every process writes its shard of a checkpoint
    sharded: ShardedTables | None = None
    # wraps the in-process runtime before round 1, given (runtime, rounds, dataset, index):
    # [clock]'s virtual clock (fedsub/clock/hooks.py ``wrapper``; issue 51); None: as it is
    wrap_runtime: Callable[..., RoundRuntime] | None = None


@dataclass
class Progress:
    """What a run has done so far (saved in its checkpoints): the last finished round, its
    evaluations and its training seconds."""

    round: int = 0
    history: list[Evaluation] = dataclasses.field(default_factory=list)
    elapsed: float = 0.0


def build_server_round(
    algorithm: Algorithm,
    dataset: Population,
    index: SubmodelIndex,
    schedule: Schedule,
    params: Params,
    combine: Callable[[Any], ServerUpdate],
    control: RunControl,
    streams: DpStreams | None = None,
) -> ServerRound:
    """The server half of the run's rounds, with every stateful stage freshly initialised;
    under [dp] the cohorts and the noise keyed by ``streams`` (default: ``dp_streams``'s)."""
    variates = (
        ControlVariates(params, index, dataset.num_clients) if algorithm.control_variates else None
    )
    mechanism, ledger = None, None
    if schedule.dp is not None:
        ledger = Ledger(schedule.dp)
        streams = streams or dp_streams(schedule)
    distributed = schedule.privacy is not None and schedule.privacy.secure_aggregation
    if schedule.dp is not None and not distributed:  # the central Gaussian mechanism
        table_rows = {t: int(table.shape[0]) for t, table in params.tables.items()}
        heat = algorithm.aggregation.coefficients is not None  # FedSubAvg: private heat
        keep = schedule.privacy.keep if schedule.privacy is not None else 1.0
        counts = dataset.sample_counts()
        mechanism = DpMechanism(schedule.dp, table_rows, counts, heat, keep, streams=streams)
    rounds = ServerRound(
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
    rounds.streams = streams
    return rounds


def start_sharded(
    model: Model, algorithm: Algorithm, schedule: Schedule
) -> tuple[ShardParams, ShardedTables]:
    """``execution.table_sharding = "rows"``: this process's rows of the initial model and the
    tables' partition (fedsub/sharding). The initial model is the one-process draw, of which
    this process draws only its rows where it can (sharding/initial.py)."""
    processes = distributed.joined()
    if processes is None:
        raise ConfigError(
            "execution.table_sharding = \"rows\" spreads the tables' rows over torchrun's "
            "processes, and this run has one process: start it with torchrun "
            '--nproc-per-node P (P >= 2), or set execution.table_sharding = "none"'
        )
    setting = 'execution.table_sharding = "rows"'
    if algorithm.central or algorithm.aggregation.model_average:
        raise ConfigError(
            f"{setting} cannot run algorithm {algorithm.name!r}: it pools every sample in one "
            "client or averages models (Scheme II), rescaling every row every round"
        )
    if schedule.masking is not None and schedule.masking.scheme != "none":
        raise ConfigError(f"{setting} cannot be combined with masking (width slices)")
    private_level = schedule.privacy is not None and schedule.privacy.level != "none"
    if private_level or schedule.dp is not None:
        raise ConfigError(f"{setting} cannot be combined with privacy.level levels or [dp]")
    dtype, device = schedule.execution.dtype, schedule.execution.device
    drawn = sharded_init(
        lambda generator: model.init(generator, dtype),
        lambda: init_generator(schedule.seed),
        processes,
    )
    params = ShardParams(
        {t: v.to(device) for t, v in drawn.tables.items()},
        {n: v.to(device) for n, v in drawn.dense.items()},
        drawn.partitions,
        drawn.rank,
    )
    return params, ShardedTables.of(params, algorithm.aggregation.coefficients)


def sharded_evaluator(evaluator: Evaluator, sharded: ShardedTables) -> Evaluator:
    """``evaluator`` with each process scoring its share of the chunks, reading rows fetched
    from their owners (fedsub/sharding/evaluation.py): the metrics are one process's."""
    if evaluator.extra is not None or evaluator.l2:
        raise ConfigError(
            'execution.table_sharding = "rows" cannot evaluate gradient norms or a regularized '
            "loss: both read whole tables"
        )
    scoring = ShardedScoring(sharded, evaluator.model, eval_chunks)
    return dataclasses.replace(evaluator, outputs_of=scoring, batches={})


def resume(rounds: ServerRound, saved: checkpoint_lib.Checkpoint) -> Progress:
    """Restore every stage of ``rounds`` from ``saved``; the run goes on after its round."""
    checkpoint_lib.restore(rounds.stages(), saved, rounds.params.device)
    rounds.last_checkpoint = saved.path  # the last good checkpoint, until this run writes one
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
    sharded: ShardedTables | None = None,
) -> Path:
    """Every stage's state and the progress so far, after round ``progress.round`` (and a
    runtime's own ``records``, after the evaluations in its history); with ``sharded`` tables
    every process writes its shard into one checkpoint (``folder`` given on process 0)."""
    checkpoint = checkpoint_lib.Checkpoint(
        round=progress.round,
        stages=checkpoint_lib.capture(rounds.stages()),
        elapsed=progress.elapsed,
        history=[*(e.as_record() for e in progress.history), *(records or [])],
        run=run,
    )
    if sharded is not None:
        return checkpoint_lib.save_shard(folder, checkpoint, sharded.processes)
    assert folder is not None
    return checkpoint_lib.save(folder, checkpoint)


def evaluate(
    runtime: RoundRuntime,
    params: Params,
    progress: Progress,
    divergence_factor: float,
    on_evaluation: Callable[[Evaluation], None] | None,
    rounds: ServerRound,
) -> str | None:
    """Evaluate the model after ``progress.round`` (the runtime's metrics; none: nothing is
    recorded) and record it (with the epsilon spent so far under [dp]); why the run diverged
    (the evaluation is recorded and reported first: it shows why), or None. A runtime that
    reports no train loss (Flower's nodes without held samples) is not checked."""
    metrics = runtime.evaluate(progress.round, params)
    if metrics is None:
        return None
    if rounds.ledger is not None:
        metrics["epsilon"] = rounds.ledger.epsilon()
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
    sharded: ShardedTables | None = None,
) -> None:
    """After a round: checkpoint when due or when a stop is requested, then stop if asked
    (``Interrupted``). Nothing is saved after the last round: the run is complete.
    ``records``: the runtime's own records, saved in the checkpoint's history. With
    ``sharded`` tables every process writes (its shard) when process 0 has a folder."""
    stop = control.stop_requested()
    if progress.round >= last:
        return
    due = control.checkpoint_every and progress.round % control.checkpoint_every == 0
    writes = (due or stop) and control.checkpoints is not None
    if (due or stop) and sharded is not None:  # process 0 decides: it holds the folder
        writes = distributed.all_gather(writes, "agreeing where checkpoints go")[0]
    if writes:
        rounds.last_checkpoint = save_checkpoint(
            control.checkpoints, rounds, progress, control.run, records(), sharded
        )
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
        ledger.settings.accounting.delta,
    )
    if progress.round % every != 0:
        evaluate_now()


def round_zero(
    model: Model, algorithm: Algorithm, schedule: Schedule, start: WrittenModel | None
) -> tuple[Params, placement.HostTables | None, ShardedTables | None]:
    """Round 0's model where the run keeps it (whole on the device, its tables on the host,
    or this process's rows under row sharding), with the host tables or the tables' partition
    when so kept: the seeded draw, its values replaced by the model file ``start``'s."""
    host, sharded = None, None
    params: Params
    execution = schedule.execution
    if execution.table_sharding == "rows":
        params, sharded = start_sharded(model, algorithm, schedule)
    elif execution.table_placement == "host":  # drawn on the host, the tables never leave it
        on_host = dataclasses.replace(execution, device=placement.HOST)
        drawn = initial_params(model, dataclasses.replace(schedule, execution=on_host))
        params = placement.place(drawn, execution.device)
        host = placement.HostTables.of(algorithm, execution.device)
    else:
        params = initial_params(model, schedule)
    if start is not None:  # copied in place: each tensor stays where the run keeps it
        start.read_into(params)
    return params, host, sharded


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
    start: WrittenModel | None = None,
) -> Params:
    """Run ``schedule.rounds`` rounds of ``algorithm`` in process; evaluate at round 0, every
    ``eval_every`` rounds and at the last round. Returns the final global model.

    Round 0's model is the seeded draw, or (``start``) a model file's values (a warm start;
    checked against the model by runs/initial_model.py). With ``control.resume`` the run
    continues after the checkpoint's round and ends with the same model and evaluations as an
    uninterrupted run. Under torchrun with [dp] every process adds the same noise
    (dp/mechanism.py draws it on the host from a generator keyed by the run's secret, process
    0's, and the round, after the gather), so the processes' models stay equal."""
    control = control or RunControl()
    if algorithm.central:
        dataset, index, schedule = central_setup(dataset, schedule)
    if algorithm.whole_model:  # every client trains (and sends) every row (exact SCAFFOLD)
        index = SubmodelIndex.whole_model(dataset)
    params, host, sharded = round_zero(model, algorithm, schedule, start)
    if sharded is not None and evaluator is not None:
        evaluator = sharded_evaluator(evaluator, sharded)
    streams = dp_streams(schedule)
    private = None if sharded is not None else private_rounds(algorithm, schedule, params, streams)
    if private is not None and control.on_private_rounds is not None:
        control.on_private_rounds(private)
    stages = round_stages(model, algorithm, schedule, params, private, host, sharded)
    rounds = build_server_round(
        algorithm, dataset, index, schedule, params, stages[1], control, streams
    )
    run_cohort = stages[0]
    if host is not None:
        placement.check_row_local(algorithm, rounds.server)
    if sharded is not None:
        placement.check_row_local(
            algorithm, rounds.server, "execution.table_sharding", ("rows", "none")
        )
        rounds.agree, rounds.all_rejected = agree, all_rejected
        control = dataclasses.replace(control, sharded=sharded)
    runtime: RoundRuntime = InProcess(
        model, dataset, index, schedule, run_cohort, evaluator, host, sharded
    )
    # --- runtime hook (fedsub/clock's virtual clock, issue 51): wraps it, may adjust rounds ---
    if control.wrap_runtime is not None:
        runtime = control.wrap_runtime(runtime, rounds, dataset, index)
    # --- end of the runtime hook ---
    drive(rounds, runtime, schedule, control, on_evaluation, on_round)
    return params


@dataclass
class InProcess:
    """The in-process engine as a ``RoundRuntime`` (engine/round_runtime.py): every client is
    available, the cohort's work runs on the configured backend (``round_stages``), and the
    model is evaluated centrally by ``evaluator`` (by shares, with ``sharded`` tables)."""

    model: Model
    dataset: FederatedDataset
    index: SubmodelIndex
    schedule: Schedule
    backend: RunCohort
    evaluator: Evaluator | None = None
    host: placement.HostTables | None = None
    sharded: ShardedTables | None = None

    def available(self, round_index: int, rounds: ServerRound) -> np.ndarray | None:
        return None

    def run_cohort(self, plan: RoundPlan, params: Params) -> Any:
        if len(plan.cohort) == 0:
            return RoundFailed("an empty Poisson draw")
        job = CohortJob(
            self.model, params, self.dataset, self.index, plan.cohort, plan.round, self.schedule,
            plan.work,
        )  # fmt: skip
        return self.backend(job)  # host staging, when the tables live there, is a stage of it

    def close_round(self, round_index: int, updated: bool, diverged: str | None) -> None:
        if self.sharded is not None:
            self.sharded.log_traffic(round_index)

    def evaluate(self, round_index: int, params: Params) -> dict[str, float] | None:
        if self.evaluator is None:
            return None
        return self.evaluator.evaluate(params if self.host is None else params.to(placement.HOST))

    def history(self) -> list[dict]:
        return []

    def restore_history(self, history: list[dict]) -> None:
        return None


def run_round(rounds: ServerRound, runtime: RoundRuntime, round_index: int) -> None:
    """Round ``round_index``: who takes part, their work, and the checked server step. A round
    whose work did not come back (``RoundFailed``) leaves the model unchanged, except under
    [dp], whose noise is added all the same (an unchanged model would tell)."""
    params = rounds.params
    with timed("cohort"):
        plan = rounds.begin(round_index, runtime.available(round_index, rounds))
    update = runtime.run_cohort(plan, params)
    updated = False
    try:
        if not isinstance(update, RoundFailed):
            updated = rounds.finish(plan, update)
        elif rounds.dp is not None:
            updated = rounds.finish(plan, empty_update(params))
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
    last, checkpointed and stopped as ``control`` says, stopped before a round [dp]'s budget
    could not pay for."""
    if control.resume is None:
        progress = Progress()
    else:
        progress = resume(rounds, control.resume)
        runtime.restore_history(control.resume.history)

    def evaluate_and_check() -> None:
        with timed("evaluation"):
            reason = evaluate(
                runtime, rounds.params, progress, control.divergence_factor, on_evaluation, rounds
            )
        if reason is not None:
            raise Diverged(rounds.algorithm.name, progress.round, reason, rounds.last_checkpoint)

    if control.resume is None:
        evaluate_and_check()
    for r in range(progress.round + 1, schedule.rounds + 1):
        if rounds.ledger is not None and rounds.ledger.would_exceed():
            stop_for_budget(rounds.ledger, r, progress, evaluate_and_check, schedule.eval_every)
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
                keep_safe(
                    rounds, progress, control, schedule.rounds, runtime.history, control.sharded
                )
    return progress


def deterministic(run: Callable[P, Params]) -> Callable[P, Params]:
    """``run`` under ``torch.use_deterministic_algorithms`` when the ``schedule`` it is given
    says ``deterministic`` (execution.deterministic; fedsub/numerics/segment_sum.py), and
    always with TensorFloat-32 off (numerics/float32.py)."""
    signature = inspect.signature(run)

    @functools.wraps(run)
    def under_schedule(*args: P.args, **kwargs: P.kwargs) -> Params:
        schedule = signature.bind(*args, **kwargs).arguments["schedule"]
        with segment_sum.deterministic_run(schedule.execution.deterministic), ieee_float32():
            return run(*args, **kwargs)

    return under_schedule


train = deterministic(run_rounds)
"""``run_rounds`` (same arguments), deterministic when its schedule says so."""
