"""CIFAR-10 / CIFAR-100 from archives in the official format (tests/cifar_files.py), the
partitioners on them, refused members, and `fedsub data fetch` from a server on 127.0.0.1."""

from __future__ import annotations

import hashlib
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch

from fedsub.data import fetch as fetch_module
from fedsub.data.cifar import CifarOptions, load
from fedsub.data.fetch import Download
from fedsub.errors import DataError

from .cifar_files import batch, python2_pickle, write_archive
from .test_fetch import Server


def test_reads_the_official_layout_as_channel_major_pixels(tmp_path):
    path = write_archive(tmp_path / "cifar-10-python.tar.gz", "cifar10", per_batch=30)
    dataset = load("cifar10", CifarOptions(partition="iid", num_clients=5), str(path), 0)
    assert len(dataset.train) == 150 and len(dataset.test) == 30
    assert dataset.train.dense.shape == (150, 3072) and dataset.train.dense.dtype == np.float32
    # the test batch is written last (seed 5): its first image's pixels, rescaled to [0, 1]
    expected = batch(30, {"labels": 10}, 5)
    np.testing.assert_allclose(dataset.test.dense[0], expected["data"][0] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(dataset.test.labels, np.arange(30) % 10)
    assert sorted(np.concatenate([dataset.client(k).labels for k in range(5)])) == sorted(
        np.tile(np.arange(30) % 10, 5)
    )


def test_finds_the_archive_in_a_folder_or_extracted(tmp_path):
    path = write_archive(tmp_path / "down" / "cifar-10-python.tar.gz", "cifar10", per_batch=10)
    options = CifarOptions(partition="iid", num_clients=2)
    from_folder = load("cifar10", options, str(path.parent), 0)
    with tarfile.open(path) as tar:
        tar.extractall(tmp_path / "out", filter="data")
    extracted = load("cifar10", options, str(tmp_path / "out"), 0)
    np.testing.assert_array_equal(from_folder.train.dense, extracted.train.dense)
    with pytest.raises(DataError, match=r"no cifar-10-python.tar.gz .* `fedsub data fetch"):
        load("cifar10", options, str(tmp_path / "empty"), 0)


@pytest.mark.parametrize("labels, classes", [("fine", 100), ("coarse", 20)])
def test_cifar100_fine_or_coarse_labels(tmp_path, labels, classes):
    path = write_archive(tmp_path / "c100.tar.gz", "cifar100", per_batch=400)
    options = CifarOptions(partition="iid", num_clients=4, labels=labels)
    dataset = load("cifar100", options, str(path), 0)
    assert dataset.train.labels.max() == classes - 1 and len(dataset.test) == 400


@pytest.mark.parametrize(
    "partition, extra",
    [("dirichlet", {"dirichlet_alpha": 0.1}), ("k-labels", {"labels_per_client": 2})],
)
def test_the_labeled_partitioners_apply(tmp_path, partition, extra):
    path = write_archive(tmp_path / "c10.tar.gz", "cifar10", per_batch=100)
    options = CifarOptions(partition=partition, num_clients=10, **extra)
    dataset = load("cifar10", options, str(path), 3)
    assert dataset.num_clients == 10 and len(dataset.train) == 500  # disjoint and covering
    if partition == "k-labels":
        assert all(len(np.unique(dataset.client(k).labels)) == 2 for k in range(10))
    again = load("cifar10", options, str(path), 3)
    np.testing.assert_array_equal(dataset.client_offsets, again.client_offsets)


class Pwned:
    """A pickle payload: unpickling it would create a folder."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def bad_member(tmp_path, member: bytes, name: str = "data_batch_3"):
    path = write_archive(tmp_path / "bad.tar.gz", "cifar10", per_batch=10, members={name: member})
    return lambda: load("cifar10", CifarOptions(partition="iid", num_clients=2), str(path), 0)


def test_a_member_that_would_run_code_is_refused(tmp_path):
    target = tmp_path / "pwned"
    attempt = bad_member(tmp_path, pickle.dumps({"data": Pwned(str(target))}, protocol=2))
    with pytest.raises(DataError, match=r"data_batch_3: refusing to unpickle (posix|os)\.mkdir"):
        attempt()
    assert not target.exists()


@pytest.mark.parametrize(
    "member, message",
    [
        (python2_pickle([1, 2, 3]), r"data_batch_3: expected a pickled dict, got list"),
        (python2_pickle({"labels": [0]}), r"data_batch_3: 'data' must be a uint8 array"),
        (
            python2_pickle({"data": np.zeros((2, 1024), np.uint8), "labels": [0, 1]}),
            r"data_batch_3: 'data' has 1024 values per image, not 3072",
        ),
        (
            python2_pickle({"data": np.zeros((2, 3072), np.uint8), "labels": [0]}),
            r"data_batch_3: expected 'labels', a list of 2 labels",
        ),
        (
            python2_pickle({"data": np.zeros((2, 3072), np.uint8), "labels": [0, 10]}),
            r"data_batch_3: 'labels' must be integers in \[0, 10\)",
        ),
        (b"\x80\x02}q\x00(U\x04data", r"data_batch_3: not a readable CIFAR batch pickle"),
    ],
)
def test_malformed_members_name_the_member_and_what_was_expected(tmp_path, member, message):
    with pytest.raises(DataError, match=message):
        bad_member(tmp_path, member)()


def test_a_missing_member_or_a_broken_archive_is_explained(tmp_path):
    path = write_archive(tmp_path / "c10.tar.gz", "cifar10", per_batch=10)
    with tarfile.open(path) as tar:
        kept = [m for m in tar.getmembers() if not m.name.endswith("test_batch")]
        with tarfile.open(tmp_path / "short.tar.gz", "w:gz") as out:
            for info in kept:
                out.addfile(info, tar.extractfile(info))
    options = CifarOptions(partition="iid", num_clients=2)
    with pytest.raises(DataError, match=r"no file 'cifar-10-batches-py/test_batch' in the"):
        load("cifar10", options, str(tmp_path / "short.tar.gz"), 0)
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(path.read_bytes()[:500])
    with pytest.raises(DataError, match=r"cut.tar.gz: not a readable tar.gz archive"):
        load("cifar10", options, str(cut), 0)


def test_fetch_from_a_local_server_then_load_from_the_cache(tmp_path, monkeypatch, capsys):
    from fedsub.cli import main

    monkeypatch.setenv("FEDSUB_DATA", str(tmp_path / "cache"))
    body = write_archive(tmp_path / "served.tar.gz", "cifar10", per_batch=20).read_bytes()
    server = Server(body, "cifar-10-python.tar.gz")
    try:
        official = fetch_module.DOWNLOADS["cifar10"][0]
        pin = "sha256:" + hashlib.sha256(body).hexdigest()
        monkeypatch.setitem(
            fetch_module.DOWNLOADS,
            "cifar10",
            (Download(server.url, official.filename, pin, len(body)),),
        )
        server.cut_after = len(body) // 3  # the first transfer breaks; the retry resumes
        assert main(["data", "fetch", "cifar10"]) == 2
        assert "cut off" in capsys.readouterr().err
        assert main(["data", "fetch", "cifar10"]) == 0
        assert server.requests[-1] is not None and server.requests[-1].startswith("bytes=")
    finally:
        server.close()
    cached = tmp_path / "cache" / "cifar10" / "cifar-10-python.tar.gz"
    assert cached.read_bytes() == body and not cached.with_suffix(".gz.part").exists()
    dataset = load("cifar10", CifarOptions(partition="iid", num_clients=2), None, 0)
    assert len(dataset.train) == 100


def test_official_pins():
    for name, md5_size in (("cifar10", 170_498_071), ("cifar100", 169_001_437)):
        (download,) = fetch_module.DOWNLOADS[name]
        assert download.url.startswith("https://www.cs.toronto.edu/~kriz/")
        assert download.size == md5_size and download.checksum.startswith("sha256:")


@pytest.mark.parametrize("model_name", ["cnn", "resnet18"])
def test_image_models_read_three_channels(tmp_path, model_name):
    from fedsub.models.base import Batch, forward
    from fedsub.models.registry import build_model

    path = write_archive(tmp_path / "c10.tar.gz", "cifar10", per_batch=10)
    dataset = load("cifar10", CifarOptions(partition="iid", num_clients=2), str(path), 0)
    model = build_model(model_name, dataset, {"widths": [4, 8] if model_name == "cnn" else []})
    assert (model.in_channels, model.side, model.classes) == (3, 32, 10)
    params = model.init(torch.Generator().manual_seed(0), torch.float32)
    images = Batch.from_samples(dataset.test.take(np.arange(4)), torch.float32)
    assert forward(model, params, images).shape == (4, 10)
