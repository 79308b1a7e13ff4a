"""Local sample orders: fresh permutations per pass, independent of the cohort, uniform."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsub.engine.shuffle import cohort_schedules


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(1, 30), min_size=1, max_size=6),
    steps=st.integers(1, 8),
    batch=st.integers(1, 7),
    seed=st.integers(0, 2**31),
)
def test_each_pass_is_a_permutation_and_cohort_does_not_matter(counts, steps, batch, seed):
    clients = np.arange(100, 100 + len(counts))
    orders = cohort_schedules(seed, 4, clients, np.array(counts), steps, batch)
    assert orders.shape == (len(counts), steps, batch)
    for j, n in enumerate(counts):
        flat = orders[j].reshape(-1)
        for start in range(0, len(flat), n):
            chunk = flat[start : start + n]
            assert len(set(chunk.tolist())) == len(chunk)  # no repeat inside a pass
            assert chunk.min() >= 0 and chunk.max() < n
            if len(chunk) == n:
                assert sorted(chunk.tolist()) == list(range(n))
        alone = cohort_schedules(seed, 4, clients[j : j + 1], np.array([n]), steps, batch)[0]
        np.testing.assert_array_equal(alone, orders[j])


def test_first_draw_is_uniform_and_rounds_differ():
    n, draws = 6, 6000
    first = np.array(
        [cohort_schedules(1, r, np.array([3]), np.array([n]), 1, 1)[0, 0, 0] for r in range(draws)]
    )
    counts = np.bincount(first, minlength=n)
    expected = draws / n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 20.5  # 99.9% quantile of chi-square with 5 degrees of freedom
    a = cohort_schedules(1, 1, np.array([3]), np.array([50]), 1, 50)
    b = cohort_schedules(1, 2, np.array([3]), np.array([50]), 1, 50)
    assert not np.array_equal(a, b)
