"""IDX files, partitioners (hypothesis properties) and the MNIST-family loader."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsub.data import partition
from fedsub.data.idx import read_idx
from fedsub.data.images import FILES, ImageOptions, load
from fedsub.errors import DataError

from .conftest import assert_backends_agree, assert_one_step_lowers_loss


def idx_bytes(array: np.ndarray) -> bytes:
    code = {np.uint8: 0x08, np.int32: 0x0C, np.float32: 0x0D}[array.dtype.type]
    header = bytes([0, 0, code, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_image_set(folder: Path, n_train: int = 400, n_test: int = 50, gz: bool = True) -> Path:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train_images": rng.integers(0, 256, size=(n_train, 28, 28), dtype=np.uint8),
        "train_labels": (np.arange(n_train) % 10).astype(np.uint8),
        "test_images": rng.integers(0, 256, size=(n_test, 28, 28), dtype=np.uint8),
        "test_labels": (np.arange(n_test) % 10).astype(np.uint8),
    }
    for key, stem in FILES.items():
        data = idx_bytes(arrays[key])
        if gz:
            (folder / f"{stem}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / stem).write_bytes(data)
    return folder


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float32])
@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(tmp_path, dtype, gz):
    array = (np.arange(24).reshape(2, 3, 4) * 3).astype(dtype)
    data = idx_bytes(array)
    path = tmp_path / "a.idx"
    path.write_bytes(gzip.compress(data) if gz else data)
    np.testing.assert_array_equal(read_idx(path), array)


def test_idx_errors_name_the_file_and_what_was_expected(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x08\x01rest")
    with pytest.raises(DataError, match=r"bad: not an IDX file \(expected 00 00"):
        read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(idx_bytes(np.zeros((3, 2), np.uint8))[:-1])
    with pytest.raises(
        DataError,
        match=r"short: IDX header says shape \(3, 2\) \(18 bytes\) "
        r"but the file has 17 bytes",
    ):
        read_idx(short)


labels_strategy = st.lists(st.integers(0, 9), min_size=40, max_size=300).map(np.array)


@settings(max_examples=60, deadline=None)
@given(
    labels=labels_strategy,
    clients=st.integers(1, 8),
    seed=st.integers(0, 10**6),
    scheme=st.sampled_from(["iid", "dirichlet", "shards", "k_labels", "power_law"]),
    k=st.integers(1, 3),
)
def test_partitions_are_disjoint_covering_and_reproducible(labels, clients, seed, scheme, k):
    def run(s):
        rng = np.random.default_rng(s)
        if scheme == "iid":
            return partition.iid(len(labels), clients, rng)
        if scheme == "dirichlet":
            return partition.dirichlet(labels, clients, 1.0, rng)
        if scheme == "shards":
            return partition.shards(labels, clients, k, rng)
        if scheme == "k_labels":
            return partition.k_labels(labels, clients, min(k, len(np.unique(labels))), rng)
        return partition.power_law(len(labels), clients, 1.5, rng)

    try:
        parts = run(seed)
    except Exception as error:  # only our documented error, for impossible requests
        assert isinstance(error, DataError) and str(error)
        return
    everything = np.concatenate(parts)
    assert len(everything) == len(labels) == len(np.unique(everything))  # disjoint, covering
    assert all(len(p) for p in parts)
    again = run(seed)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    if scheme == "k_labels":
        wanted = min(k, len(np.unique(labels)))
        assert all(len(np.unique(labels[p])) == wanted for p in parts)


def test_k_labels_gives_exactly_k_labels_when_every_label_is_dealt():
    labels = np.repeat(np.arange(10), 60)
    parts = partition.k_labels(labels, 20, 2, np.random.default_rng(1))
    assert all(len(np.unique(labels[p])) == 2 for p in parts)


def test_natural_groups_by_id():
    ids = np.array([5, 3, 5, 9, 3, 5])
    parts = partition.natural(ids)
    assert [p.tolist() for p in parts] == [[1, 4], [0, 2, 5], [3]]


@pytest.mark.parametrize("gz", [False, True])
def test_loader_li_balanced_and_dirichlet(tmp_path, gz):
    folder = write_image_set(tmp_path / "idx", gz=gz)
    balanced = load("mnist", ImageOptions(num_clients=10, samples_per_client=20), str(folder), 0)
    assert balanced.num_clients == 10 and set(balanced.sample_counts()) == {20}
    for k in range(10):
        assert len(np.unique(balanced.client(k).labels)) == 2
    assert balanced.train.dense.shape[1] == 784 and balanced.train.dense.max() <= 1.0
    assert len(balanced.test) == 50
    spread = load("mnist", ImageOptions(partition="dirichlet", num_clients=5), str(folder), 0)
    assert spread.sample_counts().sum() == 400


def test_missing_files_say_what_layout_is_expected(tmp_path):
    with pytest.raises(DataError, match=r"no IDX files in .*train-images-idx3-ubyte"):
        load("mnist", ImageOptions(), str(tmp_path), 0)


def test_small_cnn_learns_and_both_backends_agree(tmp_path):
    import torch

    from fedsub.models.base import Batch, forward
    from fedsub.models.cnn import SmallCNN
    from fedsub.submodel.index import SubmodelIndex

    folder = write_image_set(tmp_path / "idx", n_train=120, n_test=20)
    dataset = load("mnist", ImageOptions(partition="iid", num_clients=4), str(folder), 0)
    model = SmallCNN(channels=(4, 6))
    params = model.init(torch.Generator().manual_seed(0), torch.float64)
    batch = Batch.from_samples(dataset.train.take(np.arange(16)), torch.float64)
    assert forward(model, params, batch).shape == (16, 10)
    assert_one_step_lowers_loss(model, params, batch, lr=0.05)
    index = SubmodelIndex.build(dataset)
    assert_backends_agree(model, dataset, index, "fedprox", 3, rounds=2, lr=0.05)


def test_k_labels_refuses_a_label_too_rare_to_share():
    labels = np.array([0] * 39 + [1])  # label 1 has one sample but both clients must hold it
    with pytest.raises(DataError, match="label 1 has 1 samples but 2 clients"):
        partition.k_labels(labels, 2, 2, np.random.default_rng(0))
