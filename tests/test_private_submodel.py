"""Private submodel learning's pieces: fixed-point encoding, secure sparse row sums (against a
dense per-client sum), randomized-response and bucketed download requests (epsilon against its
formula, the holders estimate unbiased by Monte Carlo)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedsub.numerics.fixed_point import SIGNED_LIMIT, FixedPoint
from fedsub.privacy import private_download as pd
from fedsub.privacy.secagg import SecAggError
from fedsub.privacy.sparse_secagg import RowSlots, encode_client, secure_row_sum, union_of

TABLE_ROWS, WIDTH = 1000, 3


def sparse_clients(n: int, seed: int = 0, scale: float = 0.3):
    """n clients, each with a few rows of a 1000-row table (width 3) and a dense [2, 2]."""
    rng = np.random.default_rng(seed)
    clients = []
    for _ in range(n):
        rows = np.sort(rng.choice(TABLE_ROWS, size=int(rng.integers(1, 12)), replace=False))
        clients.append(
            {
                "rows": rows,
                "deltas": rng.normal(0, scale, (len(rows), WIDTH)),
                "dense": rng.normal(0, scale, (2, 2)),
            }
        )
    return clients


def slots_for(clients) -> RowSlots:
    union = union_of({"t": c["rows"]} for c in clients)
    return RowSlots(union, {"t": WIDTH}, {"w": (2, 2)})


def plain_sums(clients, members):
    """The independent reference: each client's deltas scattered into the whole table."""
    table, dense = np.zeros((TABLE_ROWS, WIDTH)), np.zeros((2, 2))
    for u in members:
        np.add.at(table, clients[u]["rows"], clients[u]["deltas"])
        dense += clients[u]["dense"]
    return table, dense


def run_sum(clients, clip=1.0, **drops):
    slots = slots_for(clients)
    values = {
        u: slots.client_values({"t": c["rows"]}, {"t": c["deltas"]}, {"w": c["dense"]})
        for u, c in enumerate(clients)
    }
    units = {u: 100 + 37 * u for u in range(len(clients))}  # e.g. draws x sample count
    return slots, secure_row_sum(slots, values, clip, weight_units=units, **drops)


def test_fixed_point_scale_cannot_wrap_and_decodes_within_its_bound():
    rng = np.random.default_rng(1)
    for n, clip in [(1, 1.0), (7, 0.01), (100, 1.0), (1000, 50.0)]:
        coding = FixedPoint.for_clients(n, clip)
        assert n * round(clip * coding.scale) < SIGNED_LIMIT
        assert n * round(clip * coding.scale * 2) >= SIGNED_LIMIT  # the finest such power of 2
        values = rng.uniform(-clip, clip, (n, 50))
        values[0, :2] = [clip, -clip]  # the range's ends encode too
        total = np.zeros(50, dtype=np.uint32)
        for row in values:
            encoded, clipped = coding.encode(row)
            assert clipped == 0
            total = total + encoded
        error = np.abs(coding.decode_sum(total) - values.sum(0)).max()
        assert error <= coding.error_bound(n)


def test_fixed_point_clips_and_counts_values_outside_the_range():
    coding = FixedPoint.for_clients(3, 1.0)
    encoded, clipped = coding.encode(np.array([2.5, -7.0, 0.5, 1.0]))
    assert clipped == 2
    assert np.allclose(
        coding.decode_sum(encoded), [1.0, -1.0, 0.5, 1.0], atol=coding.error_bound(1)
    )
    with pytest.raises(ValueError, match="NaN or Inf"):
        coding.encode(np.array([np.nan]))


def test_secure_row_sum_equals_the_plain_sum_within_the_bound():
    clients = sparse_clients(9)
    slots, sums = run_sum(clients)
    table, dense = plain_sums(clients, range(9))
    union = slots.rows["t"]
    assert np.abs(sums.tables["t"] - table[union]).max() <= sums.error_bound
    assert np.abs(sums.dense["w"] - dense).max() <= sums.error_bound
    assert not table[np.setdiff1d(np.arange(TABLE_ROWS), union)].any()  # nothing outside it
    assert sums.clipped == 0 and sums.survivors == tuple(range(9))
    assert sums.error_bound == 9 / (2 * FixedPoint.for_clients(9, 1.0).scale)


def test_secure_row_sum_with_dropouts_is_the_survivors_sum():
    clients = sparse_clients(10, seed=2)
    slots, sums = run_sum(clients, drop_before_masking=[1, 4], drop_after_masking=[7])
    survivors = [u for u in range(10) if u not in (1, 4)]  # 7's masked input arrived
    assert sums.survivors == tuple(survivors)
    table, dense = plain_sums(clients, survivors)
    assert np.abs(sums.tables["t"] - table[slots.rows["t"]]).max() <= sums.error_bound
    assert np.abs(sums.dense["w"] - dense).max() <= sums.error_bound
    assert sums.weight_units == sum(100 + 37 * u for u in survivors)  # exact: integers


def test_weight_units_that_could_wrap_the_integer_sum_are_refused():
    slots = slots_for(sparse_clients(1))
    values = np.zeros(slots.length)
    coding = FixedPoint.for_clients(4, 1.0)
    assert encode_client(slots, coding, values, 2**30 - 1, clients=4)[-2] == 2**30 - 1
    with pytest.raises(ValueError, match=r"weight units 1073741824 out of .*2\^32 / 4"):
        encode_client(slots, coding, values, 2**30, clients=4)


def test_fewer_than_t_survivors_stop_with_a_clear_error():
    clients = sparse_clients(6, seed=3)
    with pytest.raises(SecAggError, match=r"only 3 clients left .* threshold is t = 4"):
        run_sum(clients, drop_before_masking=[0, 2, 5])


def test_clipped_values_are_counted_through_the_secure_sum():
    clients = sparse_clients(5, seed=4, scale=2.0)
    slots, sums = run_sum(clients, clip=1.0)
    expected = sum(
        int((np.abs(c["deltas"]) > 1).sum() + (np.abs(c["dense"]) > 1).sum()) for c in clients
    )
    assert sums.clipped == expected > 0
    clipped = [
        {**c, "deltas": np.clip(c["deltas"], -1, 1), "dense": np.clip(c["dense"], -1, 1)}
        for c in clients
    ]
    table, _ = plain_sums(clipped, range(5))
    assert np.abs(sums.tables["t"] - table[slots.rows["t"]]).max() <= sums.error_bound


def test_a_row_outside_the_union_is_refused():
    slots = RowSlots({"t": np.array([2, 5])}, {"t": 1}, {})
    for row in (3, 9, 0):  # between, past and before the union's rows
        with pytest.raises(ValueError, match="not in the round's union"):
            slots.client_values({"t": np.array([2, row])}, {"t": np.ones((2, 1))}, {})


def test_client_values_lay_out_rows_in_their_slots_and_a_missing_table_as_zeros():
    """[table a's union slots x width, table b's, dense w, 2 integer slots], by hand."""
    slots = RowSlots(
        {"a": np.array([1, 4, 6]), "b": np.array([0, 2])}, {"a": 2, "b": 1}, {"w": (2,)}
    )
    values = slots.client_values(
        {"a": np.array([6, 1])},
        {"a": np.array([[1.0, 2.0], [3.0, 4.0]])},
        {"w": np.array([7.0, 8.0])},
    )
    assert values.tolist() == [3, 4, 0, 0, 1, 2, 0, 0, 7, 8, 0, 0]
    with pytest.raises(ValueError, match="dense parameter 'w' must have shape"):
        slots.client_values({}, {}, {"w": np.zeros(3)})


def test_secure_row_sums_need_a_majority_of_the_cohort():
    from fedsub.privacy.sparse_secagg import majority_threshold

    assert [majority_threshold(n) for n in range(1, 8)] == [1, 2, 2, 3, 3, 4, 4]


def test_epsilon_matches_the_formula():
    assert pd.epsilon_of(0.9, 0.1) == pytest.approx(math.log(81))
    for eps, p in [(0.5, 0.6), (4.0, 0.9), (9.0, 0.99)]:
        q = pd.decoy_probability(eps, p)
        assert 0 < q < p
        assert math.log(p * (1 - q) / (q * (1 - p))) == pytest.approx(eps)
    with pytest.raises(ValueError, match="0 < q < p < 1"):
        pd.epsilon_of(0.5, 0.5)


@pytest.mark.parametrize("p,q", [(0.5, 0.0), (0.5, 0.5), (0.4, 0.5), (1.0, 0.2), (0.9, -0.1)])
def test_epsilon_needs_0_below_q_below_p_below_1(p, q):
    with pytest.raises(ValueError, match="need 0 < q < p < 1"):
        pd.epsilon_of(p, q)


@pytest.mark.parametrize("epsilon,p", [(0.0, 0.5), (-1.0, 0.5), (1.0, 0.0), (1.0, 1.0)])
def test_decoy_probability_needs_a_positive_epsilon_and_0_below_p_below_1(epsilon, p):
    with pytest.raises(ValueError, match="need epsilon > 0 and 0 < p < 1"):
        pd.decoy_probability(epsilon, p)


def test_decoys_are_distinct_rows_outside_the_held_set():
    rng = np.random.default_rng(5)
    held = np.array([0, 3, 4, 9, 17])
    for _ in range(50):
        decoys = pd._outside(held, 10, 20, rng)
        assert len(np.unique(decoys)) == 10 and decoys.min() >= 0 and decoys.max() < 20
        assert not np.isin(decoys, held).any()
    everything = pd._outside(held, 15, 20, rng)  # the whole complement
    assert np.array_equal(everything, np.setdiff1d(np.arange(20), held))


def test_randomized_requests_keep_with_p_and_the_holders_estimate_is_unbiased():
    """Monte Carlo: 400 rounds of N = 30 clients over a 200-row table; the mean of
    (c - qN)/(p - q) per row is within 5 standard errors of the true number of holders."""
    rng = np.random.default_rng(6)
    n_clients, rows, trials, eps, p = 30, 200, 400, 2.0, 0.8
    q = pd.decoy_probability(eps, p)
    held = [
        np.sort(rng.choice(rows, size=int(rng.integers(1, 20)), replace=False))
        for _ in range(n_clients)
    ]
    truth = np.bincount(np.concatenate(held), minlength=rows)
    estimates = np.zeros((trials, rows))
    kept = requested_decoys = 0
    for trial in range(trials):
        counts = np.zeros(rows)
        for own in held:
            request = pd.randomized_request(own, rows, p, q, rng)
            counts[request] += 1
            kept += np.isin(own, request).sum()
            requested_decoys += len(request) - np.isin(own, request).sum()
        estimates[trial] = pd.estimate_holders(counts, n_clients, p, q)
    # each count is a sum of independent Bernoullis: var = n p(1-p) + (N - n) q(1-q)
    std = np.sqrt(truth * p * (1 - p) + (n_clients - truth) * q * (1 - q)) / (p - q)
    assert np.all(np.abs(estimates.mean(0) - truth) <= 5 * std / np.sqrt(trials))
    total_held = sum(len(h) for h in held) * trials
    assert kept / total_held == pytest.approx(p, abs=0.01)
    total_other = sum(rows - len(h) for h in held) * trials
    assert requested_decoys / total_other == pytest.approx(q, abs=0.005)


def test_bucketed_requests_pad_to_the_next_size_class():
    rng = np.random.default_rng(7)
    assert [pd.size_class(c, 8, 1000) for c in (0, 7, 8, 9, 16, 600)] == [8, 8, 16, 16, 32, 1000]
    for size in (1, 8, 30):
        held = np.sort(rng.choice(500, size=size, replace=False))
        request = pd.bucketed_request(held, 500, 8, rng)
        assert len(request) == pd.size_class(size, 8, 500) > size
        assert np.isin(held, request).all()


@pytest.mark.parametrize(
    "clients, clip",
    [(1, 1.0), (3, 1.0), (1, 0.3), (7, 0.3), (100, 1e8), (1, 2 - 2**-30), (2, 2 - 2**-30)],
)
def test_the_fixed_point_scale_is_the_finest_power_of_two_that_cannot_wrap(clients, clip):
    """Written out: scale = 2^b, the largest b with clients * round(clip * 2^b) < 2^31 (b may
    be negative for large clips). At clip = 2 - 2^-30 one client fills 2^31 - 1 exactly at
    b = 30, and two clients' rounding (2^30 - 1/2 to the even 2^30) reaches 2^31 at b = 29."""
    scale = FixedPoint.for_clients(clients, clip).scale
    assert math.log2(scale).is_integer()
    assert clients * round(clip * scale) < SIGNED_LIMIT
    assert clients * round(clip * 2 * scale) >= SIGNED_LIMIT
    assert FixedPoint.for_clients(clients, clip).error_bound(clients) == clients / (2 * scale)


def test_the_fixed_point_needs_a_client_and_a_positive_clip():
    assert FixedPoint.for_clients(1, 1e-6).scale > 0
    for clients, clip in [(0, 1.0), (1, 0.0), (1, -1.0)]:
        with pytest.raises(ValueError, match="at least one client and clip > 0"):
            FixedPoint.for_clients(clients, clip)


def test_only_values_beyond_the_clip_count_as_clipped():
    _, clipped = FixedPoint(1.0, 8.0).encode(np.array([1.0, -1.0, 0.5, 1.5, -3.0]))
    assert clipped == 2


def test_a_request_is_the_clients_own_rows_below_level_download_and_hides_them_above():
    """Below ``download`` the request is S(k) itself; at ``download`` (buckets) it is a
    larger bucket that holds S(k)."""
    from fedsub.privacy.levels import Privacy
    from fedsub.privacy.requests import client_request

    rows = {"t": np.array([3, 17, 40])}
    for level in ("none", "heat"):
        plain = client_request(Privacy(level), rows, {"t": 1000}, 0, 1, 5)
        assert plain["t"].tolist() == [3, 17, 40]
    privacy = Privacy("download", download="buckets", download_bucket=8)
    hidden = client_request(privacy, rows, {"t": 1000}, 0, 1, 5)["t"]
    assert len(hidden) >= 8 and set(rows["t"]) <= set(hidden.tolist())
