"""FedSubAvg's defining properties, checked through the real engine.

- Seed 001, Example 1, in closed form.
- Equation (3): FedSubAvg's expected row update is the mean update of the clients involving it.
- With every row touched by every client, FedSubAvg is FedAvg.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsub.algorithms.aggregation import aggregate
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.algorithms.sampling import uniform_cohort
from fedsub.client.work import CohortWork, round_chain
from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.engine.sequential import client_round
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.transfer import CohortUpdate

from .conftest import SquaredDistance, make_dataset


def example1_dataset(n: int) -> FederatedDataset:
    """Client 0 involves w1 (row 0) and w2 (row 1); clients 1..N-1 only w2; all xi = 0."""
    clients = [[[0, 1]]] + [[[1]] for _ in range(n - 1)]
    parts = [SampleSet({"w": Ragged.from_lists(c)}, np.zeros(1, np.float32)) for c in clients]
    return FederatedDataset.from_clients("example-1", {"w": 2}, parts, parts[0])


@pytest.mark.parametrize("n,lr,rounds", [(10, 0.1, 25), (50, 0.5, 30)])
def test_example1_closed_form(n, lr, rounds):
    ds = example1_dataset(n)
    index = SubmodelIndex.build(ds)
    model = SquaredDistance(rows=2, w0=1.0)
    schedule = Schedule(
        rounds,
        n,
        local=LocalWork(1, 1, ClientStep(lr=lr)),
        seed=0,
        execution=Execution(dtype=torch.float64),
    )
    context = AlgorithmContext(ds, index, "clients")
    fedavg = train(model, build_algorithm("fedavg", context), ds, index, schedule)
    fedsub = train(model, build_algorithm("fedsubavg", context), ds, index, schedule)
    w1_fedavg, w2_fedavg = fedavg.tables["w"][:, 0].tolist()
    w1_fedsub, w2_fedsub = fedsub.tables["w"][:, 0].tolist()
    assert w1_fedavg == pytest.approx((1 - 2 * lr / n) ** rounds, abs=1e-6)
    assert w2_fedavg == pytest.approx((1 - 2 * lr) ** rounds, abs=1e-6)
    assert w1_fedsub == pytest.approx((1 - 2 * lr) ** rounds, abs=1e-6)
    assert w2_fedsub == pytest.approx((1 - 2 * lr) ** rounds, abs=1e-6)
    assert abs(w1_fedavg) > 10 * abs(w1_fedsub)  # the defect FedSubAvg removes


def test_equation3_expected_update_is_mean_over_involved_clients(small_synthetic):
    """Monte Carlo over sampled cohorts at a fixed global model, heat = "clients"."""
    ds = small_synthetic
    index = SubmodelIndex.build(ds)
    model = SparseLogisticRegression(dict(ds.table_rows))
    schedule = Schedule(
        1,
        10,
        local=LocalWork(3, 4, ClientStep(lr=0.5)),
        seed=0,
        execution=Execution(dtype=torch.float64),
    )
    params = model.init(torch.Generator().manual_seed(0), torch.float64)
    plain_sgd = CohortWork(round_chain(()), np.full(1, 0.5))
    ((table, rows),) = ds.table_rows.items()
    updates = [
        client_round(model, params, ds, index, k, 1, schedule, plain_sgd)
        for k in range(ds.num_clients)
    ]

    # the target of equation (3): per row, the average delta of the clients that involve it
    total = np.zeros(rows)
    involved = np.zeros(rows)
    for u in updates:
        total[u.rows[table].numpy()] += u.table_deltas[table][:, 0].numpy()
        involved[u.rows[table].numpy()] += 1
    touched = involved > 0
    expected = total[touched] / involved[touched]

    fedsubavg = build_algorithm("fedsubavg", AlgorithmContext(ds, index, "clients"))
    fedavg = build_algorithm("fedavg", AlgorithmContext(ds, index, "clients"))
    draws = 4000
    sums = {"fedsubavg": np.zeros(rows), "fedavg": np.zeros(rows)}
    squares = np.zeros(rows)
    for r in range(draws):
        cohort = uniform_cohort(seed=7, round_index=r, num_clients=ds.num_clients, k=10)
        picked = [updates[k] for k in cohort]
        for name, algorithm in (("fedsubavg", fedsubavg), ("fedavg", fedavg)):
            agg = aggregate(CohortUpdate.from_clients(picked), algorithm.aggregation)
            agg = agg.tables[table]
            step = np.zeros(rows)
            step[agg.rows.numpy()] = agg.values[:, 0].numpy()
            sums[name] += step
            if name == "fedsubavg":
                squares += step**2
    mean = sums["fedsubavg"][touched] / draws
    std_error = np.sqrt(np.maximum(squares[touched] / draws - mean**2, 0) / draws)
    assert np.all(np.abs(mean - expected) <= 5 * std_error + 1e-12)
    # FedAvg, by contrast, shrinks cold rows' expected update towards zero
    cold = (involved[touched] == 1) & (np.abs(expected) > 1e-3)
    assert cold.sum() >= 5
    fedavg_mean = sums["fedavg"][touched][cold] / draws
    assert np.all(np.abs(fedavg_mean) < 0.5 * np.abs(expected[cold]))


def test_fedsubavg_equals_fedavg_when_every_client_touches_every_row():
    rng = np.random.default_rng(0)
    rows = 6
    clients = []
    for _ in range(12):
        samples = [
            rng.choice(rows, size=3, replace=False).tolist() for _ in range(int(rng.integers(2, 9)))
        ]
        samples.append(list(range(rows)))  # every client involves every row
        clients.append(samples)
    ds = make_dataset(clients, rows)
    index = SubmodelIndex.build(ds)
    model = SparseLogisticRegression(dict(ds.table_rows))
    schedule = Schedule(
        6,
        5,
        local=LocalWork(4, 3, ClientStep(lr=0.2)),
        seed=1,
        execution=Execution(dtype=torch.float64),
    )
    context = AlgorithmContext(ds, index, "samples")
    fedsub = train(model, build_algorithm("fedsubavg", context), ds, index, schedule)
    fedavg = train(model, build_algorithm("fedavg", context), ds, index, schedule)
    torch.testing.assert_close(fedsub.tables["t"], fedavg.tables["t"], rtol=0, atol=1e-12)
    torch.testing.assert_close(fedsub.dense["bias"], fedavg.dense["bias"], rtol=0, atol=1e-12)
    assert fedavg.tables["t"].abs().min() > 0  # every row did move
