"""Backend conformance: every backend in the registry (engine/backends.py) gives the sequential
reference's global model, algorithm by algorithm, for rule and scheme variants, models with and
without a cohort head, fields sharing a table and models that cannot be batched. A new backend
is tested here by registering it; the comparison itself is tests/equivalence.py's."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from fedsub.algorithms.registry import (
    AlgorithmContext,
    algorithm_names,
    build_algorithm,
    options_class,
)
from fedsub.config import parse
from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged
from fedsub.data.synthetic_li import SyntheticLiOptions
from fedsub.data.synthetic_li import generate as generate_li
from fedsub.data.synthetic_sparse import SyntheticSparseOptions, generate
from fedsub.engine import backends, sequential
from fedsub.engine.backends import REFERENCE, Backend, backend_names, get_backend
from fedsub.engine.cohort_job import CohortJob, composed
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.errors import ConfigError
from fedsub.models import sparse_lr_closed_form as closed_form
from fedsub.models.base import CohortHead
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.models.softmax_regression import SoftmaxRegression
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.transfer import CohortUpdate

from .conftest import SquaredDistance, make_dataset
from .equivalence import CHECKED_BACKENDS, algorithm_for, assert_backends_match_reference


def two_tables_with_dense(seed: int):
    """Ragged multi-hot ids (empty lists included) in two tables, plus dense features."""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(15):
        n = int(rng.integers(1, 12))
        a = [rng.choice(40, size=rng.integers(0, 4), replace=False).tolist() for _ in range(n)]
        b = [rng.choice(9, size=rng.integers(1, 3), replace=False).tolist() for _ in range(n)]
        parts.append(
            SampleSet(
                {"a": Ragged.from_lists(a), "b": Ragged.from_lists(b)},
                rng.integers(2, size=n).astype(np.float32),
                rng.normal(size=(n, 3)).astype(np.float32),
            )
        )
    return FederatedDataset.from_clients("two-tables", {"a": 40, "b": 9}, parts, parts[0])


DATASETS = {
    "synthetic": lambda: generate(
        SyntheticSparseOptions(num_users=50, num_items=30, mean_samples_per_user=9), seed=1
    ),
    "two-tables-dense": lambda: two_tables_with_dense(0),
    "dense-only-multiclass": lambda: generate_li(SyntheticLiOptions(num_devices=12, dim=5), 0),
}


def model_for(dataset):
    if not dataset.table_rows:
        return SoftmaxRegression(dataset.train.dense_dim, 10)
    if dataset.name == "two-tables":
        return SparseLogisticRegression(dict(dataset.table_rows), dense_dim=dataset.train.dense_dim)
    return EmbeddingLogisticRegression(dict(dataset.table_rows), embedding_dim=4, init_std=0.3)


def setup(data: str):
    """One of ``DATASETS``, its index and its model."""
    dataset = DATASETS[data]()
    return dataset, SubmodelIndex.build(dataset), model_for(dataset)


def run(data: str, algorithm: str, schedule: Schedule, control=None, on_round=None):
    """A whole run of ``algorithm`` (sample-weighted heat, 6 clients per round) on ``data``."""
    dataset, index, model = setup(data)
    algo = build_algorithm(algorithm, AlgorithmContext(dataset, index, "samples", 6))
    return train(model, algo, dataset, index, schedule, on_round=on_round, control=control)


@pytest.mark.parametrize("backend", CHECKED_BACKENDS)
@pytest.mark.parametrize("algorithm", algorithm_names())
@pytest.mark.parametrize("data", sorted(DATASETS))
@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_every_backend_equals_the_reference(backend, algorithm, data, dtype, tolerance):
    dataset = DATASETS[data]()
    index = SubmodelIndex.build(dataset)
    schedule = Schedule(
        5, 7, local=LocalWork(4, 3, ClientStep(lr=0.3)), seed=2, execution=Execution(dtype=dtype)
    )
    results = assert_backends_match_reference(
        model_for(dataset),
        algorithm_for(algorithm, dataset, index),
        dataset,
        index,
        schedule,
        [backend],
        rtol=0 if dtype == torch.float64 else tolerance,
        atol=tolerance,
    )
    for reference in results[REFERENCE].state_dict().values():
        assert reference.abs().max() > 1e-3  # every tensor moved from its zero init


@pytest.mark.parametrize("backend", CHECKED_BACKENDS)
def test_clients_with_fewer_samples_than_a_batch(backend):
    dataset = make_dataset([[[0]], [[1, 2], [2]], [[0, 3]] * 9], table_rows=4)
    index = SubmodelIndex.build(dataset)
    assert_backends_match_reference(
        SparseLogisticRegression(dict(dataset.table_rows)),
        algorithm_for("fedsubavg", dataset, index, heat="clients"),
        dataset,
        index,
        Schedule(
            3,
            3,
            local=LocalWork(5, 4, ClientStep(lr=0.5)),
            seed=0,
            execution=Execution(dtype=torch.float64),
        ),
        [backend],
        atol=1e-12,
    )


BATCHING = [name for name in CHECKED_BACKENDS if get_backend(name).needs_batchable]
VARIANTS = {
    "fedprox-mu": ("fedprox", {}, {"mu": 0.5}),
    "clip-decay-exp-lr": (
        "fedsubavg",
        {"clip_norm": 0.05, "weight_decay": 0.01, "lr_schedule": "exponential", "lr_decay": 0.9},
        {},
    ),
    "scheme1-repeated-draws": ("fedavg@scheme1", {}, {}),
    "transformed-scheme2": ("fedsubavg@transformed-scheme2", {}, {}),
    "scaffold-inverse-lr": ("scaffold", {"lr_schedule": "inverse-round"}, {}),
    "central-sgd": ("central-sgd", {}, {}),
}


@pytest.mark.parametrize("backend", CHECKED_BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rule_and_scheme_variants(backend, variant):
    name, step_extra, options = VARIANTS[variant]
    dataset = DATASETS["two-tables-dense"]()
    index = SubmodelIndex.build(dataset)
    model = SparseLogisticRegression(dict(dataset.table_rows), dense_dim=dataset.train.dense_dim)
    algorithm = algorithm_for(
        name, dataset, index, 12, options=options_class(name.split("@")[0])(**options)
    )
    schedule = Schedule(
        4,
        12,
        local=LocalWork(3, 4, ClientStep(lr=0.3, **step_extra)),
        seed=5,
        execution=Execution(dtype=torch.float64),
    )
    assert_backends_match_reference(model, algorithm, dataset, index, schedule, [backend])


def quadratic_dataset():
    """Six clients whose samples each read two rows of a 3-row table 'w'."""
    rng = np.random.default_rng(0)
    parts = [
        SampleSet(
            {"w": Ragged.from_lists([rng.choice(3, size=2).tolist() for _ in range(5)])},
            rng.normal(size=5).astype(np.float32),
        )
        for _ in range(6)
    ]
    return FederatedDataset.from_clients("quadratic", {"w": 3}, parts, parts[0])


@pytest.mark.parametrize("backend", CHECKED_BACKENDS)
def test_models_without_a_cohort_head_are_vmapped_and_agree(backend):
    dataset = quadratic_dataset()
    index = SubmodelIndex.build(dataset)
    model = SquaredDistance(rows=3, w0=1.0)
    assert not isinstance(model, CohortHead)
    assert_backends_match_reference(
        model,
        algorithm_for("fedsubavg", dataset, index, 4, heat="clients"),
        dataset,
        index,
        Schedule(
            4, 4, LocalWork(3, 2, ClientStep(0.1)), seed=0, execution=Execution(dtype=torch.float64)
        ),
        [backend],
        atol=1e-12,
    )


def shared_table_dataset(seed: int = 0):
    """Two fields, 'target' and 'history' (ragged, may be empty), reading one 'item' table."""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(10):
        n = int(rng.integers(1, 9))
        target = [[int(rng.integers(25))] for _ in range(n)]
        history = [
            rng.choice(25, size=rng.integers(0, 5), replace=False).tolist() for _ in range(n)
        ]
        parts.append(
            SampleSet(
                {"target": Ragged.from_lists(target), "history": Ragged.from_lists(history)},
                rng.integers(2, size=n).astype(np.float32),
            )
        )
    return FederatedDataset.from_clients(
        "shared", {"item": 25}, parts, parts[0], {"target": "item", "history": "item"}
    )


def test_fields_sharing_a_table_form_one_submodel():
    dataset = shared_table_dataset()
    index = SubmodelIndex.build(dataset)
    for k in range(dataset.num_clients):
        client = dataset.client(k)
        union = np.unique(
            np.concatenate([client.ids["target"].values, client.ids["history"].values])
        )
        np.testing.assert_array_equal(index.client_rows("item", k), union)
        local = index.client_samples(dataset, k)
        for name in ("target", "history"):
            np.testing.assert_array_equal(union[local.ids[name].values], client.ids[name].values)


@pytest.mark.parametrize("backend", CHECKED_BACKENDS)
def test_fields_sharing_a_table_train_alike_on_every_backend(backend):
    dataset = shared_table_dataset()
    index = SubmodelIndex.build(dataset)
    model = EmbeddingLogisticRegression(
        {"item": 25},
        embedding_dim=3,
        init_std=0.3,
        fields=("target", "history"),
        field_tables={"target": "item", "history": "item"},
    )
    assert_backends_match_reference(
        model,
        algorithm_for("fedsubavg", dataset, index, 5),
        dataset,
        index,
        Schedule(
            4, 5, LocalWork(3, 3, ClientStep(0.3)), seed=1, execution=Execution(dtype=torch.float64)
        ),
        [backend],
    )


@pytest.mark.parametrize("backend", BATCHING)
def test_a_model_that_cannot_be_batched_runs_sequentially_and_says_so(backend, caplog):
    @dataclass(frozen=True)
    class Unbatchable(SquaredDistance):
        batchable: bool = False

    dataset = make_dataset([[[0, 1]], [[1]], [[1, 2]]], table_rows=3, table="w")
    index = SubmodelIndex.build(dataset)
    with caplog.at_level("WARNING", logger="fedsub"):
        assert_backends_match_reference(
            Unbatchable(rows=3, w0=0.5),  # w0 = 1 with labels 1 would not move
            algorithm_for("fedavg", dataset, index, 3, heat="clients"),
            dataset,
            index,
            Schedule(
                2,
                3,
                LocalWork(1, 1, ClientStep(0.1)),
                seed=0,
                execution=Execution(dtype=torch.float64),
            ),
            [backend],
            atol=0,
        )
    assert "model Unbatchable cannot be batched; running the sequential backend" in caplog.text


def reversed_members(job: CohortJob):
    """A toy backend: the members' work in reverse order (results in cohort order)."""
    members = list(enumerate(job.cohort.clients))[::-1]
    shared = (job.model, job.params, job.dataset, job.index)
    updates = [
        sequential.client_round(*shared, int(k), job.round, job.schedule, job.work, j)
        for j, k in members
    ]
    return CohortUpdate.from_clients(updates[::-1], torch.from_numpy(job.cohort.multiplicity))


def test_a_new_backend_is_one_registration(monkeypatch):
    """Registered, a backend is accepted by execution.backend, run by the loop and checked here."""
    assert REFERENCE in backend_names() and set(CHECKED_BACKENDS) < set(backend_names())
    calls = []

    def counted(job: CohortJob):
        calls.append(job.round)
        return reversed_members(job)

    toy = Backend("reversed", counted, False, "members in reverse order")
    monkeypatch.setitem(backends._REGISTRY, toy.name, toy)
    assert parse({"execution": {"backend": "reversed"}}).execution.backend == "reversed"
    dataset = DATASETS["two-tables-dense"]()
    index = SubmodelIndex.build(dataset)
    assert_backends_match_reference(
        SparseLogisticRegression(dict(dataset.table_rows), dense_dim=dataset.train.dense_dim),
        algorithm_for("scaffold", dataset, index, 5),
        dataset,
        index,
        Schedule(
            3,
            5,
            local=LocalWork(2, 3, ClientStep(lr=0.3)),
            seed=0,
            execution=Execution(dtype=torch.float64),
        ),
        ["reversed"],
    )
    assert calls == [1, 2, 3]  # the loop ran the registered backend, once a round


def test_an_unknown_backend_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match=r"execution\.backend") as error:
        parse({"train": {"backend": "gpu"}})
    assert all(name in str(error.value) for name in backend_names())


@pytest.mark.parametrize("kernel", ["cohort_gradients", "torch", "numpy"])
def test_sparse_lr_closed_form_gradients_equal_autograd(kernel):
    """``cohort_gradients`` (and each of its two kernels) against autograd through embed,
    cohort_head and the loss, with two fields sharing a table, an empty id list and dense
    inputs (float64)."""
    rng = np.random.default_rng(3)
    k, batch = 4, 3
    model = SparseLogisticRegression(
        {"items": 30}, dense_dim=2, field_tables={"item": "items", "history": "items"}
    )
    tables = {"items": torch.from_numpy(rng.normal(size=(30, 1)))}
    dense = {
        "bias": torch.from_numpy(rng.normal(size=(k, 1))),
        "dense_weight": torch.from_numpy(rng.normal(size=(k, 2))),
    }
    ids, samples = {}, {}
    for name, longest in (("item", 1), ("history", 4)):
        lists = [
            rng.choice(30, size=rng.integers(0, longest + 1)).tolist() for _ in range(k * batch)
        ]
        lists[0] = [] if name == "history" else [5]
        ragged = Ragged.from_lists(lists)
        ids[name] = (torch.from_numpy(ragged.values), torch.from_numpy(ragged.offsets))
        samples[name] = torch.from_numpy(np.repeat(np.arange(k * batch), ragged.lengths()))
    inputs = torch.from_numpy(rng.normal(size=(k, batch, 2)))
    labels = torch.from_numpy(rng.integers(2, size=(k, batch)).astype(np.float64))

    values = {n: v for n, (v, _) in ids.items()}
    arguments = (tables, dense, values, samples, inputs, labels)
    if kernel == "cohort_gradients":
        table_grads, dense_grads = model.cohort_gradients(*arguments)
    else:
        chosen = closed_form.torch_gradients if kernel == "torch" else closed_form.numpy_gradients
        table_grads, dense_grads = chosen(model.field_tables, model.dense_dim, *arguments)

    leaves = {**tables, **dense}
    leaves = {n: v.clone().requires_grad_(True) for n, v in leaves.items()}
    bags = model.embed({"items": leaves["items"]}, ids)["bags"].reshape(k, batch, -1)
    outputs = model.cohort_head({n: leaves[n] for n in dense}, {"bags": bags}, inputs)
    total = model.loss(outputs.reshape(-1), labels.reshape(-1)) * k  # sum of the K means
    total.backward()
    expected = {**table_grads, **dense_grads}
    assert expected["items"].abs().max() > 0
    for name, leaf in leaves.items():
        torch.testing.assert_close(expected[name], leaf.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_lr_closed_form_kernels_agree(dtype):
    """The CPU (numpy) and device-generic (torch) kernels agree to float64 rounding (the same
    sums in the same order; tanh and einsum may differ in the last float64 bit)."""
    rng = np.random.default_rng(11)
    k, batch, rows = 6, 4, 50
    lists = [rng.choice(rows, size=rng.integers(0, 6)).tolist() for _ in range(k * batch)]
    ragged = Ragged.from_lists(lists)
    arguments = (
        {"t": torch.from_numpy(rng.normal(size=(rows, 1))).to(dtype)},
        {
            "bias": torch.from_numpy(rng.normal(size=(k, 1))).to(dtype),
            "dense_weight": torch.from_numpy(rng.normal(size=(k, 3))).to(dtype),
        },
        {"t": torch.from_numpy(ragged.values)},
        {"t": torch.from_numpy(np.repeat(np.arange(k * batch), ragged.lengths()))},
        torch.from_numpy(rng.normal(size=(k, batch, 3))).to(dtype),
        torch.from_numpy(rng.integers(2, size=(k, batch))).to(dtype),
    )
    by_torch = closed_form.torch_gradients({}, 3, *arguments)
    by_numpy = closed_form.numpy_gradients({}, 3, *arguments)
    for got, expected in zip(by_torch, by_numpy, strict=True):
        assert got.keys() == expected.keys()
        for name in got:
            assert got[name].dtype == expected[name].dtype == dtype
            torch.testing.assert_close(got[name], expected[name], rtol=1e-13, atol=1e-15)


def test_stages_wrap_the_backend_innermost_first_and_skip_the_unused():
    """``composed``: the first stage listed sits next to the backend, the last one is what the
    loop calls (split across processes must run inside width slices: each slice group is
    split, engine/split_cohort.py); a stage given as None is not used."""
    entered = []

    def stage(name):
        def wrap(inner):
            def run(job):
                entered.append(name)
                return [*inner(job), name]

            return run

        return wrap

    run = composed(lambda job: [job], [stage("split"), None, stage("slices"), stage("host")])
    assert run("job") == ["job", "split", "slices", "host"]
    assert entered == ["host", "slices", "split"]
