"""MovieLens loaders on small files written in the archives' exact formats."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

from fedsub.data.movielens import AGE_GROUPS, MovieLensOptions, age_group, load
from fedsub.errors import DataError


def write_100k(folder: Path, extra_rating: str = "") -> Path:
    root = folder / "ml-100k"
    root.mkdir(parents=True)
    (root / "u.user").write_text(
        "1|24|M|technician|85711\n2|53|F|other|94043\n3|17|M|writer|32067\n"
    )
    items = "1|Toy Story (1995)|01-Jan-1995||http://x|0|0\n2|Café Society (1995)|01-Jan-1995||x|0\n"
    (root / "u.item").write_bytes(items.encode("latin-1"))
    ratings = [(1, 1, 5), (1, 2, 3), (2, 1, 4), (2, 2, 1), (3, 2, 5), (3, 1, 2)] * 4
    text = "".join(f"{u}\t{m}\t{r}\t88125{i:04d}\n" for i, (u, m, r) in enumerate(ratings))
    (root / "u.data").write_text(text + extra_rating)
    return root


def write_1m(folder: Path) -> Path:
    root = folder / "ml-1m"
    root.mkdir(parents=True)
    (root / "users.dat").write_text("1::F::1::10::48067\n2::M::56::16::70072\n")
    (root / "movies.dat").write_bytes(
        "10::GoldenEye (1995)::Action\n20::Amélie (2001)::Comedy\n".encode("latin-1")
    )
    ratings = [(1, 10, 4), (1, 20, 2), (2, 10, 1), (2, 20, 5)] * 5
    (root / "ratings.dat").write_text(
        "".join(f"{u}::{m}::{r}::97830{i:04d}\n" for i, (u, m, r) in enumerate(ratings))
    )
    return root


def decode(dataset):
    """(user index, gender, age index, movie, label) per training sample."""
    m = (dataset.table_rows["features"] - 2 - len(AGE_GROUPS)) // (3 + len(AGE_GROUPS))
    ids = dataset.train.ids["features"].values.reshape(-1, 5)
    gender, age, movie = ids[:, 0], ids[:, 1] - 2, ids[:, 2] - 2 - len(AGE_GROUPS)
    base = 2 + len(AGE_GROUPS) + m
    np.testing.assert_array_equal(ids[:, 3], base + gender * m + movie)
    np.testing.assert_array_equal(ids[:, 4], base + 2 * m + age * m + movie)
    return gender, age, movie, m


def test_age_buckets_follow_ml1m_groups():
    assert [age_group(a) for a in (7, 17, 18, 24, 25, 44, 45, 49, 50, 55, 56, 90)] == [
        1,
        1,
        18,
        18,
        25,
        35,
        45,
        45,
        50,
        50,
        56,
        56,
    ]


def test_ml100k_from_folder_and_zip_latin1_items(tmp_path):
    root = write_100k(tmp_path)
    options = MovieLensOptions(test_fraction=0.25)
    dataset = load("movielens-100k", options, str(root), seed=0)
    _, age, _, m = decode(dataset)
    assert m == 2 and dataset.num_clients == 3
    assert len(dataset.train) + len(dataset.test) == 24
    # user 2 is female, 53 -> group 50; labels are rating >= 4
    first_client = dataset.client(1)
    assert first_client.ids["features"].values[0] == 1  # female
    assert set(age.tolist()) <= {AGE_GROUPS.index(g) for g in (18, 50, 1)}
    assert set(np.unique(dataset.train.labels)) <= {0.0, 1.0}

    archive = tmp_path / "ml-100k.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for f in root.iterdir():
            z.write(f, f"ml-100k/{f.name}")
    again = load("movielens-100k", options, str(archive), seed=0)
    np.testing.assert_array_equal(
        again.train.ids["features"].values, dataset.train.ids["features"].values
    )


def test_ml1m_double_colon_and_age_codes(tmp_path):
    root = write_1m(tmp_path)
    dataset = load("movielens-1m", MovieLensOptions(test_fraction=0.2), str(root), seed=3)
    gender, age, movie, m = decode(dataset)
    assert m == 2
    owner = dataset.client_of_sample()
    assert set(gender[owner == 0]) == {1} and set(age[owner == 0]) == {0}  # F, under 18
    assert set(gender[owner == 1]) == {0} and set(age[owner == 1]) == {6}  # M, 56+
    labels = dataset.train.labels
    for g, mv, lab in zip(gender, movie, labels, strict=True):
        expected = {(1, 0): 1.0, (1, 1): 0.0, (0, 0): 0.0, (0, 1): 1.0}[(g, mv)]
        assert lab == expected


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("1\t1\t5\n", "u.data, line 25: expected 4 fields separated by '\\t'"),
        ("1\tone\t5\t1\n", "u.data, line 25: movie id must be an integer, got 'one'"),
        ("9\t1\t5\t1\n", "u.data, line 25: user 9 is not in u.user"),
        ("1\t1\t7\t1\n", "u.data, line 25: rating must be 1..5, got 7"),
    ],
)
def test_malformed_lines_name_file_line_and_expectation(tmp_path, bad_line, message):
    root = write_100k(tmp_path, extra_rating=bad_line)
    with pytest.raises(DataError, match=message.replace("\\t", "\\\\t").replace(".", r"\.")):
        load("movielens-100k", MovieLensOptions(), str(root), seed=0)


def test_missing_dataset_says_how_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSUB_DATA", str(tmp_path / "empty-cache"))
    with pytest.raises(DataError, match=r"Run `fedsub data fetch movielens-1m`, or set data\.path"):
        load("movielens-1m", MovieLensOptions(), None, seed=0)
