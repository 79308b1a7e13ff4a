"""The baselines' defining properties, through the real engine."""

import numpy as np
import pytest
import torch

from fedsub.algorithms.aggregation import aggregate
from fedsub.algorithms.registry import AlgorithmContext, FedProxOptions, build_algorithm
from fedsub.algorithms.sampling import sample_cohort
from fedsub.client.work import CohortWork, round_chain
from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import central_setup, train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.engine.sequential import client_round
from fedsub.engine.shuffle import cohort_schedules
from fedsub.models.base import Batch, forward
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.transfer import CohortUpdate

from .conftest import SquaredDistance


def test_fedprox_with_mu_zero_is_fedavg(small_synthetic):
    ds = small_synthetic
    index = SubmodelIndex.build(ds)
    model = SparseLogisticRegression(dict(ds.table_rows))
    context = AlgorithmContext(ds, index, "samples", 8)
    schedule = Schedule(
        5, 8, LocalWork(4, 3, ClientStep(0.3)), seed=1, execution=Execution(dtype=torch.float64)
    )
    fedavg = train(model, build_algorithm("fedavg", context), ds, index, schedule)
    prox0 = train(
        model, build_algorithm("fedprox", context, FedProxOptions(mu=0.0)), ds, index, schedule
    )
    prox1 = train(
        model, build_algorithm("fedprox", context, FedProxOptions(mu=1.0)), ds, index, schedule
    )
    for name, value in fedavg.state_dict().items():
        assert torch.equal(prox0.state_dict()[name], value)
    assert not torch.equal(prox1.tables["features"], fedavg.tables["features"])


def heterogeneous_quadratic(n: int = 6):
    """Client i: one sample whose id (w) repeats a_i times with target b_i, so its loss is
    a_i (w - b_i)^2; the optimum of the mean is sum a_i b_i / sum a_i."""
    curvature = np.array([1, 4, 1, 2, 6, 1][:n])
    targets = np.array([3.0, -1.0, 2.0, 0.5, -2.0, 4.0][:n])
    parts = [
        SampleSet({"w": Ragged.from_lists([[0] * int(a)])}, np.array([b], dtype=np.float32))
        for a, b in zip(curvature, targets, strict=True)
    ]
    dataset = FederatedDataset.from_clients("quadratic", {"w": 1}, parts, parts[0])
    return dataset, float((curvature * targets).sum() / curvature.sum())


def run_quadratic(name: str, rounds: int, lr: float, lr_schedule: str = "constant") -> float:
    dataset, _ = heterogeneous_quadratic()
    index = SubmodelIndex.build(dataset)
    model = SquaredDistance(rows=1, w0=0.0)
    schedule = Schedule(
        rounds,
        dataset.num_clients,
        local=LocalWork(5, 1, ClientStep(lr=lr, lr_schedule=lr_schedule)),
        seed=0,
        execution=Execution(dtype=torch.float64),
    )
    context = AlgorithmContext(dataset, index, "samples", dataset.num_clients)
    params = train(model, build_algorithm(name, context), dataset, index, schedule)
    return float(params.tables["w"][0, 0])


def test_scaffold_reaches_the_optimum_where_fedavg_with_constant_lr_does_not():
    _, optimum = heterogeneous_quadratic()
    fedavg = run_quadratic("fedavg", rounds=300, lr=0.05)
    scaffold = run_quadratic("scaffold", rounds=300, lr=0.05)
    assert abs(scaffold - optimum) < 1e-6
    assert abs(fedavg - optimum) > 0.05  # FedAvg's client drift: a biased fixed point


def test_li_theorem4_constant_lr_stalls_decaying_lr_approaches_optimum():
    _, optimum = heterogeneous_quadratic()
    constant_long = run_quadratic("fedavg", rounds=600, lr=0.05)
    constant_short = run_quadratic("fedavg", rounds=300, lr=0.05)
    decaying = run_quadratic("fedavg", rounds=600, lr=0.05, lr_schedule="inverse-round")
    away = abs(constant_long - optimum)
    assert away > 0.05
    assert abs(constant_long - constant_short) < 1e-9  # converged: the gap is the limit
    assert abs(decaying - optimum) < away / 5


def fixed_round_updates(ds, index, model):
    params = model.init(torch.Generator().manual_seed(0), torch.float64)
    schedule = Schedule(
        1,
        1,
        local=LocalWork(3, 4, ClientStep(lr=0.5)),
        seed=0,
        execution=Execution(dtype=torch.float64),
    )
    work = CohortWork(round_chain(()), np.full(1, 0.5))
    return [
        client_round(model, params, ds, index, k, 1, schedule, work) for k in range(ds.num_clients)
    ]


@pytest.mark.parametrize(
    "scheme,unbiased", [("scheme1", True), ("scheme2", True), ("original", False)]
)
def test_li_schemes_unbiased_or_not(small_synthetic, scheme, unbiased):
    ds = small_synthetic
    index = SubmodelIndex.build(ds)
    model = SparseLogisticRegression(dict(ds.table_rows))
    updates = fixed_round_updates(ds, index, model)
    ((table, rows),) = ds.table_rows.items()
    counts = ds.sample_counts()
    p = counts / counts.sum()
    target = np.zeros(rows)
    for u, pk in zip(updates, p, strict=True):
        target[u.rows[table].numpy()] += pk * u.table_deltas[table][:, 0].numpy()

    algorithm = build_algorithm(f"fedavg@{scheme}", AlgorithmContext(ds, index, "samples", 10))
    draws, k = 3000, 10
    total, squares = np.zeros(rows), np.zeros(rows)
    for r in range(draws):
        cohort = sample_cohort(algorithm.scheme.sampling, 5, r + 1, counts, k)
        picked = CohortUpdate.from_clients(
            [updates[c] for c in cohort.clients], torch.from_numpy(cohort.multiplicity)
        )
        agg = aggregate(picked, algorithm.aggregation).tables[table]
        step = np.zeros(rows)
        step[agg.rows.numpy()] = agg.values[:, 0].numpy()
        total += step
        squares += step**2
    mean = total / draws
    std_error = np.sqrt(np.maximum(squares / draws - mean**2, 0) / draws)
    within = np.abs(mean - target) <= 5 * std_error + 1e-12
    if unbiased:
        assert within.all()
    else:
        # the original scheme shrinks the expected update by K / N
        moved = np.abs(target) > 1e-3
        np.testing.assert_allclose(
            mean[moved],
            target[moved] * k / ds.num_clients,
            rtol=0,
            atol=float(5 * std_error[moved].max() + 1e-12),
        )
        assert not within[moved].all()


def test_central_sgd_takes_batches_of_k_times_b_from_the_pooled_data(small_synthetic):
    ds = small_synthetic
    index = SubmodelIndex.build(ds)
    k, b, steps, lr = 6, 4, 3, 0.2
    schedule = Schedule(
        1, k, LocalWork(steps, b, ClientStep(lr)), seed=3, execution=Execution(dtype=torch.float64)
    )
    pooled, _, central_schedule = central_setup(ds, schedule)
    assert pooled.num_clients == 1 and len(pooled.train) == len(ds.train)
    assert central_schedule.batch_size == k * b and central_schedule.clients_per_round == 1

    model = SparseLogisticRegression(dict(ds.table_rows))
    context = AlgorithmContext(ds, index, "samples", k)
    trained = train(model, build_algorithm("central-sgd", context), ds, index, schedule)

    reference = model.init(torch.Generator().manual_seed(0), torch.float64)
    reference = type(reference)(
        {t: torch.zeros_like(v) for t, v in reference.tables.items()},
        {n: torch.zeros_like(v) for n, v in reference.dense.items()},
    )
    tensors = [t.requires_grad_(True) for t in reference.tensors()]
    optimizer = torch.optim.SGD(tensors, lr=lr)
    order = cohort_schedules(3, 1, torch.tensor([0]), torch.tensor([len(ds.train)]), steps, k * b)[
        0
    ].numpy()
    for batch_indices in order:
        assert len(set(batch_indices.tolist())) == k * b
        batch = Batch.from_samples(ds.train.take(batch_indices), torch.float64)
        optimizer.zero_grad()
        model.loss(forward(model, reference, batch), batch.labels).backward()
        optimizer.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained.state_dict()[name], value.detach(), rtol=0, atol=1e-12)


def test_gradient_norms_match_the_closed_form_logistic_gradient(small_synthetic):
    """grad of the mean BCE over all samples: X^T (sigmoid(Xw + b) - y) / n, by hand."""
    from fedsub.algorithms.registry import heat_coefficients
    from fedsub.engine.diagnostics import gradient_norms

    ds = small_synthetic
    index = SubmodelIndex.build(ds)
    model = SparseLogisticRegression(dict(ds.table_rows))
    params = model.init(torch.Generator().manual_seed(0), torch.float64)
    rng = np.random.default_rng(0)
    params.tables["features"][:, 0] = torch.from_numpy(rng.normal(size=ds.table_rows["features"]))
    params.dense["bias"][0] = 0.3
    coefficients = heat_coefficients(AlgorithmContext(ds, index, "clients"))

    got = gradient_norms(model, params, ds.train, coefficients)

    ids, offsets = ds.train.ids["features"].values, ds.train.ids["features"].offsets
    w = params.tables["features"][:, 0].numpy()
    logits = np.add.reduceat(w[ids], offsets[:-1]) + 0.3
    residual = 1 / (1 + np.exp(-logits)) - ds.train.labels
    n = len(residual)
    grad_w = np.bincount(ids, weights=np.repeat(residual, np.diff(offsets)), minlength=len(w)) / n
    grad_b = residual.sum() / n
    coef = coefficients["features"].numpy()
    assert got["grad_norm_sq"] == pytest.approx((grad_w**2).sum() + grad_b**2, rel=1e-9)
    assert got["precond_grad_norm_sq"] == pytest.approx(
        (coef * grad_w**2).sum() + grad_b**2, rel=1e-9
    )
