"""The device-generic round: ``execution.device``, the torch view of the training data, the
cohort's batches gathered with torch ops, and (where a GPU exists) CUDA runs against the CPU
sequential reference."""

import numpy as np
import pytest
import torch

from fedsub import config as config_lib
from fedsub import device as device_lib
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.data.ragged import Ragged
from fedsub.data.torch_ragged import TorchRagged
from fedsub.device import resolve_device
from fedsub.engine.cohort_batches import cohort_batches
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.engine.shuffle import numpy_schedules, torch_schedules
from fedsub.errors import ConfigError
from fedsub.models import sparse_lr_closed_form as closed_form
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.runs.run_setup import schedule_of
from fedsub.submodel.device_data import DeviceData
from fedsub.submodel.index import SubmodelIndex

from .test_backends import DATASETS, model_for

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def test_train_device_key_takes_cpu_and_auto_and_refuses_other_values():
    assert config_lib.load(None).execution.device == "cpu"
    config = config_lib.load(None, ['execution.device="cpu"'])
    assert schedule_of(config).execution.device == torch.device("cpu")
    auto = config_lib.load(None, ['execution.device="auto"'])
    assert schedule_of(auto).execution.device.type == ("cuda" if CUDA else "cpu")
    with pytest.raises(ConfigError, match=r"execution\.device = 'gpu' is not allowed: expected"):
        config_lib.load(None, ['execution.device="gpu"'])
    with pytest.raises(ConfigError, match=r"execution\.device = 'cuda:99' is not allowed"):
        config_lib.load(None, ['execution.device="cuda:99"'])


@pytest.mark.skipif(CUDA, reason="this machine has a GPU")
def test_a_gpu_on_a_machine_without_one_is_refused_naming_key_and_value():
    for value in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError) as error:
            config_lib.load(None, [f'execution.device="{value}"'])
        assert f"execution.device = {value!r}" in str(error.value)
        assert "no CUDA GPU" in str(error.value)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        resolve_device("cuda")


@needs_cuda
def test_masking_on_a_gpu_is_a_valid_config():
    config = config_lib.load(
        None, ['model.name="mlp"', 'masking.scheme="static"', 'execution.device="cuda"']
    )
    assert schedule_of(config).execution.device.type == "cuda"


def test_a_run_with_device_cpu_set_explicitly_is_the_default_run():
    dataset = DATASETS["two-tables-dense"]()
    index = SubmodelIndex.build(dataset)
    model = model_for(dataset)
    context = AlgorithmContext(dataset, index, "samples", 6)
    runs = {}
    for device in (None, torch.device("cpu")):
        extra = {} if device is None else {"device": device}
        execution = Execution(dtype=torch.float64, **extra)
        schedule = Schedule(3, 6, LocalWork(3, 2, ClientStep(0.3)), seed=4, execution=execution)
        runs[device] = train(model, build_algorithm("fedsubavg", context), dataset, index, schedule)
    for name, value in runs[None].state_dict().items():
        assert value.device.type == "cpu"
        assert torch.equal(runs[torch.device("cpu")].state_dict()[name], value)


def random_ragged(rng, n: int, longest: int) -> Ragged:
    lists = [rng.integers(0, 50, size=rng.integers(0, longest + 1)).tolist() for _ in range(n)]
    return Ragged.from_lists(lists)


@pytest.mark.parametrize("kernel", ["take_with_owners", "_torch_take", "_numpy_take"])
@pytest.mark.parametrize("seed", range(5))
def test_torch_ragged_take_equals_numpy_take(seed, kernel):
    rng = np.random.default_rng(seed)
    ragged = random_ragged(rng, 30, 4)  # empty lists included
    index = rng.integers(0, 30, size=45)  # any order, repeats
    expected = ragged.take(index)
    view = TorchRagged.of(ragged, torch.device("cpu"))
    got, owners = getattr(view, kernel)(torch.from_numpy(index))
    np.testing.assert_array_equal(got.numpy().values, expected.values)
    np.testing.assert_array_equal(got.numpy().offsets, expected.offsets)
    np.testing.assert_array_equal(owners.numpy(), np.repeat(np.arange(45), expected.lengths()))
    np.testing.assert_array_equal(got.owners().numpy(), owners.numpy())


@pytest.mark.parametrize("kernel", ["_torch_take", "_numpy_take"])
def test_torch_ragged_take_of_empty_lists_and_no_lists(kernel):
    view = TorchRagged.of(Ragged.from_lists([[], [3, 4], []]), torch.device("cpu"))
    for index, values, offsets in (([0, 2, 0], [], [0, 0, 0, 0]), ([], [], [0])):
        got, owners = getattr(view, kernel)(torch.tensor(index, dtype=torch.int64))
        assert got.values.tolist() == values and got.offsets.tolist() == offsets
        assert owners.tolist() == []


def numpy_cohort_batches(dataset, index, clients, seed, round_index, steps, batch):
    """The numpy data preparation the batched backend used before the round moved to torch."""
    k = len(clients)
    counts = dataset.sample_counts()[clients]
    rows = {t: index.rows[t].take(clients) for t in dataset.table_rows}
    order = numpy_schedules(
        seed, round_index, torch.from_numpy(clients), torch.from_numpy(counts), steps, batch
    ).numpy()
    visits = (order + dataset.client_offsets[clients][:, None, None]).transpose(1, 0, 2)
    visits = visits.reshape(-1)
    member_of_visit = np.tile(np.repeat(np.arange(k), batch), steps)
    ids, samples = {}, {}
    for name, ragged in dataset.train.ids.items():
        local = Ragged(index.local_ids[name], ragged.offsets).take(visits)
        table_offsets = rows[dataset.table_of(name)].offsets
        shift = np.repeat(table_offsets[:-1][member_of_visit], local.lengths())
        ids[name] = Ragged(local.values + shift, local.offsets)
        samples[name] = np.repeat(np.arange(len(local)) % (k * batch), local.lengths())
    owners = {t: np.repeat(np.arange(k), r.lengths()) for t, r in rows.items()}
    labels = dataset.train.labels[visits].reshape(steps, k, batch)
    return rows, owners, ids, samples, labels


@pytest.mark.parametrize("fast", [True, False])  # the CPU's host paths, or the GPU's kernels
@pytest.mark.parametrize("data", ["synthetic", "two-tables-dense"])
@pytest.mark.parametrize("steps,batch", [(3, 2), (7, 5)])  # (7, 5): clients cycle their data
def test_cohort_batches_equal_the_numpy_preparation(monkeypatch, fast, data, steps, batch):
    monkeypatch.setattr(device_lib, "CPU_FAST_PATHS", fast)
    dataset = DATASETS[data]()
    index = SubmodelIndex.build(dataset)
    clients = np.array([4, 0, 9, 2, 11])
    rows, owners, ids, samples, labels = numpy_cohort_batches(
        dataset, index, clients, 3, 2, steps, batch
    )
    view = DeviceData.of(dataset, index, torch.device("cpu"), torch.float64)
    assert DeviceData.of(dataset, index, torch.device("cpu"), torch.float64) is view  # once
    got = cohort_batches(view, torch.from_numpy(clients), 3, 2, steps, batch, sample_of_id=True)
    for t in rows:
        np.testing.assert_array_equal(got.rows[t].numpy().values, rows[t].values)
        np.testing.assert_array_equal(got.rows[t].numpy().offsets, rows[t].offsets)
        np.testing.assert_array_equal(got.row_owner[t].numpy(), owners[t])
    for name in ids:
        np.testing.assert_array_equal(got.ids[name].numpy().values, ids[name].values)
        np.testing.assert_array_equal(got.ids[name].numpy().offsets, ids[name].offsets)
        np.testing.assert_array_equal(got.sample_of_id[name].numpy(), samples[name])
    np.testing.assert_array_equal(got.labels.numpy(), labels.astype(np.float64))
    np.testing.assert_array_equal(got.counts.numpy(), dataset.sample_counts()[clients])
    for name in ids:  # step by step, the ids of the step's K * B samples, in order
        parts = [got.step_ids(step)[name] for step in range(steps)]
        assert all(len(o) == len(clients) * batch + 1 and o[-1] == len(v) for v, o in parts)
        values = torch.cat([v for v, _ in parts]).numpy()
        np.testing.assert_array_equal(values, ids[name].values)
        # the closed-form steps' split: each step's ids and their samples, from the reference
        per_step = len(clients) * batch
        ends = ids[name].offsets[::per_step]
        by_step, samples_by_step = got.by_step(got.ids_values()), got.samples_by_step()
        assert got.step_bounds[name] == ends.tolist() and len(by_step) == steps
        for step in range(steps):
            a, b = ends[step], ends[step + 1]
            np.testing.assert_array_equal(by_step[step][name].numpy(), ids[name].values[a:b])
            np.testing.assert_array_equal(samples_by_step[step][name].numpy(), samples[name][a:b])


@pytest.mark.parametrize("fast", [True, False])
def test_step_bounds_of_a_one_sample_step_and_of_an_empty_cohort(monkeypatch, fast):
    """One client with batches of one (a step is one sample: every offset starts a step) and
    a cohort of nobody (every step empty), on the CPU's path and the GPU's kernels."""
    monkeypatch.setattr(device_lib, "CPU_FAST_PATHS", fast)
    dataset = DATASETS["synthetic"]()
    view = DeviceData.of(dataset, SubmodelIndex.build(dataset), torch.device("cpu"), torch.float64)
    one = cohort_batches(view, torch.tensor([3]), 3, 2, 4, 1, sample_of_id=True)
    for name, ragged in one.ids.items():
        assert one.step_bounds[name] == ragged.offsets.tolist()  # 5 offsets: 4 steps
    nobody = cohort_batches(view, torch.zeros(0, dtype=torch.int64), 3, 2, 4, 1)
    assert all(bounds == [0] * 5 for bounds in nobody.step_bounds.values())
    assert nobody.step_bounds.keys() == one.step_bounds.keys()


@pytest.mark.parametrize("algorithm", ["fedsubavg", "scaffold", "fedadam", "central-sgd"])
@pytest.mark.parametrize("data", ["synthetic", "two-tables-dense"])
def test_the_device_generic_kernels_run_end_to_end_on_the_cpu(monkeypatch, algorithm, data):
    """With the CPU fast paths off, the round runs the torch kernels a GPU runs (schedules,
    takes, sparse LR's closed form, torch.unique): the same model as the fast paths and as
    the sequential reference."""
    dataset = DATASETS[data]()
    index = SubmodelIndex.build(dataset)
    model = model_for(dataset)
    context = AlgorithmContext(dataset, index, "samples", 6)
    runs = {}
    for fast in (True, False):
        monkeypatch.setattr(device_lib, "CPU_FAST_PATHS", fast)
        for backend in ("sequential", "batched"):
            schedule = Schedule(
                3,
                6,
                LocalWork(4, 3, ClientStep(0.3)),
                seed=1,
                execution=Execution(dtype=torch.float64, backend=backend),
            )
            algo = build_algorithm(algorithm, context)
            runs[fast, backend] = train(model, algo, dataset, index, schedule)
    reference = runs[True, "sequential"]
    for name, expected in reference.state_dict().items():
        assert expected.abs().max() > 1e-3
        for key in ((False, "batched"), (False, "sequential"), (True, "batched")):
            got = runs[key].state_dict()[name]
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


# --- CUDA: the same runs on a GPU against the CPU sequential reference (skipped without one)

ALGORITHMS = ["fedavg", "fedsubavg", "fedprox", "scaffold", "fedadam", "central-sgd"]


@needs_cuda
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("data", sorted(DATASETS))
@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_cuda_batched_equals_the_cpu_sequential_reference(algorithm, data, dtype, tolerance):
    dataset = DATASETS[data]()
    index = SubmodelIndex.build(dataset)
    model = model_for(dataset)
    context = AlgorithmContext(dataset, index, "samples")
    runs = {}
    for backend, device in (("sequential", "cpu"), ("batched", "cuda"), ("sequential", "cuda")):
        schedule = Schedule(
            5,
            7,
            LocalWork(4, 3, ClientStep(0.3)),
            seed=2,
            execution=Execution(dtype=dtype, backend=backend, device=torch.device(device)),
        )
        params = train(model, build_algorithm(algorithm, context), dataset, index, schedule)
        if device == "cuda":
            assert all(p.is_cuda for p in params.tensors())
        runs[backend, device] = params.to(torch.device("cpu"))
    reference = runs["sequential", "cpu"]
    for name, expected in reference.state_dict().items():
        for key in (("batched", "cuda"), ("sequential", "cuda")):
            got = runs[key].state_dict()[name]
            if dtype == torch.float64:
                torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)
            else:
                torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@needs_cuda
def test_cuda_schedules_and_closed_form_equal_the_cpu_kernels():
    rng = np.random.default_rng(1)
    clients, counts = rng.choice(10**6, size=9, replace=False), rng.integers(1, 40, size=9)
    for steps, batch in ((4, 3), (9, 7)):
        args = (torch.from_numpy(clients), torch.from_numpy(counts))
        cpu = numpy_schedules(5, 2, *args, steps, batch)
        gpu = torch_schedules(5, 2, *(a.cuda() for a in args), steps, batch)
        assert torch.equal(gpu.cpu(), cpu)
    k, batch, rows = 5, 4, 50  # random_ragged draws ids below 50
    ragged = random_ragged(rng, k * batch, 5)
    arguments = (
        {"t": torch.from_numpy(rng.normal(size=(rows, 1)))},
        {"bias": torch.from_numpy(rng.normal(size=(k, 1)))},
        {"t": torch.from_numpy(ragged.values)},
        {"t": torch.from_numpy(np.repeat(np.arange(k * batch), ragged.lengths()))},
        None,
        torch.from_numpy(rng.integers(2, size=(k, batch)).astype(np.float64)),
    )
    on_gpu = [{n: v.cuda() for n, v in a.items()} if isinstance(a, dict) else a for a in arguments]
    on_gpu[-1] = arguments[-1].cuda()
    expected = closed_form.numpy_gradients({}, 0, *arguments)
    got = SparseLogisticRegression({"t": rows}).cohort_gradients(*on_gpu)
    for g, e in zip(got, expected, strict=True):
        for name in e:
            torch.testing.assert_close(g[name].cpu(), e[name], rtol=1e-12, atol=1e-14)


@needs_cuda
def test_cuda_run_keeps_every_round_tensor_on_the_gpu():
    dataset = DATASETS["synthetic"]()
    index = SubmodelIndex.build(dataset)
    model = EmbeddingLogisticRegression(dict(dataset.table_rows), embedding_dim=4, init_std=0.3)
    context = AlgorithmContext(dataset, index, "samples", 5)
    schedule = Schedule(
        2,
        5,
        LocalWork(2, 2, ClientStep(0.1)),
        seed=0,
        execution=Execution(device=torch.device("cuda")),
    )
    view = DeviceData.of(dataset, index, schedule.execution.device, schedule.execution.dtype)
    assert view.labels.is_cuda and all(r.values.is_cuda for r in view.rows.values())
    params = train(model, build_algorithm("fedsubavg", context), dataset, index, schedule)
    assert all(p.is_cuda for p in params.tensors())
