"""The round loop: sample a cohort, run client work on submodels, aggregate, apply, evaluate."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedsub.algorithms.aggregation import aggregate
from fedsub.algorithms.registry import Algorithm
from fedsub.data.federated import FederatedDataset
from fedsub.engine import seeding
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.local_sgd import batch_schedule, local_sgd
from fedsub.engine.sampling import uniform_cohort
from fedsub.models.base import Model
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import ClientUpdate, pull, push

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class Schedule:
    """The training schedule shared by every algorithm of a comparison."""

    rounds: int
    clients_per_round: int
    local_steps: int
    batch_size: int
    lr: float
    seed: int
    dtype: torch.dtype = torch.float32
    eval_every: int = 1


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


def client_round(
    model: Model,
    global_params: Params,
    dataset: FederatedDataset,
    index: SubmodelIndex,
    client: int,
    round_index: int,
    schedule: Schedule,
) -> ClientUpdate:
    """One client's work in one round: pull S(k), local SGD, push the row deltas."""
    rows = {t: torch.from_numpy(index.client_rows(t, client)) for t in dataset.table_rows}
    pulled = pull(global_params, rows)
    samples = index.client_samples(dataset, client)
    order = batch_schedule(
        len(samples),
        schedule.local_steps,
        schedule.batch_size,
        seeding.rng(schedule.seed, seeding.CLIENT, round_index, client),
    )
    trained = local_sgd(model, pulled.clone(), samples, order, schedule.lr)
    return push(client, float(len(samples)), rows, pulled, trained)


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
    elapsed = 0.0

    def evaluate(round_index: int) -> None:
        if evaluator is not None and on_evaluation is not None:
            on_evaluation(Evaluation(round_index, evaluator.evaluate(params), elapsed))

    evaluate(0)
    for r in range(1, schedule.rounds + 1):
        started = time.perf_counter()
        cohort = uniform_cohort(schedule.seed, r, dataset.num_clients, schedule.clients_per_round)
        updates = [client_round(model, params, dataset, index, int(k), r, schedule) for k in cohort]
        algorithm.server.apply(params, aggregate(updates, algorithm.aggregation))
        elapsed += time.perf_counter() - started
        if r % schedule.eval_every == 0 or r == schedule.rounds:
            evaluate(r)
        if on_round is not None:
            on_round(r)
    return params
