"""Local sample orders: fresh permutations per pass, independent of the cohort, uniform, and
bit for bit those of the numpy uint64 SplitMix64 reference below (fedsub's orders before the
round moved to torch), so every published number keeps its batches."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsub.engine.shuffle import (
    cohort_schedules,
    numpy_schedules,
    sorted_within_blocks,
    splitmix64,
    splitmix64_int,
    torch_schedules,
)

KERNELS = {"torch": torch_schedules, "numpy": numpy_schedules}

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


def numpy_splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MUL1
        z = (z ^ (z >> np.uint64(27))) * _MUL2
        return z ^ (z >> np.uint64(31))


def numpy_mix(*parts) -> np.ndarray:
    key = np.zeros(np.broadcast(*parts).shape, dtype=np.uint64)
    for part in parts:
        key = numpy_splitmix64(key ^ np.asarray(part).astype(np.uint64))
    return key


def numpy_cohort_schedules(seed, round_index, clients, counts, steps, batch_size) -> np.ndarray:
    """The numpy implementation fedsub used before the round moved to torch, kept verbatim."""
    clients = np.asarray(clients, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    needed = steps * batch_size
    passes = -(-needed // counts)
    block = passes * counts
    member = np.repeat(np.arange(len(clients)), block)
    start = np.repeat(np.cumsum(block) - block, block)
    position = np.arange(block.sum()) - start
    sample, pass_index = position % counts[member], position // counts[member]
    client_keys = numpy_mix(np.uint64(seed), np.uint64(round_index), clients)
    keys = numpy_splitmix64(
        numpy_splitmix64(client_keys[member] ^ pass_index.astype(np.uint64))
        ^ sample.astype(np.uint64)
    )
    pass_block = np.cumsum(passes)[member] - passes[member] + pass_index
    order = np.argsort(
        (pass_block.astype(np.uint64) << np.uint64(32)) | (keys >> np.uint64(32)), kind="stable"
    )
    shuffled = sample[order]
    take = (np.cumsum(block) - block)[:, None] + np.arange(needed)[None, :]
    return shuffled[take].reshape(len(clients), steps, batch_size)


def schedules(seed, round_index, clients, counts, steps, batch, kernel=cohort_schedules):
    clients, counts = torch.as_tensor(np.asarray(clients)), torch.as_tensor(np.asarray(counts))
    return kernel(seed, round_index, clients, counts, steps, batch).numpy()


def test_splitmix64_matches_uint64_arithmetic():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**64, size=2000, dtype=np.uint64)
    x[:4] = [0, 1, 2**63, 2**64 - 1]
    mixed = splitmix64(torch.from_numpy(x.view(np.int64))).numpy().view(np.uint64)
    np.testing.assert_array_equal(mixed, numpy_splitmix64(x))
    assert [splitmix64_int(int(v)) for v in x[:50]] == numpy_splitmix64(x[:50]).tolist()


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("trial", range(40))
def test_bit_identical_to_the_numpy_reference(trial, kernel):
    """Random cohorts, counts, steps and batches, single- and multi-pass, 64-bit seeds."""
    rng = np.random.default_rng(trial)
    k = int(rng.integers(1, 12))
    counts = rng.integers(1, 60, size=k)
    clients = rng.choice(10**7, size=k, replace=False)
    steps, batch = int(rng.integers(1, 12)), int(rng.integers(1, 10))
    seed, round_index = int(rng.integers(0, 2**63)), int(rng.integers(0, 10**6))
    expected = numpy_cohort_schedules(seed, round_index, clients, counts, steps, batch)
    got = schedules(seed, round_index, clients, counts, steps, batch, KERNELS[kernel])
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_bit_identical_on_the_benchmark_shape_and_many_passes(kernel):
    rng = np.random.default_rng(7)
    clients = rng.choice(1000, size=50, replace=False)
    for counts, steps, batch in (
        (rng.integers(60, 140, size=50), 10, 5),  # one pass each
        (rng.integers(1, 8, size=50), 10, 5),  # up to 50 passes
        (np.full(50, 50), 10, 5),  # exactly one full pass
    ):
        for seed in (0, 1, 2**31 - 1, 2**63 - 1):
            expected = numpy_cohort_schedules(seed, 3, clients, counts, steps, batch)
            np.testing.assert_array_equal(
                schedules(seed, 3, clients, counts, steps, batch, KERNELS[kernel]), expected
            )


@pytest.mark.parametrize("largest", [2, 100, 2**20, 2**27, 2**28, 2**31])
def testsorted_within_blocks_is_the_stable_argsort_with_ties(largest):
    """Equal 32-bit keys inside a block keep their sample order, as the stable argsort of
    ``block << 32 | key`` (the reference) does; blocks too wide for one 64-bit value (2**31
    samples) take that argsort itself. With 30 blocks (5 bits) and the 32 key bits, 2**27
    samples fill the 64 bits exactly and 2**28 need 65: the edges of the packed sort."""
    rng = np.random.default_rng(largest)
    sizes = rng.integers(1, min(largest, 40) + 1, size=30)  # samples < largest
    block = np.repeat(np.arange(30), sizes)
    sample = np.concatenate([np.arange(s) for s in sizes])
    high = rng.integers(0, 4, size=len(block)).astype(np.uint64)  # many ties
    high[::7] = np.uint64(2**32 - 1)
    order = np.argsort((block.astype(np.uint64) << np.uint64(32)) | high, kind="stable")
    got = sorted_within_blocks(block, high, sample, largest)
    np.testing.assert_array_equal(got, sample[order])
    assert got.dtype == np.int64


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(1, 30), min_size=1, max_size=6),
    steps=st.integers(1, 8),
    batch=st.integers(1, 7),
    seed=st.integers(0, 2**31),
)
def test_each_pass_is_a_permutation_and_cohort_does_not_matter(counts, steps, batch, seed):
    clients = np.arange(100, 100 + len(counts))
    orders = schedules(seed, 4, clients, np.array(counts), steps, batch)
    assert orders.shape == (len(counts), steps, batch)
    for j, n in enumerate(counts):
        flat = orders[j].reshape(-1)
        for start in range(0, len(flat), n):
            chunk = flat[start : start + n]
            assert len(set(chunk.tolist())) == len(chunk)  # no repeat inside a pass
            assert chunk.min() >= 0 and chunk.max() < n
            if len(chunk) == n:
                assert sorted(chunk.tolist()) == list(range(n))
        alone = schedules(seed, 4, clients[j : j + 1], np.array([n]), steps, batch)[0]
        np.testing.assert_array_equal(alone, orders[j])


def test_first_draw_is_uniform_and_rounds_differ():
    n, draws = 6, 6000
    first = np.array(
        [schedules(1, r, np.array([3]), np.array([n]), 1, 1)[0, 0, 0] for r in range(draws)]
    )
    counts = np.bincount(first, minlength=n)
    expected = draws / n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 20.5  # 99.9% quantile of chi-square with 5 degrees of freedom
    a = schedules(1, 1, np.array([3]), np.array([50]), 1, 50)
    b = schedules(1, 2, np.array([3]), np.array([50]), 1, 50)
    assert not np.array_equal(a, b)
