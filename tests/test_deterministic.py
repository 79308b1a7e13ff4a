"""``execution.deterministic``: the round's scatter-adds as sorted segment sums
(numerics/segment_sum.py).

The helper against an independent reference (a Python loop adding each destination's entries
in their original order), both paths equal, and whole runs: a deterministic run equals the
fast one, repeats itself bit for bit, and a run killed and resumed equals an uninterrupted one
bit for bit. The CUDA tests (skipped without a GPU) check the same where atomics really race.
"""

from __future__ import annotations

import os

import pytest
import torch

from fedsub import config as config_lib
from fedsub import device as device_lib
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.execution import Execution
from fedsub.engine.loop import Interrupted, RunControl
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.numerics import segment_sum
from fedsub.runs.run_setup import schedule_of

from .test_backends import run

CUDA = torch.cuda.is_available()
# cuBLAS reads its workspace setting when torch creates its handle: set it at collection,
# before any test's first CUDA matmul, so deterministic runs are deterministic in cuBLAS too
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def random_scatter(seed: int, entries: int, rows: int, dim: int | None, device: str = "cpu"):
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(0, rows, (entries,), generator=generator)
    shape = (entries,) if dim is None else (entries, dim)
    source = torch.randn(*shape, generator=generator, dtype=torch.float64)
    return index.to(device), source.to(device)


def in_order_reference(index: torch.Tensor, source: torch.Tensor, rows: int) -> torch.Tensor:
    """Each destination's entries added one by one, in their original order, from 0."""
    out = torch.zeros(rows, *source.shape[1:], dtype=source.dtype)
    for i, row in enumerate(index.tolist()):
        out[row] = out[row] + source[i]
    return out


@pytest.mark.parametrize("dim", [None, 3])
@pytest.mark.parametrize("entries", [0, 1, 40])
def test_sorted_segment_sums_add_each_destination_in_order(entries, dim):
    index, source = random_scatter(entries + 1, entries, 11, dim)
    with segment_sum.deterministic_run(True):
        got = segment_sum.segment_sum(index, source, 11)
    assert torch.equal(got, in_order_reference(index, source, 11))
    destinations, sums = segment_sum.sorted_segment_sums(index, source)
    assert torch.equal(destinations, torch.unique(index))
    assert torch.equal(sums, got.index_select(0, destinations))


def test_both_paths_equal_and_only_a_deterministic_run_takes_the_sorted_one(monkeypatch):
    index, source = random_scatter(3, 200, 17, 4)
    start = torch.randn(17, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    fast = segment_sum.index_add(start, index, source)
    in_place = start.clone()
    segment_sum.index_add_(in_place, index, source)
    assert torch.equal(in_place, fast)
    calls: list[int] = []
    original = segment_sum.sorted_segment_sums

    def counting(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(segment_sum, "sorted_segment_sums", counting)
    segment_sum.index_add(start, index, source)
    assert calls == []  # the fast path outside a deterministic run
    with segment_sum.deterministic_run(True):
        sorted_path = segment_sum.index_add(start, index, source)
        again = start.clone()
        segment_sum.index_add_(again, index, source)
    assert len(calls) == 2
    torch.testing.assert_close(sorted_path, fast, rtol=0, atol=1e-12)
    assert torch.equal(again, sorted_path)
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the block


def test_the_sorted_path_is_differentiable_like_index_add():
    index, source = random_scatter(4, 30, 6, 2)
    weights = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = []
    for deterministic in (False, True):
        leaf = source.clone().requires_grad_(True)
        with segment_sum.deterministic_run(deterministic):
            total = (segment_sum.segment_sum(index, leaf, 6) * weights).sum()
        grads.append(torch.autograd.grad(total, leaf)[0])
    assert torch.equal(grads[0], weights.index_select(0, index))
    assert torch.equal(grads[1], grads[0])


def test_train_deterministic_is_a_config_key_of_the_schedule():
    assert schedule_of(config_lib.load(None)).execution.deterministic is False
    config = config_lib.load(None, ["execution.deterministic=true"])
    assert schedule_of(config).execution.deterministic is True
    with pytest.raises(config_lib.ConfigError, match=r"execution\.deterministic"):
        config_lib.load(None, ['execution.deterministic="yes"'])


ALGORITHMS = ["fedsubavg", "scaffold", "fedadam", "fedavg"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("data", ["synthetic", "two-tables-dense"])
def test_a_deterministic_run_equals_the_fast_run_and_repeats_bit_for_bit(
    monkeypatch, algorithm, data
):
    """With the CPU fast paths off (the GPU's torch kernels), for sparse LR's closed form
    and embedding LR's autograd (sum pooling), every stateful server step."""
    monkeypatch.setattr(device_lib, "CPU_FAST_PATHS", False)
    schedule = Schedule(
        3, 6, LocalWork(3, 2, ClientStep(0.3)), seed=1, execution=Execution(dtype=torch.float64)
    )
    modes: list[bool] = []
    record = lambda _round: modes.append(torch.are_deterministic_algorithms_enabled())  # noqa: E731
    fast = run(data, algorithm, schedule, on_round=record)
    sure = Schedule(
        3,
        6,
        LocalWork(3, 2, ClientStep(0.3)),
        seed=1,
        execution=Execution(dtype=torch.float64, deterministic=True),
    )
    first = run(data, algorithm, sure, on_round=record)
    second = run(data, algorithm, sure)
    assert modes == [False] * 3 + [True] * 3
    assert not torch.are_deterministic_algorithms_enabled()
    for name, expected in fast.state_dict().items():
        assert expected.abs().max() > 1e-3, name
        torch.testing.assert_close(first.state_dict()[name], expected, rtol=0, atol=1e-12)
        assert torch.equal(second.state_dict()[name], first.state_dict()[name]), name


def interrupted_then_resumed(data, algorithm, schedule, folder):
    rounds_done: list[int] = []
    stop = RunControl(checkpoints=folder, stop_requested=lambda: rounds_done[-1] >= 1)
    with pytest.raises(Interrupted) as stopped:
        run(data, algorithm, schedule, control=stop, on_round=rounds_done.append)
    saved = checkpoint_lib.load(stopped.value.checkpoint)
    return run(data, algorithm, schedule, control=RunControl(resume=saved))


@pytest.mark.parametrize("algorithm", ["fedsubavg", "scaffold", "fedadam"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_deterministic_run_killed_and_resumed_equals_an_uninterrupted_one_bit_for_bit(
    monkeypatch, tmp_path, algorithm, dtype
):
    monkeypatch.setattr(device_lib, "CPU_FAST_PATHS", False)
    schedule = Schedule(
        3,
        6,
        LocalWork(3, 2, ClientStep(0.3)),
        seed=2,
        execution=Execution(dtype=dtype, deterministic=True),
    )
    straight = run("synthetic", algorithm, schedule)
    resumed = interrupted_then_resumed("synthetic", algorithm, schedule, tmp_path)
    for name, expected in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], expected), name


# --- CUDA (skipped without a GPU): atomics race there, the sorted sums do not


@needs_cuda
def test_cuda_sorted_segment_sums_equal_the_in_order_reference_and_index_add():
    index, source = random_scatter(7, 100_000, 50, 8, "cuda")
    with segment_sum.deterministic_run(True):
        sums = [segment_sum.segment_sum(index, source, 50) for _ in range(3)]
    assert all(torch.equal(s, sums[0]) for s in sums)
    fast = segment_sum.segment_sum(index, source, 50)
    torch.testing.assert_close(sums[0], fast, rtol=0, atol=1e-9)
    small_index, small_source = random_scatter(8, 300, 7, 2)
    with segment_sum.deterministic_run(True):
        got = segment_sum.segment_sum(small_index.cuda(), small_source.cuda(), 7)
    assert torch.equal(got.cpu(), in_order_reference(small_index, small_source, 7))


@needs_cuda
@pytest.mark.parametrize("algorithm", ["fedsubavg", "scaffold", "fedadam"])
@pytest.mark.parametrize("data", ["synthetic", "two-tables-dense"])
def test_cuda_deterministic_runs_repeat_and_resume_bit_for_bit(tmp_path, algorithm, data):
    cuda = torch.device("cuda")
    schedule = Schedule(
        3,
        6,
        LocalWork(3, 2, ClientStep(0.3)),
        seed=2,
        execution=Execution(device=cuda, deterministic=True),
    )
    straight = run(data, algorithm, schedule)
    again = run(data, algorithm, schedule)
    resumed = interrupted_then_resumed(data, algorithm, schedule, tmp_path)
    reference = run(
        data,
        algorithm,
        Schedule(
            3,
            6,
            LocalWork(3, 2, ClientStep(0.3)),
            seed=2,
            execution=Execution(backend="sequential"),
        ),
    )
    for name, expected in straight.state_dict().items():
        assert expected.is_cuda
        assert torch.equal(again.state_dict()[name], expected), name
        assert torch.equal(resumed.state_dict()[name], expected), name
        torch.testing.assert_close(
            expected.cpu(), reference.state_dict()[name], rtol=1e-5, atol=1e-5
        )
