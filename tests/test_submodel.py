"""Index sets, heat counts and pull/push against direct per-client computations."""

import numpy as np
import torch

from fedsub.submodel import heat as heat_lib
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import pull, push, scatter_add_rows


def test_index_sets_and_local_ids_match_a_per_client_loop(small_synthetic):
    ds = small_synthetic
    index = SubmodelIndex.build(ds)
    for k in range(ds.num_clients):
        client = ds.client(k)
        for table in ds.table_rows:
            expected_rows = np.unique(client.ids[table].values)
            rows = index.client_rows(table, k)
            np.testing.assert_array_equal(rows, expected_rows)
            local = index.client_samples(ds, k).ids[table]
            np.testing.assert_array_equal(rows[local.values], client.ids[table].values)


def test_heat_matches_counting_clients_and_samples(small_synthetic):
    ds = small_synthetic
    index = SubmodelIndex.build(ds)
    ((table, rows),) = ds.table_rows.items()
    counts = ds.sample_counts()
    n_m = np.zeros(rows)
    w_m = np.zeros(rows)
    for k in range(ds.num_clients):
        touched = set(ds.client(k).ids[table].values.tolist())
        for m in touched:
            n_m[m] += 1
            w_m[m] += counts[k]
    np.testing.assert_array_equal(heat_lib.client_heat(index.rows[table], rows), n_m)
    np.testing.assert_allclose(heat_lib.sample_heat(index.rows[table], rows, counts), w_m)
    coef = heat_lib.coefficients(w_m, counts.sum())
    touched = w_m > 0
    np.testing.assert_allclose(coef[touched], counts.sum() / w_m[touched])
    assert np.all(coef[~touched] == 1.0)
    assert heat_lib.dispersion(n_m) == n_m.max() / n_m[n_m > 0].min()


def test_coefficients_and_dispersion_written_out():
    """FedSubAvg's total / heat for touched rows (one of heat 1), 1 for untouched ones; the
    dispersion max / min over the touched rows only (NaN when none is touched)."""
    row_heat = np.array([0.0, 1.0, 4.0, 0.0, 10.0])
    np.testing.assert_array_equal(heat_lib.coefficients(row_heat, 20.0), [1, 20, 5, 1, 2])
    assert heat_lib.dispersion(row_heat) == 10.0
    assert heat_lib.dispersion(np.array([0.0, 2.0, 5.0, 8.0])) == 4.0
    assert np.isnan(heat_lib.dispersion(np.zeros(3)))


def test_pull_push_round_trip_leaves_untouched_rows_bit_identical():
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(1000, 4, generator=generator)
    params = Params({"t": table}, {"bias": torch.randn(3, generator=generator)})
    before = params.clone()
    rows = {"t": torch.tensor([3, 17, 512, 999])}
    pulled = pull(params, rows)
    assert pulled.tables["t"].shape == (4, 4)
    trained = pulled.clone()
    trained.tables["t"] += torch.randn(4, 4, generator=generator)
    update = push(0, 1.0, rows, pulled, trained)
    scatter_add_rows(params.tables["t"], rows["t"], update.table_deltas["t"])

    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[rows["t"]] = False
    assert torch.equal(params.tables["t"][untouched], before.tables["t"][untouched])
    torch.testing.assert_close(params.tables["t"][rows["t"]], trained.tables["t"])
    # pulling copies: training the local model never wrote into the global one
    assert torch.equal(params.dense["bias"], before.dense["bias"])
