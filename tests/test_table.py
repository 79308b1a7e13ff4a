"""`table`: the user's own CSV, with vocabularies from the training split."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from fedsub.cli import main
from fedsub.data.table import TableOptions, load
from fedsub.errors import DataError

CSV = """user,clicked,city,tags,age,split
u1,1,paris,a|b,31,train
u1,0,lyon,b,31,train
u2,1,paris,c,45,train
u2,1,nice,a,45,test
u3,0,lyon,,22,train
u3,1,rome,b|c,22,test
"""

OPTIONS = TableOptions(
    client_column="user",
    label_column="clicked",
    features=["city", "tags"],
    multi_hot=["tags"],
    numeric=["age"],
    crosses=["city*tags"],
    split_column="split",
)


def test_vocabulary_from_train_split_oov_multi_hot_crosses_and_dense(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text(CSV)
    dataset = load(OPTIONS, str(path), seed=0)
    assert dataset.num_clients == 3 and list(dataset.sample_counts()) == [2, 1, 1]
    # blocks: city (oov, paris, lyon) = 3 rows, tags (oov, a, b, c) = 4 rows,
    # city*tags (oov, paris-a, paris-b, lyon-b, paris-c) = 5 rows
    assert dataset.table_rows["features"] == 12
    ids = dataset.train.ids["features"]
    first = ids.values[ids.offsets[0] : ids.offsets[1]].tolist()  # u1 paris a|b
    assert first == [1, 3 + 1, 3 + 2, 7 + 1, 7 + 2]
    u3 = dataset.client(2).ids["features"]
    assert u3.values.tolist() == [2]  # lyon, no tags, so no cross
    test = dataset.test.ids["features"]
    nice = test.values[test.offsets[0] : test.offsets[1]].tolist()
    assert nice == [0, 3 + 1, 7 + 0]  # nice is out of vocabulary, and so is the nice*a cross
    np.testing.assert_array_equal(dataset.test.labels, [1, 1])
    raw = load(dataclasses.replace(OPTIONS, standardize=False), str(path), seed=0)
    np.testing.assert_array_equal(raw.train.dense[:, 0], [31, 31, 45, 22])


def test_numeric_columns_are_standardized_with_training_split_statistics(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text(CSV)
    dataset = load(OPTIONS, str(path), seed=0)
    train_ages = np.array([31, 31, 45, 22], dtype=np.float64)  # the train rows only
    mean, std = train_ages.mean(), train_ages.std()
    assert dataset.feature_scaling["columns"]["age"] == {
        "mean": pytest.approx(mean),
        "std": pytest.approx(std),
        "constant": False,
    }
    np.testing.assert_allclose(dataset.train.dense[:, 0], (train_ages - mean) / std, rtol=1e-6)
    # the test rows (ages 45, 22) use the training statistics, not their own
    np.testing.assert_allclose(
        dataset.test.dense[:, 0], (np.array([45, 22]) - mean) / std, rtol=1e-6
    )


def test_a_constant_numeric_column_gets_std_1_and_a_warning(tmp_path, caplog):
    path = tmp_path / "data.csv"
    path.write_text(CSV.replace(",31,", ",30,").replace(",45,", ",30,").replace(",22,", ",30,"))
    dataset = load(OPTIONS, str(path), seed=0)
    assert dataset.feature_scaling["columns"]["age"] == {"mean": 30.0, "std": 1.0, "constant": True}
    np.testing.assert_array_equal(dataset.train.dense[:, 0], 0.0)
    assert "age are constant on the training split; std set to 1" in caplog.text


@pytest.mark.parametrize(
    "text, options, message",
    [
        (
            CSV,
            TableOptions(client_column="uid"),
            "no column 'uid' (asked for by data.client_column; name a column the data have); "
            "columns are user, clicked",
        ),
        (
            CSV,
            TableOptions(label_column="clicked"),  # client_column left at its default
            "no column 'client' (data.client_column is 'client' when not given: set "
            "data.client_column to the column that names each row's client)",
        ),
        (
            CSV.replace("u2,1,paris", "u2,yes,paris"),
            OPTIONS,
            "line 4: column 'clicked' (data.label_column) must hold numbers; it holds 'yes'",
        ),
        (
            CSV.replace("u2,1,nice,a,45", "u2,1,nice,a,"),
            OPTIONS,
            "line 5: column 'age' (data.numeric) must hold numbers; it holds an empty cell",
        ),
        (
            CSV.replace("u2,1,paris", "u2,2,paris"),
            OPTIONS,
            "line 4: label column 'clicked' must be 0 or 1, got '2'",
        ),
        (CSV + "u4,1\n", OPTIONS, "line 8: 2 fields, expected 6"),
        (CSV.replace(",test\n", ",val\n"), OPTIONS, "split must be train or test, got 'val'"),
        ("", OPTIONS, "the file is empty; expected a header row"),
        (CSV.replace(",31,", ",inf,", 1), OPTIONS, "line 2: numeric columns must be finite"),
        (CSV.replace("u3,0,lyon", ",0,lyon"), OPTIONS, "line 6: empty client id in column 'user'"),
        (
            CSV.replace("u2,", "u1,").replace("u3,", "u1,"),
            OPTIONS,
            "the training split holds 1 client (user = 'u1'); federated training needs at least 2",
        ),
        (
            CSV.replace(",0,", ",1,"),
            OPTIONS,
            "every training label (clicked) is 1; a binary classifier needs both 0 and 1",
        ),
        (CSV.replace("age,split", "age,city"), OPTIONS, "line 1: column 'city' appears twice"),
        (
            CSV,
            dataclasses.replace(OPTIONS, features=["city", "tags", "clicked"]),
            "column 'clicked' is both data.label_column and in data.features",
        ),
        (CSV, dataclasses.replace(OPTIONS, numeric=["age", "age"]), "lists column 'age' twice"),
    ],
)
def test_bad_tables_name_the_problem(tmp_path, text, options, message):
    path = tmp_path / "data.csv"
    path.write_text(text)
    if options.client_column == "uid":
        options = TableOptions(client_column="uid", label_column="clicked")
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(options, str(path), seed=0)


def test_compare_runs_on_a_user_table(tmp_path):
    rng = np.random.default_rng(0)
    lines = ["user,clicked,item,country"]
    for _ in range(600):
        user, item = int(rng.integers(40)), int(rng.integers(30))
        lines.append(
            f"user{user},{int(rng.random() < (0.8 if item < 10 else 0.2))},item{item},c{user % 3}"
        )
    (tmp_path / "clicks.csv").write_text("\n".join(lines) + "\n")
    config = tmp_path / "table.toml"
    config.write_text(f"""
[data]
name = "table"
path = "{tmp_path / "clicks.csv"}"
client_column = "user"
label_column = "clicked"
features = ["item", "country"]
crosses = ["item*country"]

[train]
rounds = 8
clients_per_round = 10
lr = 0.5

[eval]
every = 4
""")
    assert main(["compare", str(config), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["algorithms"]["fedsubavg"]["final"]["test_auc"] > 0.7


def write_clicks(path, rows: int = 900) -> None:
    """The clicks.csv layout of the table tutorial (docs/tutorials/your-table.md): a price
    of 1-50 that drives the click."""
    rng = np.random.default_rng(0)
    lines = ["user,clicked,item,country,tags,price"]
    for _ in range(rows):
        user, item = int(rng.integers(40)), int(rng.integers(30))
        price = round(float(rng.uniform(1, 50)), 1)
        p = 1 / (1 + np.exp((price - 25) / 8 - (1 if item < 10 else -1)))
        tags = "|".join(t for t in ("sport", "outdoor") if rng.random() < 0.4)
        lines.append(f"u{user},{int(rng.random() < p)},i{item},c{user % 3},{tags},{price}")
    path.write_text("\n".join(lines) + "\n")


TUTORIAL_TABLE = """
[data]
name = "table"
path = "{path}"
client_column = "user"
label_column = "clicked"
features = ["item", "country", "tags"]
multi_hot = ["tags"]
numeric = ["price"]
crosses = ["item*country"]

[train]
algorithms = ["fedavg"]
rounds = 6
clients_per_round = 20

[eval]
every = 3
"""


def test_the_tutorial_clicks_example_trains_and_stores_its_scaling(tmp_path):
    clicks = tmp_path / "clicks.csv"
    write_clicks(clicks)
    config = tmp_path / "table.toml"
    config.write_text(TUTORIAL_TABLE.replace("{path}", str(clicks)))
    out = tmp_path / "out"
    assert main(["compare", str(config), "--out", str(out), "--quiet"]) == 0
    losses = [
        json.loads(line)["train_loss"]
        for line in (out / "fedavg" / "metrics.jsonl").read_text().splitlines()
    ]
    assert losses[-1] < losses[1] < losses[0]  # unscaled prices went 0.69 -> 3.4 here
    scaling = json.loads((out / "feature_scaling.json").read_text())
    options = TableOptions(
        client_column="user", label_column="clicked", numeric=["price"], standardize=False
    )
    raw = load(options, str(clicks), seed=0).train.dense[:, 0].astype(np.float64)
    assert scaling["columns"]["price"]["mean"] == pytest.approx(raw.mean())
    assert scaling["columns"]["price"]["std"] == pytest.approx(raw.std())
    assert scaling["training_rows"] == len(raw)


@pytest.mark.parametrize("encoding", ["auto", "utf-8", "utf-8-sig"])
def test_a_header_written_with_a_byte_order_mark_names_its_first_column(tmp_path, encoding):
    """Excel and Notepad start UTF-8 CSVs with a BOM: the first column is still "user", with
    the encoding guessed or named."""
    from fedsub.data.table import read_rows

    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbfuser,label\r\nu1,1\r\n")
    header, rows, _ = read_rows(path, encoding)
    assert header == ["user", "label"] and rows == [["u1", "1"]]
