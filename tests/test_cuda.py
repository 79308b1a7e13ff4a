"""Every model and a representative set of algorithms on a GPU equal the CPU sequential
reference (float64 1e-10; float32 1e-5 relative), masking and ``execution.deterministic`` included.

The CUDA cases skip without a GPU (run them with ``pytest tests/test_cuda.py`` on a machine
with one). Each test also has a ``cpu`` case that runs the same code with
``fedsub.device.CPU_FAST_PATHS = False`` (the GPU's torch kernels, on the CPU): it keeps the
harness honest on a machine without a GPU, and checks the device-generic kernels of every model.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from fedsub import device as device_lib
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.engine import cuda_graphs
from fedsub.engine.captured_step import compile_unavailable
from fedsub.engine.execution import Compile, CudaGraphs, Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.masking.capacity import Capacities
from fedsub.masking.schemes import Masking
from fedsub.models.base import SliceableModel
from fedsub.models.registry import build_model, model_names
from fedsub.submodel.params import Params

from .test_model_capabilities import EXPECTED
from .test_resume_matrix import OPTIONS, SMALL_WIDTHS, dataset_for, smaller

CUDA = torch.cuda.is_available()
# cuBLAS reads its workspace setting when torch creates its handle: set it at collection,
# before any test's first CUDA matmul, so deterministic runs are deterministic in cuBLAS too
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")),
]
# the state a round carries: plain averaging, heat coefficients, a proximal term, control
# variates, a row-wise adaptive server, a lazy one, server momentum, one central client
ALGORITHMS = [
    "fedavg",
    "fedsubavg",
    "fedprox",
    "scaffold",
    "fedadam",
    "fedyogi-lazy",
    "scaffold-approx",
    "central-sgd",
]
SLICEABLE = [name for name, claims in EXPECTED.items() if SliceableModel in claims]
# the ResNet is slow on the CPU at any size: one client step of two samples
STEPS = {"resnet18": (1, 2)}
# The CPU cases (the GPU's kernels on the CPU) of the models whose rounds are slow on the CPU
# (convolutions, a recurrence) run one round, float64 only, the batched backend only: their
# device-generic kernels still run once on every machine, in seconds.
SLOW_ON_THE_CPU = {"cnn", "lstm", "resnet18"}


def only_some_on_the_cpu(device: str, case: str, cpu_cases: set[str]) -> None:
    if device == "cpu" and case not in cpu_cases:
        pytest.skip("the CPU case runs a few of these (the GPU case runs every one)")


@pytest.fixture
def torch_kernels(monkeypatch):
    """The device-generic torch kernels on every device (no numpy fast path on the CPU)."""
    monkeypatch.setattr(device_lib, "CPU_FAST_PATHS", False)


def model_and_data(name: str, folder: str):
    dataset, index = dataset_for(name, folder)
    options = {**OPTIONS, "widths": SMALL_WIDTHS.get(name, [])}
    model = smaller(build_model(name, dataset, options), name)
    return model, dataset, index


def schedule_for(
    name: str, dtype: torch.dtype, rounds: int = 2, masking: Masking | None = None, **execution
) -> Schedule:
    """``execution``: the [execution] settings besides the dtype (backend, device, ...)."""
    steps, batch = STEPS.get(name, (2, 3))
    on = Execution(dtype=dtype, **execution)
    return Schedule(
        rounds, 3, LocalWork(steps, batch, ClientStep(0.1)), 5, execution=on,
        settings=() if masking is None else (masking,),
    )  # fmt: skip


def run(model, algorithm: str, dataset, index, schedule: Schedule) -> Params:
    built = build_algorithm(algorithm, AlgorithmContext(dataset, index, "samples", 3))
    params = train(model, built, dataset, index, schedule)
    assert all(p.device.type == schedule.execution.device.type for p in params.tensors())
    return params.to(torch.device("cpu"))


def assert_matches(got: Params, reference: Params, dtype: torch.dtype, where: str) -> None:
    moved = False
    for name, expected in reference.state_dict().items():
        value = got.state_dict()[name]
        if dtype == torch.float64:
            torch.testing.assert_close(value, expected, rtol=0, atol=1e-10, msg=f"{where} {name}")
        else:
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5, msg=f"{where} {name}")
        moved |= bool((expected != 0).any())
    assert moved, where  # the model trained, so equality says something


def compare_on(
    device: str,
    name: str,
    algorithm: str,
    dtype,
    folder: str,
    backends: tuple[str, ...] = ("batched", "sequential"),
    **changes,
) -> None:
    """The ``backends`` on ``device`` against the CPU sequential run."""
    model, dataset, index = model_and_data(name, folder)
    reference = run(
        model, algorithm, dataset, index, schedule_for(name, dtype, backend="sequential", **changes)
    )
    for backend in backends:
        on_device = schedule_for(
            name, dtype, backend=backend, device=torch.device(device), **changes
        )
        got = run(model, algorithm, dataset, index, on_device)
        assert_matches(got, reference, dtype, f"{name} {algorithm} {backend} on {device}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", model_names())
def test_every_model_on_the_device_equals_the_cpu_reference(
    torch_kernels, tmp_path_factory, name, device
):
    folder = str(tmp_path_factory.getbasetemp())
    if device == "cpu" and name in SLOW_ON_THE_CPU:
        compare_on(device, name, "fedsubavg", torch.float64, folder, ("batched",), rounds=1)
        return
    for dtype in (torch.float64, torch.float32):
        compare_on(device, name, "fedsubavg", dtype, folder)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("name", ["embedding-lr", "din", "softmax-regression"])
def test_every_algorithm_on_the_device_equals_the_cpu_reference(
    torch_kernels, tmp_path_factory, name, algorithm, device
):
    only_some_on_the_cpu(device, name, {"embedding-lr"})
    compare_on(device, name, algorithm, torch.float64, str(tmp_path_factory.getbasetemp()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", ["static", "rolling", "shuffled", "random", "bernoulli"])
@pytest.mark.parametrize("name", SLICEABLE)
def test_every_masking_scheme_on_the_device_equals_the_cpu_reference(
    torch_kernels, tmp_path_factory, name, scheme, device
):
    only_some_on_the_cpu(device, f"{name} {scheme}", {"mlp static", "mlp bernoulli"})
    masking = Masking(scheme, Capacities((1.0, 0.5), (), "per-round"))
    folder = str(tmp_path_factory.getbasetemp())
    compare_on(device, name, "fedavg", torch.float64, folder, masking=masking)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["embedding-lr", "sparse-lr", "din", "lstm", "cnn", "mlp"])
def test_a_deterministic_run_on_the_device_repeats_bit_for_bit(
    torch_kernels, tmp_path_factory, name, device
):
    """Every model's round under torch.use_deterministic_algorithms (no op of the round
    refuses it) repeats bit for bit, and equals the CPU reference."""
    only_some_on_the_cpu(device, name, {"embedding-lr", "sparse-lr", "mlp"})
    model, dataset, index = model_and_data(name, str(tmp_path_factory.getbasetemp()))
    schedule = schedule_for(name, torch.float64, device=torch.device(device), deterministic=True)
    first = run(model, "fedsubavg", dataset, index, schedule)
    second = run(model, "fedsubavg", dataset, index, schedule)
    for key, value in first.state_dict().items():
        assert torch.equal(second.state_dict()[key], value), key
    reference = schedule_for(name, torch.float64, backend="sequential")
    assert_matches(first, run(model, "fedsubavg", dataset, index, reference), torch.float64, name)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.skipif(compile_unavailable() is not None, reason=str(compile_unavailable()))
@pytest.mark.parametrize("algorithm", ["fedsubavg", "scaffold"])
@pytest.mark.parametrize("name", ["embedding-lr", "softmax-regression", "mlp", "cnn"])
def test_the_local_step_captured_in_cuda_graphs_equals_the_cpu_reference(
    tmp_path_factory, name, algorithm
):
    """``execution.compile = "on"`` on CUDA: inductor with ``mode="reduce-overhead"`` replays the
    captured local step as CUDA graphs (none skipped), over rounds whose shapes change, and
    gives the CPU sequential reference's model."""
    from torch._dynamo.utils import counters

    model, dataset, index = model_and_data(name, str(tmp_path_factory.getbasetemp()))
    cuda = torch.device("cuda")
    counters.clear()
    for dtype in (torch.float64, torch.float32):
        reference = schedule_for(name, dtype, backend="sequential")
        captured = schedule_for(name, dtype, device=cuda, compile=Compile.for_device(cuda))
        got = run(model, algorithm, dataset, index, dataclasses.replace(captured, rounds=4))
        expected = run(model, algorithm, dataset, index, dataclasses.replace(reference, rounds=4))
        assert_matches(got, expected, dtype, f"{name} {algorithm} captured on cuda")
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("algorithm", ["fedsubavg", "scaffold", "fedprox"])
@pytest.mark.parametrize("name", ["embedding-lr", "softmax-regression", "mlp", "cnn", "din"])
def test_rounds_replayed_as_cuda_graphs_equal_the_cpu_reference(tmp_path_factory, name, algorithm):
    """``execution.compile = "cuda-graphs"``: the rounds recorded with torch.cuda.graph (no
    compiler, any torch) and replayed, over rounds whose shapes change, give the CPU
    sequential reference's model; every round replayed a recording (none ran eagerly)."""
    model, dataset, index = model_and_data(name, str(tmp_path_factory.getbasetemp()))
    cuda = torch.device("cuda")
    for dtype in (torch.float64, torch.float32):
        cuda_graphs._ROUNDS.clear()
        reference = schedule_for(name, dtype, backend="sequential")
        graphed = schedule_for(name, dtype, device=cuda, compile=CudaGraphs())
        got = run(model, algorithm, dataset, index, dataclasses.replace(graphed, rounds=5))
        expected = run(model, algorithm, dataset, index, dataclasses.replace(reference, rounds=5))
        assert_matches(got, expected, dtype, f"{name} {algorithm} cuda graphs")
        assert cuda_graphs._ROUNDS
