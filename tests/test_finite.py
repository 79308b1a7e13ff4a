"""any_nonfinite (the round's NaN / Inf checks) against torch.isfinite, entry by entry."""

import numpy as np
import pytest
import torch

from fedsub.numerics.finite import any_nonfinite

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trial", range(30))
def test_agrees_with_isfinite_on_random_tensors(dtype, trial):
    rng = np.random.default_rng(trial)
    tensors = []
    for _ in range(int(rng.integers(1, 4))):
        shape = tuple(int(n) for n in rng.integers(0, 40, size=int(rng.integers(0, 3))))
        t = torch.from_numpy(rng.normal(scale=1e3, size=shape)).to(dtype)
        if t.numel() and rng.random() < 0.5:  # one bad entry somewhere
            bad = [float("nan"), float("inf"), -float("inf")][int(rng.integers(3))]
            t.view(-1)[int(rng.integers(t.numel()))] = bad
        tensors.append(t)
    expected = any(not bool(torch.isfinite(t).all()) for t in tensors)
    got = any_nonfinite(tensors)
    assert got.dtype == torch.bool and got.dim() == 0
    assert bool(got) == expected


def test_every_position_and_kind_and_the_empty_cases():
    for bad in (float("nan"), float("inf"), -float("inf")):
        for position in range(7):
            t = torch.zeros(7)
            t[position] = bad
            assert bool(any_nonfinite([torch.ones(3), t]))
    finite_extremes = torch.tensor([torch.finfo(torch.float32).max, torch.finfo(torch.float32).min])
    assert not bool(any_nonfinite([finite_extremes, torch.tensor(2.0)]))  # 0-d too
    assert not bool(any_nonfinite([])) and not bool(any_nonfinite([torch.zeros(0, 3)]))
    assert bool(any_nonfinite([torch.zeros(0), torch.tensor([float("nan")])]))
