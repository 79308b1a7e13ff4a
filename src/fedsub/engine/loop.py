"""The round loop: sample a cohort, run client work on submodels, aggregate, apply, evaluate."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedsub.algorithms.aggregation import aggregate
from fedsub.algorithms.registry import Algorithm
from fedsub.data.federated import FederatedDataset
from fedsub.engine import batched, seeding, sequential
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.sampling import uniform_cohort
from fedsub.engine.schedule import Schedule
from fedsub.models.base import Model
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params


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


BACKENDS = {"batched": batched.run_cohort, "sequential": sequential.run_cohort}


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
    params = initial_params(model, schedule)
    run_cohort = BACKENDS[schedule.backend]
    elapsed = 0.0

    def evaluate(round_index: int) -> None:
        if evaluator is not None and on_evaluation is not None:
            on_evaluation(Evaluation(round_index, evaluator.evaluate(params), elapsed))

    evaluate(0)
    for r in range(1, schedule.rounds + 1):
        started = time.perf_counter()
        cohort = uniform_cohort(schedule.seed, r, dataset.num_clients, schedule.clients_per_round)
        updates = run_cohort(model, params, dataset, index, cohort, r, schedule)
        algorithm.server.apply(params, aggregate(updates, algorithm.aggregation))
        elapsed += time.perf_counter() - started
        if r % schedule.eval_every == 0 or r == schedule.rounds:
            evaluate(r)
        if on_round is not None:
            on_round(r)
    return params
