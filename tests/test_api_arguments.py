"""The Python API's arguments (issue 36): every public function checks what it is given by
the rules a config file's keys get, and refuses a mistake with an ``ArgumentError`` (also a
TypeError and ValueError) naming the argument as the caller wrote it, its value and what is
expected; never a raw AttributeError / TypeError from deep inside, never a silent acceptance.
"""

from __future__ import annotations

import numpy as np
import pytest

import fedsub
from fedsub.data.from_python import AUTO_ROWS, SPARSE_FACTOR
from fedsub.errors import ArgumentError, ConfigError, DataError, FedsubError

SMALL = {"rounds": 1, "clients_per_round": 2, "local_steps": 1, "batch_size": 2}


def clients(count: int = 4, labels=(0, 1, 1, 0)) -> list:
    rng = np.random.default_rng(0)
    return [
        fedsub.samples(list(labels), ids={"item": rng.integers(0, 10, size=len(labels))})
        for _ in range(count)
    ]


def data():
    parts = clients()
    return fedsub.from_clients(parts, test=parts[0], table_rows={"item": 10})


def frame():
    pd = pytest.importorskip("pandas")
    return pd.DataFrame(
        {
            "user": list("aabbccdd"),
            "item": list("xyxzxyzz"),
            "label": [1, 0, 0, 1, 1, 0, 1, 0],
            "x": [0.1, 0.2, 0.3, 0.1, 0.5, 0.3, 0.2, 0.1],
        }
    )


def test_an_argument_error_is_a_config_error_and_a_type_and_value_error():
    assert issubclass(ArgumentError, ConfigError)
    assert issubclass(ArgumentError, TypeError) and issubclass(ArgumentError, ValueError)
    with pytest.raises(ValueError, match=r"lr = 0\.0 is out of range"):
        fedsub.train("sparse-lr", data(), lr=0, **SMALL)


# --- type mistakes are named, not raised raw from deep inside ----------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fedsub.samples([0, 1], ids=[1, 2]), r"ids must be a dict from field name"),
        (lambda: fedsub.samples([0, 1], ids={3: [1, 2]}), r"ids's keys must be field names"),
        (lambda: fedsub.samples([0, 1], where=3), r"where must be a string"),
        (lambda: fedsub.from_clients(5), r"clients must be a list of SampleSets"),
        (lambda: fedsub.from_clients([1, 2]), r"clients\[0\] must be a SampleSet"),
        (lambda: fedsub.from_clients(clients(), test=[1]), r"test must be a SampleSet"),
        (lambda: fedsub.from_dataframe({"user": ["a"]}), r"frame must be a pandas DataFrame"),
        (lambda: fedsub.Config.from_dict(None), r"Config.from_dict\(raw\): raw must be a dict"),
        (lambda: fedsub.Config.from_dict([1]), r"raw must be a dict .* got list"),
        (lambda: fedsub.run(3), r"config must be a fedsub.Config, a dict"),
        (lambda: fedsub.run({"train": SMALL}, stop_requested="yes"), r"stop_requested must be"),
        (lambda: fedsub.run({"train": SMALL}, on_round=3), r"on_round must be a function"),
        (lambda: fedsub.run({"train": SMALL}, out=3), r"out must be a folder"),
        (lambda: fedsub.run({"train": SMALL}, overwrite="yes"), r"overwrite must be True or"),
        (lambda: fedsub.sweep(None, "train.rounds", "12", out="x"), r"values must be a list"),
        (lambda: fedsub.sweep(None, 3, [1], out="x"), r"key must be a config key"),
        (lambda: fedsub.sweep(5, "train.rounds", [1], out="x"), r"config must be a TOML file"),
        (
            lambda: fedsub.train("sparse-lr", data(), algorithms=["fedavg"]),
            r"train\(\) trains one algorithm: give it as algorithm=",
        ),
        (lambda: fedsub.train("sparse-lr", data(), algorithm=1), r"algorithm must be an algor"),
        (lambda: fedsub.compare("sparse-lr", data(), algorithms=3), r"algorithms must be a list"),
        (
            lambda: fedsub.train("sparse-lr", data(), model_options=[1]),
            r"model_options must be a dict",
        ),
        (
            lambda: fedsub.compare("sparse-lr", data(), algorithm_options={"fedprox": 1}),
            r"algorithm_options\['fedprox'\] must be a dict",
        ),
        (
            lambda: fedsub.train("sparse-lr", data(), tables={"item": "x"}),
            r"tables= are for your own torch.nn.Module",
        ),
        (lambda: fedsub.train("sparse-lr", data(), loss=len), r"loss= are for your own torch"),
        (lambda: fedsub.load_dataset(3), r"name must be a dataset's name"),
        (lambda: fedsub.Config.from_toml(3), r"source must be a TOML file's path, TOML text"),
        (lambda: fedsub.Config.from_toml(None, [3]), r"overrides must be a list of 'section"),
        (lambda: fedsub.from_partitioner(3), r"partitioner must be a flwr_datasets partitioner"),
        (lambda: fedsub.load_dataset("synthetic-sparse", path=3), r"path must be a folder"),
    ],
)
def test_type_mistakes_are_argument_errors_naming_the_argument(call, message):
    with pytest.raises(ArgumentError, match=message):
        call()


def test_a_module_given_tables_as_a_list_is_told_the_dict_it_needs():
    from .torch_modules import TwoBags

    with pytest.raises(ArgumentError, match=r"tables must be a dict .* got \['a'\] \(a list\)"):
        fedsub.train(TwoBags(), data(), tables=["a"])


# --- a single string where a list belongs is that one-element list -----------------------------


def test_a_single_algorithm_name_is_a_one_element_list():
    runs = fedsub.compare("sparse-lr", data(), algorithms="fedavg", **SMALL)
    assert list(runs) == ["fedavg"]


def test_a_single_override_is_a_one_element_list():
    assert fedsub.Config.from_toml(None, "train.rounds=3").train.rounds == 3


def test_a_single_feature_column_is_a_one_element_list():
    one = fedsub.from_dataframe(frame(), client_column="user", features="item", seed=1)
    listed = fedsub.from_dataframe(frame(), client_column="user", features=["item"], seed=1)
    assert one.table_rows == listed.table_rows
    np.testing.assert_array_equal(one.train.labels, listed.train.labels)
    tupled = fedsub.from_dataframe(frame(), client_column="user", features=("item",), seed=1)
    assert tupled.table_rows == listed.table_rows


# --- the data constructors apply the config files' checks --------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"test_fraction": -0.1}, r"^test_fraction = -0.1 is out of range; expected >= 0.0$"),
        ({"test_fraction": 0.95}, r"^test_fraction = 0.95 is out of range; expected <= 0.9$"),
        ({"standardize": "yes"}, r"^standardize must be true or false, got 'yes'$"),
        ({"features": [1]}, r"^features must be a string, got 1$"),
        ({"encoding": "no-such-codec"}, r"^encoding = 'no-such-codec' is not allowed"),
    ],
)
def test_dataframe_options_are_checked_as_a_config_files(options, message):
    with pytest.raises(ArgumentError, match=message):
        fedsub.from_dataframe(frame(), client_column="user", numeric=["x"], **options)


def test_table_loader_errors_name_the_keyword_arguments_not_config_keys():
    with pytest.raises(DataError, match=r"features and numeric are both empty") as error:
        fedsub.from_dataframe(frame(), client_column="user")
    assert "data." not in str(error.value)


def test_a_stray_huge_id_is_refused_not_a_huge_table():
    parts = [fedsub.samples([0, 1], ids={"item": [1, 2]}) for _ in range(2)]
    parts.append(fedsub.samples([0, 1], ids={"item": [1, 10**12]}))
    with pytest.raises(DataError, match=r"table 'item' would get 1000000000001 rows .*table_rows"):
        fedsub.from_clients(parts)
    # the stated rule: up to AUTO_ROWS rows, or SPARSE_FACTOR rows per id held, from the ids
    at_limit = [fedsub.samples([0, 1], ids={"item": [0, AUTO_ROWS - 1]}) for _ in range(2)]
    assert fedsub.from_clients(at_limit).table_rows == {"item": AUTO_ROWS}
    beyond = [fedsub.samples([0, 1], ids={"item": [0, AUTO_ROWS]}) for _ in range(2)]
    with pytest.raises(DataError, match=f"up to {AUTO_ROWS} rows or {SPARSE_FACTOR} per id"):
        fedsub.from_clients(beyond)
    sized = fedsub.from_clients(beyond, table_rows={"item": AUTO_ROWS + 1})
    assert sized.table_rows == {"item": AUTO_ROWS + 1}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"table_rows": {"item": 10.5}}, r"table_rows\['item'\] must be an integer >= 1, got 10.5"),
        ({"table_rows": {"item": True}}, r"table_rows\['item'\] must be an integer >= 1, got True"),
        ({"table_rows": {"item": 0}}, r"table_rows\['item'\] must be an integer >= 1, got 0"),
        ({"table_rows": [10]}, r"table_rows must be a dict"),
        ({"field_tables": {"nope": "item"}}, r"field_tables names field 'nope', which the samp"),
        ({"field_tables": {"item": 3}}, r"field_tables\['item'\] must be a table's name"),
        ({"name": 3}, r"name must be a string"),
    ],
)
def test_from_clients_checks_its_keyword_arguments(kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        fedsub.from_clients(clients(), **kwargs)


def test_one_class_training_labels_are_refused():
    with pytest.raises(DataError, match="every training label is 1; a model learns nothing"):
        fedsub.from_clients(clients(labels=(1, 1, 1, 1)))


def test_a_test_split_with_other_fields_is_refused():
    other = fedsub.samples([0, 1], ids={"user": [1, 2]})
    with pytest.raises(DataError, match=r"test has fields \['user'\] .* the clients have \['item'"):
        fedsub.from_clients(clients(), test=other)


def test_a_path_the_dataset_does_not_read_is_refused_in_config_and_python():
    with pytest.raises(ArgumentError, match=r"^path = 'x.csv' is not read: dataset 'synthetic-"):
        fedsub.load_dataset("synthetic-sparse", path="x.csv")
    with pytest.raises(ConfigError, match=r"data.path = 'x.csv' is not read: .*remove data.path"):
        fedsub.Config.from_dict({"data": {"name": "synthetic-li", "path": "x.csv"}})


def test_numpy_numbers_are_taken_as_the_numbers_they_hold():
    result = fedsub.train(
        "sparse-lr", data(), lr=np.float32(0.5), **{**SMALL, "rounds": np.int64(1)}
    )
    assert [e["round"] for e in result.history] == [0, 1]


# --- the docs' promises ------------------------------------------------------------------------


def test_run_takes_a_dict_as_the_guide_says():
    runs = fedsub.run({"train": {**SMALL, "algorithms": ["fedsubavg"]}, "data": {"num_users": 20}})
    assert list(runs) == ["fedsubavg"] and runs.out is None


def test_run_folder_errors_speak_of_keyword_arguments_not_flags(tmp_path):
    config = {"train": {**SMALL, "algorithms": ["fedsubavg"]}, "data": {"num_users": 20}}
    fedsub.run(config, out=tmp_path / "r")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(FedsubError) as error:
        fedsub.run(config, out=tmp_path / "r")
    message = str(error.value)
    assert "pass overwrite=True to replace it, resume=True to continue it" in message
    assert "--" not in message
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_sweep_checks_every_value_before_training_the_first(tmp_path):
    base = {"train": {**SMALL, "algorithms": ["fedsubavg"]}, "data": {"num_users": 20}}
    trained: list[tuple[str, int]] = []
    out = tmp_path / "sweep"
    with pytest.raises(ConfigError, match=r"clients_per_round=50: .*more than the population"):
        fedsub.sweep(
            base,
            "train.clients_per_round",
            [2, 50],
            out=out,
            on_round=lambda name, r: trained.append((name, r)),
        )
    assert trained == [] and not out.exists()
    csv = tmp_path / "clicks.csv"
    csv.write_text("user,item,label\n" + "".join(f"u{i % 3},i{i % 5},{i % 2}\n" for i in range(30)))
    table = {"name": "table", "client_column": "user", "features": ["item"]}
    missing = tmp_path / "missing.csv"
    with pytest.raises(DataError, match=r"data.path=.*missing.csv.*missing.csv"):
        fedsub.sweep(
            {"train": base["train"], "data": table},
            "data.path",
            [str(csv), str(missing)],
            out=out,
            on_round=lambda name, r: trained.append((name, r)),
        )
    assert trained == [] and not out.exists()


def test_boolean_labels_are_zero_and_one():
    part = fedsub.samples(np.array([True, False, True]), ids={"item": [1, 2, 3]})
    np.testing.assert_array_equal(part.labels, [1.0, 0.0, 1.0])


def test_an_algorithm_given_twice_is_refused_in_config_and_python():
    with pytest.raises(ArgumentError, match=r"^algorithms lists 'fedavg' twice"):
        fedsub.compare("sparse-lr", data(), algorithms=["fedavg", "fedavg"], **SMALL)
    with pytest.raises(ConfigError, match=r"train.algorithms lists 'fedavg' twice"):
        fedsub.Config.from_dict({"train": {"algorithms": ["fedavg", "fedavg"]}})


def test_a_model_option_the_model_does_not_take_is_refused_not_ignored():
    with pytest.raises(ArgumentError, match=r"model_options\['embedding_dim'\]: model 'sparse-lr'"):
        fedsub.train("sparse-lr", data(), model_options={"embedding_dim": 3}, **SMALL)


def test_a_blank_out_folder_is_named_as_a_keyword():
    with pytest.raises(ArgumentError, match=r"^out must name a folder, e.g. out='runs/NAME'"):
        fedsub.run({"train": SMALL}, out=" ")


def test_a_run_that_does_not_fit_in_memory_says_so_with_the_tables_sizes():
    parts = clients()
    huge = fedsub.from_clients(parts, table_rows={"item": 10**15})  # beyond any address space
    with pytest.raises(
        FedsubError, match=r"does not fit in memory .* item: 1,000,000,000,000,000 rows"
    ):
        fedsub.train("sparse-lr", huge, **SMALL)


def test_options_for_an_algorithm_not_trained_are_refused_not_ignored():
    with pytest.raises(ArgumentError, match=r"algorithm_options\['fedprox'\] is for an algorithm"):
        fedsub.train("sparse-lr", data(), algorithm_options={"fedprox": {"mu": 0.1}}, **SMALL)
    run = fedsub.train(
        "sparse-lr",
        data(),
        algorithm="fedprox",
        algorithm_options={"fedprox": {"mu": 0.1}},
        **SMALL,
    )
    assert run.algorithm == "fedprox"


def test_keyword_terms_rename_config_keys_only_not_file_names(tmp_path):
    missing = tmp_path / "data.features"
    with pytest.raises(DataError) as error:
        fedsub.load_dataset("table", path=missing, features=["item"])
    assert str(missing) in str(error.value)
    from fedsub.vocabulary import keyword_terms, section_terms

    terms = section_terms("data", ["features", "numeric"])
    text = "data.features is empty; see data.csv and /x/data.numeric"
    assert keyword_terms(text, terms) == "features is empty; see data.csv and /x/data.numeric"
