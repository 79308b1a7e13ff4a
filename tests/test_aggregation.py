"""The row-sparse aggregator against a dense per-client reference computation."""

import numpy as np
import pytest
import torch

from fedsub.algorithms.aggregation import Aggregation, aggregate
from fedsub.submodel.transfer import ClientUpdate, CohortUpdate


def random_updates(rows: int, dim: int, k: int, seed: int) -> list[ClientUpdate]:
    rng = np.random.default_rng(seed)
    updates = []
    for client in range(k):
        touched = np.sort(rng.choice(rows, size=rng.integers(1, rows), replace=False))
        updates.append(
            ClientUpdate(
                client=client,
                weight=float(rng.integers(1, 50)),
                rows={"t": torch.from_numpy(touched)},
                table_deltas={"t": torch.from_numpy(rng.normal(size=(len(touched), dim)))},
                dense_deltas={"b": torch.from_numpy(rng.normal(size=3))},
            )
        )
    return updates


def dense_reference(updates, rows, dim, weighting, coef=None):
    total = sum(u.weight for u in updates)
    table = np.zeros((rows, dim))
    bias = np.zeros(3)
    for u in updates:
        a = u.weight / total if weighting == "samples" else 1 / len(updates)
        full = np.zeros((rows, dim))
        full[u.rows["t"].numpy()] = u.table_deltas["t"].numpy()
        table += a * full
        bias += a * u.dense_deltas["b"].numpy()
    if coef is not None:
        table *= coef[:, None]
    return table, bias


def test_sparse_aggregate_equals_dense_reference():
    rows, dim = 40, 3
    updates = random_updates(rows, dim, k=6, seed=0)
    coef = np.random.default_rng(1).uniform(1, 10, size=rows)
    for weighting in ("samples", "uniform"):
        for c in (None, coef):
            agg = aggregate(
                CohortUpdate.from_clients(updates),
                Aggregation(weighting, None if c is None else {"t": torch.from_numpy(c)}),
            )
            table, bias = dense_reference(updates, rows, dim, weighting, c)
            got = np.zeros((rows, dim))
            got[agg.tables["t"].rows.numpy()] = agg.tables["t"].values.numpy()
            np.testing.assert_allclose(got, table, rtol=0, atol=1e-12)
            np.testing.assert_allclose(agg.dense["b"].numpy(), bias, rtol=0, atol=1e-12)
            touched = np.unique(np.concatenate([u.rows["t"].numpy() for u in updates]))
            np.testing.assert_array_equal(agg.tables["t"].rows.numpy(), touched)


def test_row_union_equals_numpy_unique_across_calls():
    """One RowUnion reused for inputs of growing and shrinking ranges, repeats and empties."""
    from fedsub.algorithms.aggregation import RowUnion

    union = RowUnion()
    rng = np.random.default_rng(5)
    for high in (10, 1_000, 3, 50_000, 7, 1):
        for size in (0, 1, 40, 3_000):
            rows = rng.integers(0, high, size=size)
            distinct, inverse = union(torch.from_numpy(rows))
            expected, expected_inverse = np.unique(rows, return_inverse=True)
            assert np.array_equal(distinct.numpy(), expected)
            assert np.array_equal(inverse.numpy(), expected_inverse)


@pytest.mark.parametrize("name", ["samples", "uniform", "scheme2", "original"])
def test_each_weightings_declared_properties_are_what_it_computes(name):
    """``sums_to_one`` (masking and secure sums read it) is whether the weights it computes add
    up to 1, and ``reads_totals`` whether they change with the population's totals (W, N);
    a weighting that reads them is refused by ``client_weights``, which has none."""
    from types import SimpleNamespace

    from fedsub.algorithms.aggregation import client_weights
    from fedsub.algorithms.weighting import WEIGHTINGS

    piece = WEIGHTINGS[name]
    cohort = SimpleNamespace(
        weights=torch.tensor([3.0, 5.0, 2.0], dtype=torch.float64),
        multiplicity=torch.tensor([1, 2, 1]),
    )
    small = piece.weights(cohort, Aggregation(name, population_weight=40.0, num_clients=10))
    large = piece.weights(cohort, Aggregation(name, population_weight=90.0, num_clients=30))
    assert piece.sums_to_one == bool(
        torch.isclose(small.sum(), torch.tensor(1.0, dtype=small.dtype))
    )
    assert piece.reads_totals == (not torch.equal(small, large))
    if piece.reads_totals:
        with pytest.raises(ValueError, match="needs the population"):
            client_weights(cohort, name)
    else:
        assert torch.equal(client_weights(cohort, name), small)
