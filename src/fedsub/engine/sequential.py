"""The sequential backend: clients one after another, each on its own pulled submodel.

The plainest correct implementation of a round's client work; the batched backend is tested
against it.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsub.data.federated import FederatedDataset
from fedsub.engine.local_sgd import local_sgd
from fedsub.engine.schedule import Schedule
from fedsub.engine.shuffle import cohort_schedules
from fedsub.models.base import Model
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import ClientUpdate, CohortUpdate, pull, push


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
    order = cohort_schedules(
        schedule.seed,
        round_index,
        np.array([client]),
        np.array([len(samples)]),
        schedule.local_steps,
        schedule.batch_size,
    )[0]
    trained = local_sgd(model, pulled.clone(), samples, order, schedule.lr)
    return push(client, float(len(samples)), rows, pulled, trained)


def run_cohort(
    model: Model,
    global_params: Params,
    dataset: FederatedDataset,
    index: SubmodelIndex,
    cohort: np.ndarray,
    round_index: int,
    schedule: Schedule,
) -> CohortUpdate:
    return CohortUpdate.from_clients(
        [
            client_round(model, global_params, dataset, index, int(k), round_index, schedule)
            for k in cohort
        ]
    )
