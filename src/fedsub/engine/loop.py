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

import numpy as np
import torch

from fedsub import seeding
from fedsub.algorithms.aggregation import ServerUpdate, aggregate, aggregation_weights
from fedsub.algorithms.registry import Algorithm
from fedsub.algorithms.scaffold import ControlVariates
from fedsub.data.federated import FederatedDataset
from fedsub.engine import batched, masked, sequential
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.divergence import divergence_reason
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.guards import Rejection
from fedsub.engine.schedule import Schedule
from fedsub.engine.server_round import Diverged, ServerRound
from fedsub.json_values import metrics_from_json, nulled
from fedsub.masking.aggregate import MaskedCohortUpdate, aggregate_slices
from fedsub.models.base import Model, is_batchable
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params

BACKENDS = {"batched": batched.run_cohort, "sequential": sequential.run_cohort}
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


def round_stages(
    model: Model, algorithm: Algorithm, schedule: Schedule, params: Params
) -> tuple[Callable, Callable]:
    """The round's client work (the configured backend, on width slices when masking) and how
    its updates become the server's update."""
    backend = schedule.backend
    if backend == "batched" and not is_batchable(model):
        LOG.warning(
            "%s: model %s cannot be batched; running the sequential backend",
            algorithm.name,
            type(model).__name__,
        )
        backend = "sequential"
    run_cohort = BACKENDS[backend]
    masking = schedule.masking
    aggregation = algorithm.aggregation.to(schedule.device)
    if masking is None or masking.scheme == "none":
        return run_cohort, lambda update: aggregate(update, aggregation)

    def combine(update: MaskedCohortUpdate) -> ServerUpdate:
        weights = aggregation_weights(update, aggregation)  # type: ignore[arg-type]
        return aggregate_slices(update, weights, params.dense, masking.average_over)

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
    """Run ``schedule.rounds`` rounds of ``algorithm``; evaluate at round 0, every
    ``eval_every`` rounds and at the last round. Returns the final global model.

    With ``control.resume`` the run continues after the checkpoint's round and ends with the
    same model and evaluations as an uninterrupted run."""
    control = control or RunControl()
    if algorithm.central:
        dataset, index, schedule = central_setup(dataset, schedule)
    params = initial_params(model, schedule)
    server = algorithm.make_server(params)
    variates = (
        ControlVariates(params, index, dataset.num_clients) if algorithm.control_variates else None
    )
    history: list[Evaluation] = []
    elapsed, first_round, resumed_from = 0.0, 1, None
    if control.resume is not None:
        saved = control.resume
        for name, value in Params.from_state_dict(saved.model).state_dict().items():
            params.state_dict()[name].copy_(value)
        server.load_state_tensors({n: v.to(schedule.device) for n, v in saved.server.items()})
        if variates is not None:
            variates.load_state_tensors(
                {n: v.to(schedule.device) for n, v in saved.variates.items()}
            )
        history = [Evaluation.from_record(e) for e in saved.history]
        elapsed, first_round, resumed_from = saved.elapsed, saved.round + 1, saved.path

    def save(round_index: int) -> Path | None:
        if control.checkpoints is None:
            return None
        return checkpoint_lib.save(
            control.checkpoints,
            checkpoint_lib.Checkpoint(
                round=round_index,
                model=params.state_dict(),
                server=server.state_tensors(),
                variates={} if variates is None else variates.state_tensors(),
                elapsed=elapsed,
                history=[e.as_record() for e in history],
                run=control.run,
            ),
        )

    def evaluate(round_index: int) -> None:
        if evaluator is None:
            return
        evaluation = Evaluation(round_index, evaluator.evaluate(params), elapsed)
        initial = history[0].metrics["train_loss"] if history else None
        reason = divergence_reason(
            evaluation.metrics["train_loss"], initial, control.divergence_factor
        )
        history.append(evaluation)
        if on_evaluation is not None:
            on_evaluation(evaluation)  # the diverged evaluation is logged too: it shows why
        if reason is not None:
            raise Diverged(algorithm.name, round_index, reason, rounds.last_checkpoint)

    run_cohort, combine = round_stages(model, algorithm, schedule, params)
    counts = dataset.sample_counts()
    rounds = ServerRound(
        algorithm,
        schedule,
        counts,
        params,
        server,
        combine,
        variates,
        control.max_update_norm,
        control.on_reject,
        resumed_from,  # the last good checkpoint, until this run writes one
    )
    if control.resume is None:
        evaluate(0)
    for r in range(first_round, schedule.rounds + 1):
        started = time.perf_counter()
        plan = rounds.begin(r)
        update = run_cohort(model, params, dataset, index, plan.cohort, r, schedule, plan.work)
        rounds.finish(plan, update)
        elapsed += time.perf_counter() - started
        if r % schedule.eval_every == 0 or r == schedule.rounds:
            evaluate(r)
        if on_round is not None:
            on_round(r)
        stop = control.stop_requested()
        due = control.checkpoint_every and r % control.checkpoint_every == 0
        if (due or stop) and r < schedule.rounds:
            rounds.last_checkpoint = save(r)
        if stop and r < schedule.rounds:
            raise Interrupted(r, rounds.last_checkpoint)
    return params
