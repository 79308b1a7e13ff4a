"""`table`: the user's own CSV, with vocabularies from the training split."""

from __future__ import annotations

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
    np.testing.assert_array_equal(dataset.train.dense[:, 0], [31, 31, 45, 22])
    np.testing.assert_array_equal(dataset.test.labels, [1, 1])


@pytest.mark.parametrize(
    "text, options, message",
    [
        (CSV, TableOptions(client_column="uid"), "no column 'uid'; columns are user, clicked"),
        (CSV.replace("u2,1,paris", "u2,yes,paris"), OPTIONS, "line 4: label and numeric"),
        (CSV.replace("u2,1,paris", "u2,2,paris"), OPTIONS, "line 4: label must be 0 or 1, got 2"),
        (CSV + "u4,1\n", OPTIONS, "line 8: 2 fields, expected 6"),
        (CSV.replace(",test\n", ",val\n"), OPTIONS, "split must be train or test, got 'val'"),
        ("", OPTIONS, "the file is empty; expected a header row"),
        (CSV.replace(",31,", ",inf,", 1), OPTIONS, "line 2: numeric columns must be finite"),
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
