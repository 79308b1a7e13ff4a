"""The batched backend gives the sequential reference's global model, algorithm by algorithm."""

import numpy as np
import pytest
import torch

from fedsub.algorithms.registry import AlgorithmContext, algorithm_names, build_algorithm
from fedsub.data.federated import SampleSet
from fedsub.data.ragged import Ragged
from fedsub.data.synthetic_li import SyntheticLiOptions
from fedsub.data.synthetic_li import generate as generate_li
from fedsub.data.synthetic_sparse import SyntheticSparseOptions, generate
from fedsub.engine.loop import train
from fedsub.engine.schedule import Schedule
from fedsub.models import sparse_lr_closed_form as closed_form
from fedsub.models.base import CohortHead
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.models.softmax_regression import SoftmaxRegression
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.submodel.index import SubmodelIndex

from .conftest import TEST_DEVICE, make_dataset


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
    from fedsub.data.federated import FederatedDataset

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


@pytest.mark.parametrize("algorithm", algorithm_names())
@pytest.mark.parametrize("data", sorted(DATASETS))
@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_batched_equals_sequential(algorithm, data, dtype, tolerance):
    dataset = DATASETS[data]()
    index = SubmodelIndex.build(dataset)
    model = model_for(dataset)
    context = AlgorithmContext(dataset, index, "samples")
    results = {}
    for backend in ("sequential", "batched"):
        schedule = Schedule(
            5,
            7,
            local_steps=4,
            batch_size=3,
            lr=0.3,
            seed=2,
            dtype=dtype,
            backend=backend,
            device=TEST_DEVICE,
        )
        results[backend] = train(
            model, build_algorithm(algorithm, context), dataset, index, schedule
        )
    for name, reference in results["sequential"].state_dict().items():
        got = results["batched"].state_dict()[name]
        assert reference.abs().max() > 1e-3  # the model did move from its zero init
        if dtype == torch.float64:
            torch.testing.assert_close(got, reference, rtol=0, atol=tolerance)
        else:
            torch.testing.assert_close(got, reference, rtol=tolerance, atol=tolerance)


def test_batched_handles_clients_with_fewer_samples_than_a_batch():
    dataset = make_dataset([[[0]], [[1, 2], [2]], [[0, 3]] * 9], table_rows=4)
    index = SubmodelIndex.build(dataset)
    model = SparseLogisticRegression(dict(dataset.table_rows))
    context = AlgorithmContext(dataset, index, "clients")
    out = {}
    for backend in ("sequential", "batched"):
        schedule = Schedule(
            3,
            3,
            local_steps=5,
            batch_size=4,
            lr=0.5,
            seed=0,
            dtype=torch.float64,
            backend=backend,
            device=TEST_DEVICE,
        )
        out[backend] = train(model, build_algorithm("fedsubavg", context), dataset, index, schedule)
    torch.testing.assert_close(
        out["batched"].tables["t"], out["sequential"].tables["t"], rtol=0, atol=1e-12
    )


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


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_batched_equals_sequential_for_rule_and_scheme_variants(variant):
    from fedsub.algorithms.registry import options_class

    name, schedule_extra, options = VARIANTS[variant]
    dataset = DATASETS["two-tables-dense"]()
    index = SubmodelIndex.build(dataset)
    model = SparseLogisticRegression(dict(dataset.table_rows), dense_dim=dataset.train.dense_dim)
    context = AlgorithmContext(dataset, index, "samples", 12)
    base = name.split("@")[0]
    algorithm = build_algorithm(name, context, options_class(base)(**options))
    results = {}
    for backend in ("sequential", "batched"):
        schedule = Schedule(
            4,
            12,
            local_steps=3,
            batch_size=4,
            lr=0.3,
            seed=5,
            dtype=torch.float64,
            backend=backend,
            device=TEST_DEVICE,
            **schedule_extra,
        )
        results[backend] = train(model, algorithm, dataset, index, schedule)
    for name_, reference in results["sequential"].state_dict().items():
        torch.testing.assert_close(
            results["batched"].state_dict()[name_], reference, rtol=0, atol=1e-10
        )


@pytest.mark.parametrize("data", sorted(DATASETS))
def test_each_cohort_head_equals_the_vmapped_head(data):
    from torch.func import vmap

    dataset = DATASETS[data]()
    model = model_for(dataset)
    params = model.init(torch.Generator().manual_seed(0), torch.float64)
    k, b = 3, 4
    generator = torch.Generator().manual_seed(1)
    dense = {
        n: torch.randn(k, *p.shape, generator=generator, dtype=torch.float64)
        for n, p in params.dense.items()
    }
    width = {"bags": len(dataset.table_rows), "pooled": 4 * len(dataset.table_rows)}
    features = {
        name: torch.randn(k, b, size, generator=generator, dtype=torch.float64)
        for name, size in width.items()
        if name
        in model.embed(
            params.tables,
            {
                t: (torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long))
                for t in dataset.table_rows
            },
        )
    }
    inputs = None
    if dataset.train.dense_dim:
        inputs = torch.randn(
            k, b, dataset.train.dense_dim, generator=generator, dtype=torch.float64
        )
    expected = vmap(model.head, in_dims=(0, 0, None if inputs is None else 0))(
        dense, features, inputs
    )
    torch.testing.assert_close(model.cohort_head(dense, features, inputs), expected)


def test_models_without_a_cohort_head_are_vmapped_and_agree():
    from .conftest import SquaredDistance

    rng = np.random.default_rng(0)
    parts = [
        SampleSet(
            {"w": Ragged.from_lists([rng.choice(3, size=2).tolist() for _ in range(5)])},
            rng.normal(size=5).astype(np.float32),
        )
        for _ in range(6)
    ]
    from fedsub.data.federated import FederatedDataset

    dataset = FederatedDataset.from_clients("quadratic", {"w": 3}, parts, parts[0])
    index = SubmodelIndex.build(dataset)
    model = SquaredDistance(rows=3, w0=1.0)
    assert not isinstance(model, CohortHead)
    context = AlgorithmContext(dataset, index, "clients", 4)
    out = {}
    for backend in ("sequential", "batched"):
        schedule = Schedule(
            4, 4, 3, 2, 0.1, seed=0, dtype=torch.float64, backend=backend, device=TEST_DEVICE
        )
        out[backend] = train(
            model, build_algorithm("fedsubavg", context), dataset, index, schedule
        ).tables["w"]
    torch.testing.assert_close(out["batched"], out["sequential"], rtol=0, atol=1e-12)


def shared_table_dataset(seed: int = 0):
    """Two fields, 'target' and 'history' (ragged, may be empty), reading one 'item' table."""
    from fedsub.data.federated import FederatedDataset

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


def test_fields_sharing_a_table_form_one_submodel_and_backends_agree():
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
    model = EmbeddingLogisticRegression(
        {"item": 25},
        embedding_dim=3,
        init_std=0.3,
        fields=("target", "history"),
        field_tables={"target": "item", "history": "item"},
    )
    context = AlgorithmContext(dataset, index, "samples", 5)
    out = {}
    for backend in ("sequential", "batched"):
        schedule = Schedule(
            4, 5, 3, 3, 0.3, seed=1, dtype=torch.float64, backend=backend, device=TEST_DEVICE
        )
        out[backend] = train(model, build_algorithm("fedsubavg", context), dataset, index, schedule)
    for name, value in out["sequential"].state_dict().items():
        torch.testing.assert_close(out["batched"].state_dict()[name], value, rtol=0, atol=1e-10)


def test_a_model_that_cannot_be_batched_runs_sequentially_and_says_so(caplog):
    from dataclasses import dataclass

    from .conftest import SquaredDistance

    @dataclass(frozen=True)
    class Unbatchable(SquaredDistance):
        batchable: bool = False

    dataset = make_dataset([[[0, 1]], [[1]], [[1, 2]]], table_rows=3, table="w")
    index = SubmodelIndex.build(dataset)
    model = Unbatchable(rows=3, w0=1.0)
    context = AlgorithmContext(dataset, index, "clients", 3)
    out = {}
    for backend in ("sequential", "batched"):
        schedule = Schedule(
            2, 3, 1, 1, 0.1, seed=0, dtype=torch.float64, backend=backend, device=TEST_DEVICE
        )
        with caplog.at_level("WARNING", logger="fedsub"):
            out[backend] = train(
                model, build_algorithm("fedavg", context), dataset, index, schedule
            )
    assert "model Unbatchable cannot be batched; running the sequential backend" in caplog.text
    assert torch.equal(out["batched"].tables["w"], out["sequential"].tables["w"])


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
