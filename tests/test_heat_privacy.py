"""Private heat counts: randomized response, count-min sketch, and FedSubAvg fed by them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm, heat_coefficients
from fedsub.data.synthetic_sparse import SyntheticSparseOptions, generate
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.privacy import randomized_response as rr
from fedsub.privacy.heat_sources import HeatPrivacy, describe, estimate_heat
from fedsub.privacy.sketch import CountMinSketch
from fedsub.submodel.index import SubmodelIndex


def test_randomized_response_epsilon_matches_the_formula():
    for eps in (0.5, 1.0, 3.0):
        p = rr.keep_probability(eps)
        assert rr.epsilon_of(p) == pytest.approx(eps, abs=1e-12)
        assert p / (1 - p) == pytest.approx(math.exp(eps))


def test_randomized_response_estimator_is_unbiased():
    rng = np.random.default_rng(0)
    universe, clients, eps = 30, 40, 1.0
    sets = [rng.choice(universe, size=rng.integers(1, 10), replace=False) for _ in range(clients)]
    weights = rng.integers(1, 20, size=clients).astype(float)
    truth = np.zeros(universe)
    for s, w in zip(sets, weights, strict=True):
        truth[s] += w
    draws = 3000
    estimates = np.zeros((draws, universe))
    for d in range(draws):
        reports = sum(
            w * rr.report(s, universe, eps, rng) for s, w in zip(sets, weights, strict=True)
        )
        estimates[d] = rr.estimate(reports, weights.sum(), eps)
    mean = estimates.mean(0)
    std_error = estimates.std(0) / math.sqrt(draws)
    assert np.all(np.abs(mean - truth) <= 5 * std_error)


def test_count_min_sketch_error_within_its_bound_on_zipf():
    rng = np.random.default_rng(1)
    universe = 20_000
    popularity = 1 / np.arange(1, universe + 1) ** 1.1
    popularity /= popularity.sum()
    sketch = CountMinSketch.for_error(eps=0.002, delta=0.01, seed=3)
    table = np.zeros((sketch.depth, sketch.width), dtype=np.int64)
    truth = np.zeros(universe, dtype=np.int64)
    for _ in range(300):  # clients, each with its own set of items
        items = np.unique(rng.choice(universe, size=50, p=popularity))
        truth[items] += 1
        table += sketch.sketch(items, np.ones(len(items), dtype=np.int64))
    estimate = sketch.estimate(table, np.arange(universe))
    assert np.all(estimate >= truth)  # never under
    bound = sketch.eps * truth.sum()
    violations = np.mean(estimate - truth > bound)
    assert violations <= sketch.delta


def test_count_min_sketch_sizes_hashes_and_guarantees_written_out():
    """width = ceil(e / eps) and depth = ceil(ln(1 / delta)); the guarantees it reports are
    e / width and exp(-depth); row m's bucket in hash row d is ((a_d m + b_d) mod p) mod width,
    p = 2^61 - 1 (Cormode and Muthukrishnan), computed here in Python integers."""
    sketch = CountMinSketch.for_error(eps=0.01, delta=0.05, seed=7)
    assert (sketch.width, sketch.depth) == (272, 3)
    assert sketch.eps == math.e / 272 and sketch.delta == math.exp(-3)
    a, b = sketch._coefficients()
    p = 2**61 - 1
    rows = np.array([0, 1, 2, 12345, 10**9])  # a m + b runs past 2^64: exact integers needed
    want = [[(int(a[d]) * int(m) + int(b[d])) % p % 272 for m in rows] for d in range(3)]
    assert sketch.buckets(rows).tolist() == want


def test_grouped_secure_sum_is_the_sum_with_a_majority_threshold_per_group(monkeypatch):
    """Nine vectors in groups of 4, 4 and 1: each group's secure sum has threshold
    floor(n / 2) + 1, and the total is the plain sum (one vector alone too)."""
    from fedsub.privacy import heat_sources

    calls = []
    real = heat_sources.secure_sum

    def recording(group, threshold):
        calls.append((len(group), threshold))
        return real(group, threshold=threshold)

    monkeypatch.setattr(heat_sources, "secure_sum", recording)
    vectors = [np.array([k, 2 * k, 7], dtype=np.uint32) for k in range(1, 10)]
    assert heat_sources.grouped_secure_sum(vectors, 4).tolist() == [45, 90, 63]
    assert calls == [(4, 3), (4, 3), (1, 1)]
    assert heat_sources.grouped_secure_sum(vectors[:1], 4).tolist() == [1, 2, 7]


@pytest.fixture(scope="module")
def small():
    dataset = generate(
        SyntheticSparseOptions(num_users=60, num_items=25, mean_samples_per_user=8), seed=2
    )
    return dataset, SubmodelIndex.build(dataset)


@pytest.mark.parametrize("kind", ["clients", "samples"])
def test_secagg_heat_equals_exact_and_so_does_the_model(small, kind):
    dataset, index = small
    exact = estimate_heat(dataset, index, kind, HeatPrivacy("exact"))
    secure = estimate_heat(dataset, index, kind, HeatPrivacy("secagg", group_size=16))
    np.testing.assert_array_equal(secure["features"], exact["features"])

    model = SparseLogisticRegression(dict(dataset.table_rows))
    schedule = Schedule(
        3, 10, LocalWork(3, 4, ClientStep(0.2)), seed=0, execution=Execution(dtype=torch.float64)
    )
    results = []
    for source in ("exact", "secagg"):
        context = AlgorithmContext(dataset, index, kind, 10, HeatPrivacy(source, group_size=16))
        results.append(
            train(model, build_algorithm("fedsubavg", context), dataset, index, schedule).tables[
                "features"
            ]
        )
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("kind", ["clients", "samples"])
def test_noisy_sources_give_bounded_coefficients(kind):
    """Many cold rows: the noisy estimates leave [lowest, total] (0 or below), and the
    coefficients are total / (the estimate clipped to [lowest, total])."""
    dataset = generate(
        SyntheticSparseOptions(num_users=60, num_items=400, mean_samples_per_user=4), seed=2
    )
    index = SubmodelIndex.build(dataset)
    for source in ("sketch", "randomized-response"):
        privacy = HeatPrivacy(source, group_size=16, rr_epsilon=1.0)
        raw = estimate_heat(dataset, index, kind, privacy)["features"]
        counts = dataset.sample_counts()
        total, lowest = (
            (float(len(counts)), 1.0) if kind == "clients" else (counts.sum(), counts.min())
        )
        assert raw.min() < lowest or raw.max() > total  # the clip has work to do
        context = AlgorithmContext(dataset, index, kind, 10, privacy)
        coef = heat_coefficients(context)["features"].numpy()
        assert np.all(coef >= 1.0) and np.all(coef <= total / lowest)
        # the estimate clipped to [lowest, total], then total / heat: a row whose estimate
        # fell to 0 or below gets the largest correction, not an untouched row's 1
        np.testing.assert_allclose(coef, total / np.clip(raw, lowest, total), rtol=1e-12)


@pytest.mark.parametrize("kind", ["clients", "samples"])
def test_randomized_response_heat_at_a_large_epsilon_is_the_exact_heat(small, kind):
    """At epsilon = 12 a reported bit flips with probability 1 / (1 + e^12) ~ 6e-6 (no flip
    here): (sum_k w_k report_k - (1 - p) W) / (2p - 1) is then the exact heat up to
    (1 - p) W / (2p - 1), far below one client's weight."""
    dataset, index = small
    exact = estimate_heat(dataset, index, kind, HeatPrivacy("exact"))
    noisy = estimate_heat(dataset, index, kind, HeatPrivacy("randomized-response", rr_epsilon=12))
    counts = dataset.sample_counts()
    total = float(len(counts)) if kind == "clients" else float(counts.sum())
    p = rr.keep_probability(12.0)
    for table, heat in exact.items():
        assert heat.max() > 0
        np.testing.assert_allclose(noisy[table], heat, rtol=0, atol=2 * (1 - p) * total)


@pytest.mark.parametrize("kind", ["clients", "samples"])
def test_measured_heat_gives_the_coefficients_of_its_totals(small, kind):
    """Heat measured over a network (Flower's exchange: no index sets, no counts) gives
    total / clip(heat, lowest, total), with total = N (clients) or the sample total (samples)
    and lowest = 1 or the smallest client weight."""
    from fedsub.privacy.heat_vectors import MeasuredHeat

    dataset, index = small
    heat = np.array([-3.0, 0.0, 0.5, 2.0, 7.0, 500.0, 1e6])
    measured = MeasuredHeat("sketch", {"features": heat}, 900.0, 60, lowest_weight=4.0)
    context = AlgorithmContext(dataset, index, kind, 10, measured=measured)
    coef = heat_coefficients(context)["features"].numpy()
    total, lowest = (60.0, 1.0) if kind == "clients" else (900.0, 4.0)
    np.testing.assert_allclose(coef, total / np.clip(heat, lowest, total), rtol=1e-12)


def test_run_records_what_the_heat_source_guarantees(tmp_path):
    import json

    from fedsub.cli import main

    out = tmp_path / "out"
    assert (
        main(
            [
                "run",
                "--algorithm",
                "fedsubavg",
                "--out",
                str(out),
                "--quiet",
                "--set",
                "data.num_users=40",
                "--set",
                "train.clients_per_round=10",
                "--set",
                "privacy.secagg_group=20",
                "--set",
                "train.rounds=2",
                "--set",
                "privacy.heat_source=sketch",
                "--set",
                "privacy.sketch_eps=0.01",
            ]
        )
        == 0
    )
    record = json.loads((out / "heat_source.json").read_text())
    assert record["source"] == "sketch" and record["width"] == 272 and record["depth"] == 5
    assert record["error_bound"]["features"] > 0


def test_coefficients_are_computed_once_per_context(small, monkeypatch):
    dataset, index = small
    calls = []
    real = HeatPrivacy.estimate  # the context's heat source's
    monkeypatch.setattr(HeatPrivacy, "estimate", lambda *a: calls.append(1) or real(*a))
    context = AlgorithmContext(dataset, index, "clients", 10, HeatPrivacy("secagg", group_size=16))
    first = heat_coefficients(context)
    build_algorithm("fedsubavg", context)
    build_algorithm("fedsubavg@scheme2", context)
    assert heat_coefficients(context) is first and len(calls) == 1


def test_the_heat_sources_record_states_their_guarantees_written_out(small):
    """heat_source.json: secagg is exact; the sketch's bound per table is eps times the
    weighted mass sum_k |S(k)| w_k; randomized response's estimate has standard deviation
    sqrt(p (1 - p) sum_k w_k^2) / (2p - 1)."""
    dataset, index = small
    counts = dataset.sample_counts()
    for kind, weights in (("clients", np.ones(len(counts))), ("samples", counts)):
        assert describe(dataset, index, kind, HeatPrivacy("secagg"))["exact"] is True
        sketch = describe(dataset, index, kind, HeatPrivacy("sketch", sketch_eps=0.01))
        assert sketch["eps"] == math.e / sketch["width"]
        for table in dataset.table_rows:
            mass = sum(len(index.client_rows(table, k)) * w for k, w in enumerate(weights))
            assert sketch["error_bound"][table] == pytest.approx(sketch["eps"] * mass)
        noisy = describe(dataset, index, kind, HeatPrivacy("randomized-response", rr_epsilon=1.5))
        p = math.exp(1.5) / (1 + math.exp(1.5))
        assert noisy["keep_probability"] == pytest.approx(p)
        spread = math.sqrt(p * (1 - p) * float((weights.astype(float) ** 2).sum())) / (2 * p - 1)
        assert noisy["estimate_std"] == pytest.approx(spread)


@pytest.mark.parametrize("kind", ["clients", "samples"])
def test_heat_read_from_the_nodes_summed_vectors_is_each_tables_heat(kind):
    """The Flower heat exchange, two tables of different sizes: the sum of every node's
    ``summed_vector`` decodes (``heat_from_sum``) to each table's heat by hand, the total
    sample count and the number of nodes."""
    from fedsub.privacy.heat_vectors import heat_from_sum, summed_vector

    privacy = HeatPrivacy("secagg")
    table_rows = {"b": 3, "a": 4}
    nodes = [({"a": [0, 2], "b": [1]}, 5), ({"a": [2, 3], "b": [0, 1]}, 2)]
    total = sum(
        summed_vector(privacy, kind, table_rows, rows, n).astype(np.int64) for rows, n in nodes
    )
    measured = heat_from_sum(privacy, table_rows, total)
    w = [1, 1] if kind == "clients" else [5, 2]
    assert measured.heat["a"].tolist() == [w[0], 0, w[0] + w[1], w[1]]
    assert measured.heat["b"].tolist() == [w[1], w[0] + w[1], 0]
    assert (measured.total_samples, measured.num_clients) == (7.0, 2)


@pytest.mark.parametrize("kind", ["clients", "samples"])
def test_the_heat_of_a_range_of_rows_counts_the_clients_touching_them(small, kind):
    """``keep``: position i is row keep[i]'s sum of w_k (1 or the sample count) over the
    clients whose S(k) holds it, written out client by client."""
    from fedsub.submodel import heat as heat_lib

    dataset, index = small
    rows, counts = index.rows["features"], dataset.sample_counts()
    size = dataset.table_rows["features"]
    for keep in (range(0, size), range(3, size // 2), range(size - 5, size), range(4, 4)):
        expected = np.zeros(len(keep))
        for k in range(dataset.num_clients):
            w = 1.0 if kind == "clients" else float(counts[k])
            for m in rows.values[rows.offsets[k] : rows.offsets[k + 1]]:
                if keep.start <= m < keep.stop:
                    expected[m - keep.start] += w
        got = heat_lib.heat(rows, size, counts, kind, keep)
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("source", ["exact", "secagg", "sketch", "randomized-response"])
@pytest.mark.parametrize("kind", ["clients", "samples"])
def test_each_process_computes_only_its_rows_coefficients_and_they_are_the_whole_tables(
    small, kind, source, monkeypatch
):
    """Row-sharded tables: a context ``sharded`` for process r of P gives coefficients as
    long as r's share of the rows, equal bit for bit to the whole table's at those rows (the
    randomized responses drawn in chunks of 7 uniforms: the generator's stream is the whole
    report's)."""
    from fedsub.distributed import Processes

    monkeypatch.setattr(rr, "CHUNK", 7)
    dataset, index = small
    privacy = HeatPrivacy(source, group_size=16, sketch_eps=0.05, rr_epsilon=1.0, seed=4)
    context = AlgorithmContext(dataset, index, kind, 10, privacy)
    whole = heat_coefficients(context)
    for world in (2, 3):
        parts = [heat_coefficients(context.sharded(Processes(r, world))) for r in range(world)]
        for table, coefficients in whole.items():
            lengths = [len(p[table]) for p in parts]
            size = dataset.table_rows[table]
            assert lengths == [len(Processes(r, world).share(size)) for r in range(world)]
            assert torch.equal(torch.cat([p[table] for p in parts]), coefficients), table


def test_measured_heat_is_cut_to_the_process_s_rows(small):
    from fedsub.distributed import Processes
    from fedsub.privacy.heat_vectors import MeasuredHeat

    dataset, index = small
    heat = np.arange(dataset.table_rows["features"], dtype=np.float64) % 7
    measured = MeasuredHeat("sketch", {"features": heat}, 900.0, 60, lowest_weight=4.0)
    context = AlgorithmContext(dataset, index, "samples", 10, measured=measured)
    whole = heat_coefficients(context)["features"]
    parts = [heat_coefficients(context.sharded(Processes(r, 3)))["features"] for r in range(3)]
    assert torch.equal(torch.cat(parts), whole)
    assert len(parts[0]) < len(whole)
