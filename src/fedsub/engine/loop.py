"""The round loop: sample a cohort, run client work on submodels, aggregate, apply, evaluate.

Everything that differs between algorithms comes from the ``Algorithm`` (fedsub.algorithms):
the scheme's sampler and weighting, the local rule, control variates, the server optimizer.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedsub.algorithms.aggregation import aggregate
from fedsub.algorithms.registry import Algorithm
from fedsub.algorithms.scaffold import ControlVariates
from fedsub.data.federated import FederatedDataset
from fedsub.engine import batched, seeding, sequential
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.local_rule import CohortWork, LocalRule
from fedsub.engine.sampling import sample_cohort
from fedsub.engine.schedule import Schedule, lr_at
from fedsub.models.base import Model
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params

BACKENDS = {"batched": batched.run_cohort, "sequential": sequential.run_cohort}


@dataclass(frozen=True)
class Evaluation:
    round: int
    metrics: dict[str, float]
    elapsed_train_seconds: float

    def as_json(self) -> dict:
        return {"round": self.round, **self.metrics, "elapsed": self.elapsed_train_seconds}


def initial_params(model: Model, schedule: Schedule) -> Params:
    generator = torch.Generator().manual_seed(
        int(seeding.rng(schedule.seed, seeding.INIT).integers(2**62))
    )
    return model.init(generator, schedule.dtype)


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


def train(
    model: Model,
    algorithm: Algorithm,
    dataset: FederatedDataset,
    index: SubmodelIndex,
    schedule: Schedule,
    evaluator: Evaluator | None = None,
    on_evaluation: Callable[[Evaluation], None] | None = None,
    on_round: Callable[[int], None] | None = None,
) -> Params:
    """Run ``schedule.rounds`` rounds of ``algorithm``; evaluate at round 0, every
    ``eval_every`` rounds and at the last round. Returns the final global model."""
    if algorithm.central:
        dataset, index, schedule = central_setup(dataset, schedule)
    params = initial_params(model, schedule)
    server = algorithm.make_server(params)
    variates = (
        ControlVariates(params, index, dataset.num_clients) if algorithm.control_variates else None
    )
    run_cohort = BACKENDS[schedule.backend]
    counts = dataset.sample_counts()
    base_lr = algorithm.lr if algorithm.lr is not None else schedule.lr
    elapsed = 0.0

    def evaluate(round_index: int) -> None:
        if evaluator is not None and on_evaluation is not None:
            on_evaluation(Evaluation(round_index, evaluator.evaluate(params), elapsed))

    evaluate(0)
    for r in range(1, schedule.rounds + 1):
        started = time.perf_counter()
        cohort = sample_cohort(
            algorithm.scheme.sampling, schedule.seed, r, counts, schedule.clients_per_round
        )
        lr_scale = np.ones(len(cohort))
        if algorithm.scheme.scale_lr_by_pn:
            lr_scale = counts[cohort.clients] / counts.sum() * dataset.num_clients
        work = CohortWork(
            LocalRule(
                lr_at(base_lr, schedule, r), algorithm.mu, schedule.weight_decay, schedule.clip_norm
            ),
            lr_scale,
            None if variates is None else variates.corrections(cohort),
        )
        update = run_cohort(model, params, dataset, index, cohort, r, schedule, work)
        server_update = aggregate(update, algorithm.aggregation)
        if not server_update.is_finite():
            raise FloatingPointError(
                f"{algorithm.name}: round {r}'s aggregate is not finite (NaN or Inf); "
                "try a smaller learning rate"
            )
        server.apply(params, server_update)
        if variates is not None:
            variates.update(update, work, schedule.local_steps)
        elapsed += time.perf_counter() - started
        if r % schedule.eval_every == 0 or r == schedule.rounds:
            evaluate(r)
        if on_round is not None:
            on_round(r)
    return params
