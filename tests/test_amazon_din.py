"""Amazon loaders in the authors' formats, and DIN: shapes, a learning step, both backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsub.data.amazon import (
    AmazonFilesOptions,
    AmazonRatingsOptions,
    load_fedsubavg_files,
    load_ratings_csv,
)
from fedsub.errors import DataError
from fedsub.models.base import Batch, forward
from fedsub.models.din import DIN
from fedsub.models.pooling import padded
from fedsub.submodel.index import SubmodelIndex

from .conftest import assert_backends_agree, assert_one_step_lowers_loss


def write_user_files(folder, users=6, lines=10, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir()
    for u in range(users):
        rows = []
        for _ in range(lines):
            history = rng.choice(np.arange(100, 140), size=rng.integers(0, 4), replace=False)
            text = ",".join(map(str, history)) if len(history) else "0"
            rows.append(f"{rng.integers(2)}\t{u + 7}\t{rng.integers(100, 140)}\t{text}")
        (folder / f"user_{u + 7}").write_text("\n".join(rows) + "\n")
    return folder


def test_fedsubavg_files_hold_out_each_users_last_20_percent(tmp_path):
    folder = write_user_files(tmp_path / "amazon", users=4, lines=10)
    dataset = load_fedsubavg_files(AmazonFilesOptions(), str(folder), 0)
    assert dataset.num_clients == 4 and list(dataset.sample_counts()) == [8] * 4
    assert len(dataset.test) == 8
    assert dataset.field_tables == {"user": "user", "item": "item", "history": "item"}
    first_file = sorted(folder.glob("user_*"))[0]  # clients are numbered in file order
    lines = first_file.read_text().splitlines()
    first = dataset.client(0)
    histories = [
        first.ids["history"].values[a:b]
        for a, b in zip(
            first.ids["history"].offsets[:-1], first.ids["history"].offsets[1:], strict=True
        )
    ]
    for line, hist, label in zip(lines[:8], histories, first.labels, strict=True):
        raw = line.split("\t")
        assert float(raw[0]) == label
        assert len(hist) == (0 if raw[3] == "0" else len(raw[3].split(",")))


def test_bad_user_file_line_is_named(tmp_path):
    folder = write_user_files(tmp_path / "amazon", users=2, lines=3)
    (folder / "user_8").write_text("1\t8\t120\n")
    with pytest.raises(DataError, match=r"user_8, line 1: expected 4 tab-separated fields"):
        load_fedsubavg_files(AmazonFilesOptions(), str(folder), 0)


def test_ratings_csv_click_history_and_time_split(tmp_path):
    rows = [
        "a,i1,5,100",
        "a,i2,3,200",
        "a,i3,5,300",
        "a,i4,5,1385000001",
        "b,i1,5,100",
    ]  # b has too few ratings
    path = tmp_path / "ratings.csv"
    path.write_text("\n".join(rows) + "\n")
    dataset = load_ratings_csv(AmazonRatingsOptions(min_ratings=4), str(path), 0)
    assert dataset.num_clients == 1 and len(dataset.train) == 3 and len(dataset.test) == 1
    hist = dataset.train.ids["history"]
    assert hist.lengths().tolist() == [0, 1, 1]  # i1 clicked before i2 and i3; i2 was not
    assert dataset.train.labels.tolist() == [1.0, 0.0, 1.0]
    assert dataset.test.ids["history"].lengths().tolist() == [2]  # i1, i3


def test_padded_history_matches_the_lists():
    weight = torch.arange(12.0).reshape(6, 2)
    values, offsets = torch.tensor([3, 1, 5, 2]), torch.tensor([0, 2, 2, 4])
    rows, mask = padded(weight, values, offsets)
    assert rows.shape == (3, 2, 2) and mask.tolist() == [[True, True], [False, False], [True, True]]
    torch.testing.assert_close(rows[2], weight[[5, 2]])


@pytest.fixture(scope="module")
def amazon(tmp_path_factory):
    folder = write_user_files(tmp_path_factory.mktemp("a") / "amazon", users=8, lines=12)
    dataset = load_fedsubavg_files(AmazonFilesOptions(), str(folder), 0)
    return dataset, SubmodelIndex.build(dataset)


def test_din_shapes_and_one_step_lowers_the_loss(amazon):
    dataset, _ = amazon
    model = DIN(dict(dataset.table_rows), embedding_dim=6, init_std=0.1)
    params = model.init(torch.Generator().manual_seed(0), torch.float64)
    batch = Batch.from_samples(dataset.train.take(np.arange(16)), torch.float64)
    features = model.embed(params.tables, batch.ids)
    assert features["history"].shape[:2] == features["mask"].shape
    assert features["user"].shape == (16, 6)
    assert forward(model, params, batch).shape == (16,)
    assert_one_step_lowers_loss(model, params, batch, lr=0.5)


def test_din_batched_equals_sequential(amazon):
    dataset, index = amazon
    model = DIN(dict(dataset.table_rows), embedding_dim=4, init_std=0.3)
    assert_backends_agree(
        model, dataset, index, "fedsubavg", 4, local_steps=3, seed=2, clip_norm=5.0
    )
