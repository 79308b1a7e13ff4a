"""Datasets from Python objects (fedsub.data.from_python): per-client arrays give the dataset
built by hand; a DataFrame gives what the table loader gives for the same rows in a CSV file
(the same rules, one code path); a flwr-datasets partitioner's partitions are the clients."""

from __future__ import annotations

import numpy as np
import pytest

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.from_python import from_clients, from_dataframe, from_partitioner, samples
from fedsub.data.ragged import Ragged
from fedsub.data.table import TableOptions, load
from fedsub.errors import ArgumentError, DataError

from .test_table import CSV, OPTIONS


def assert_same_dataset(got: FederatedDataset, expected: FederatedDataset) -> None:
    assert got.table_rows == expected.table_rows
    assert got.field_tables == expected.field_tables
    np.testing.assert_array_equal(got.client_offsets, expected.client_offsets)
    for split in ("train", "test"):
        a, b = getattr(got, split), getattr(expected, split)
        assert a.ids.keys() == b.ids.keys(), split
        for field in a.ids:
            np.testing.assert_array_equal(a.ids[field].values, b.ids[field].values)
            np.testing.assert_array_equal(a.ids[field].offsets, b.ids[field].offsets)
        np.testing.assert_array_equal(a.labels, b.labels)
        assert (a.dense is None) == (b.dense is None), split
        if a.dense is not None:
            np.testing.assert_array_equal(a.dense, b.dense)


# --- per-client arrays -------------------------------------------------------------------------


def test_arrays_of_every_shape_give_the_dataset_built_by_hand():
    user = [np.array([3, 3]), np.array([0, 1, 1])]  # one id per sample
    pair = [np.array([[1, 2], [2, 4]]), np.array([[0, 0], [4, 1], [3, 3]])]  # two ids each
    history = [[[5, 6], []], [[7], [5, 8, 9], [6]]]  # ragged
    labels = [[1, 0], [0, 1, 1]]
    dense = [np.ones((2, 2)), np.zeros((3, 2))]
    clients = [
        samples(labels[k], {"user": user[k], "pair": pair[k], "history": history[k]}, dense[k])
        for k in range(2)
    ]
    test = samples([1], {"user": [2], "pair": [[1, 1]], "history": [[10]]}, [[0.5, 0.5]])
    tables = {"history": "pair"}  # history and pair read one table
    got = from_clients(clients, test, field_tables=tables, name="hand")

    def by_hand(k: int) -> SampleSet:
        return SampleSet(
            {
                "user": Ragged.from_lists([[u] for u in user[k]]),
                "pair": Ragged.from_lists(pair[k].tolist()),
                "history": Ragged.from_lists(history[k]),
            },
            np.array(labels[k], dtype=np.float32),
            dense[k].astype(np.float32),
        )

    expected = FederatedDataset.from_clients(
        "hand",
        {"user": 4, "pair": 11},  # largest ids + 1: 3 and 10 (the test's history)
        [by_hand(0), by_hand(1)],
        SampleSet(
            {
                "user": Ragged.from_lists([[2]]),
                "pair": Ragged.from_lists([[1, 1]]),
                "history": Ragged.from_lists([[10]]),
            },
            np.ones(1, dtype=np.float32),
            np.full((1, 2), 0.5, dtype=np.float32),
        ),
        tables,
    )
    assert_same_dataset(got, expected)
    bigger = from_clients(clients, table_rows={"user": 50, "pair": 20}, field_tables=tables)
    assert bigger.table_rows == {"user": 50, "pair": 20} and len(bigger.test) == 0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: samples([[1, 0]]), "labels must be a 1-d array of numbers"),
        (lambda: samples([1, 0], {"u": [0.5, 1.0]}), r"samples, field 'u': expected integer ids"),
        (lambda: samples([1, 0], {"u": [[1], [2.5]]}), "expected lists of integer ids"),
        (lambda: samples([1, 0], {"u": [1, -2]}), "ids must be >= 0, got -2"),
        (lambda: samples([1, 0], {"u": [1, 2, 3]}), "3 samples, the labels have 2"),
        (lambda: samples([1, 0], dense=[[1.0], [np.inf]]), "dense features must be finite"),
        (lambda: samples([1, 0], dense=[1.0, 2.0]), r"dense must be \[2, d\] numbers"),
    ],
)
def test_bad_arrays_are_named(make, message):
    with pytest.raises(DataError, match=message):
        make()


def test_sample_errors_name_where_and_bad_federations_are_refused():
    with pytest.raises(DataError, match="client 3, field 'u'"):
        samples([1], {"u": [0.5]}, where="client 3")
    one = samples([1, 0], {"u": [0, 1]})
    with pytest.raises(DataError, match=r"1 client.s.; federated training needs at least 2"):
        from_clients([one])
    with pytest.raises(DataError, match="client 1 has no samples"):
        from_clients([one, samples([], {"u": np.zeros(0, dtype=np.int64)})])
    with pytest.raises(DataError, match=r"client 1 has fields \['v'\], client 0 has \['u'\]"):
        from_clients([one, samples([1], {"v": [0]})])
    with pytest.raises(DataError, match=r"table 'u' has 1 rows .table_rows. but an id 1"):
        from_clients([one, one], table_rows={"u": 1})
    with pytest.raises(DataError, match="table_rows names 'w', which no field reads"):
        from_clients([one, one], table_rows={"u": 5, "w": 3})


# --- a pandas DataFrame: the table loader's rules ----------------------------------------------


def csv_frame():
    pd = pytest.importorskip("pandas")
    lines = [line.split(",") for line in CSV.strip().splitlines()]
    frame = pd.DataFrame(lines[1:], columns=lines[0])
    frame["clicked"] = frame["clicked"].astype(int)  # numbers as numbers
    frame["age"] = frame["age"].astype(float)
    # multi-hot values as lists (a CSV joins them with the separator)
    frame["tags"] = [[t for t in text.split("|") if t] for text in frame["tags"]]
    return frame


def test_a_dataframe_gives_what_the_table_loader_gives_for_the_same_rows(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text(CSV)
    expected = load(OPTIONS, str(path), seed=0)
    options = {k: getattr(OPTIONS, k) for k in TableOptions.__dataclass_fields__}
    got = from_dataframe(csv_frame(), name=f"table:{path.name}", **options)
    assert_same_dataset(got, expected)
    assert got.feature_scaling["columns"] == expected.feature_scaling["columns"]


def test_a_dataframe_with_a_random_split_and_booleans_and_missing_values(tmp_path):
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame(
        {
            "user": ["a", "a", "b", "b", "c", "c"],
            "label": [True, False, True, True, False, True],
            "city": ["x", None, "y", "x", float("nan"), "y"],
        }
    )
    got = from_dataframe(frame, client_column="user", features=["city"], test_fraction=0.0)
    path = tmp_path / "same.csv"
    path.write_text("user,label,city\na,1,x\na,0,\nb,1,y\nb,1,x\nc,0,\nc,1,y\n")
    options = TableOptions(client_column="user", features=["city"], test_fraction=0.0)
    expected = load(options, str(path), 0)
    assert_same_dataset(got, expected)


def test_dataframe_errors_name_the_row_and_the_option():
    frame = csv_frame()
    frame.loc[3, "clicked"] = 2
    options = {k: getattr(OPTIONS, k) for k in TableOptions.__dataclass_fields__}
    with pytest.raises(
        DataError, match="DataFrame, row 3: label column 'clicked' must be 0 or 1, got '2'"
    ):
        from_dataframe(frame, **options)
    with pytest.raises(
        ArgumentError, match=r"unknown keyword argument 'label' .the table loader's"
    ):
        from_dataframe(csv_frame(), label="clicked")
    with pytest.raises(  # the client column left at its default: the argument to give is named
        DataError,
        match=r"DataFrame: no column 'client' \(client_column is 'client' when not given: set "
        r"client_column to the column that names each row's client\)",
    ):
        from_dataframe(csv_frame(), label_column="clicked")


# --- a flwr-datasets partitioner ---------------------------------------------------------------


def clicks(rows: int, seed: int):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(seed)
    return datasets.Dataset.from_dict(
        {
            "label": [int(rng.integers(2)) for _ in range(rows)],
            "item": [f"i{rng.integers(6)}" for _ in range(rows)],
            "tags": [
                [f"t{t}" for t in rng.choice(4, rng.integers(0, 3), False)] for _ in range(rows)
            ],
            "price": rng.normal(size=rows).tolist(),
        }
    )


TABLE = {"features": ["item", "tags"], "multi_hot": ["tags"], "numeric": ["price"]}


def test_each_partition_is_a_client_encoded_by_the_table_rules():
    pytest.importorskip("flwr_datasets")
    from flwr_datasets.partitioner import IidPartitioner

    partitioner = IidPartitioner(num_partitions=3)
    partitioner.dataset = clicks(30, 0)
    got = from_partitioner(partitioner, test_fraction=0.0, **TABLE)
    parts = [partitioner.load_partition(i).to_pandas() for i in range(3)]
    assert list(got.sample_counts()) == [len(p) for p in parts]
    import pandas as pd

    rows = pd.concat([p.assign(client=f"{i}") for i, p in enumerate(parts)], ignore_index=True)
    expected = from_dataframe(rows, name="partitions", test_fraction=0.0, **TABLE)
    assert_same_dataset(got, expected)
    # the client's samples are its partition's, in its order
    first_labels = parts[0]["label"].to_numpy(dtype=np.float32)
    np.testing.assert_array_equal(got.client(0).labels, first_labels)


def test_a_held_out_test_dataset_is_the_test_split():
    pytest.importorskip("flwr_datasets")
    from flwr_datasets.partitioner import IidPartitioner

    partitioner = IidPartitioner(num_partitions=2)
    partitioner.dataset = clicks(20, 1)
    held_out = clicks(7, 2)
    got = from_partitioner(partitioner, test=held_out, **TABLE)
    assert len(got.train) == 20 and len(got.test) == 7
    np.testing.assert_array_equal(got.test.labels, np.array(held_out["label"], np.float32))
    with pytest.raises(DataError, match="give either test= or split_column"):
        from_partitioner(partitioner, test=held_out, split_column="s", **TABLE)
    with pytest.raises(DataError, match="client_column is not an option here"):
        from_partitioner(partitioner, client_column="label", **TABLE)
    lacking = held_out.remove_columns(["item", "price"])  # named, not read as empty cells
    with pytest.raises(
        DataError,
        match=r"partitions test: no column\(s\) 'item', 'price', which partition 0 has; .*"
        r"\(it has label, tags\)",
    ):
        from_partitioner(partitioner, test=lacking, **TABLE)
