"""The public Python API (``fedsub.load_dataset``, ``train``, ``compare``, ``run``,
``Config``): each function at smoke size, ``run`` against the command line, both backends on
a user's nn.Module, bad inputs, and ``import fedsub`` without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fedsub
from fedsub.cli import main
from fedsub.submodel.params import Params

from .test_backends import two_tables_with_dense
from .torch_modules import TwoBags

SMALL_DATA = {"num_users": 40, "num_items": 30, "mean_samples_per_user": 8}
SMALL = {"rounds": 2, "clients_per_round": 6, "local_steps": 2, "batch_size": 3, "every": 1}
CONFIG = """
[data]
name = "synthetic-sparse"
num_users = 40
num_items = 30
mean_samples_per_user = 8

[train]
algorithms = ["fedavg", "fedsubavg"]
rounds = 3
clients_per_round = 6
local_steps = 2
batch_size = 3
lr = 0.2

[eval]
every = 1
train_loss_samples = 100
target_train_loss = 0.69
"""


@pytest.fixture(scope="module")
def data():
    return fedsub.load_dataset("synthetic-sparse", seed=3, **SMALL_DATA)


def without_elapsed(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k != "elapsed"} for e in history]


def metrics_file(path: Path) -> list[dict]:
    return without_elapsed([json.loads(line) for line in path.read_text().splitlines()])


def test_import_fedsub_does_not_import_torch_and_every_name_resolves():
    code = (
        "import sys, fedsub\n"
        "assert 'torch' not in sys.modules, 'torch imported by import fedsub'\n"
        "fedsub.ConfigError\n"
        "assert 'torch' not in sys.modules, 'torch imported by an error class'\n"
        "for name in fedsub.__all__:\n"
        "    assert getattr(fedsub, name) is not None, name\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert set(fedsub.__all__) <= set(dir(fedsub))
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        fedsub.trian  # noqa: B018


def test_load_dataset_gives_the_configs_dataset(data, tmp_path):
    assert data.num_clients == 40
    assert set(data.table_rows) == set(data.train.ids) == {"features"}
    assert len(data.test) > 0 and len(data.train) == int(data.sample_counts().sum())
    again = fedsub.load_dataset("synthetic-sparse", seed=3, **SMALL_DATA)
    np.testing.assert_array_equal(again.train.labels, data.train.labels)
    other = fedsub.load_dataset("synthetic-sparse", seed=4, **SMALL_DATA)
    assert not np.array_equal(other.train.labels[:50], data.train.labels[:50])
    li = fedsub.load_dataset("synthetic-li", num_devices=5, dim=4)
    assert li.num_clients == 5 and li.train.dense_dim == 4 and li.table_rows == {}
    csv = tmp_path / "clicks.csv"
    csv.write_text("user,item,label\n" + "".join(f"u{i % 3},i{i % 5},{i % 2}\n" for i in range(30)))
    table = fedsub.load_dataset("table", path=csv, client_column="user", features=["item"])
    assert table.num_clients == 3 and len(table.train) + len(table.test) == 30


def test_bad_dataset_names_options_and_values_name_the_keyword_argument():
    with pytest.raises(fedsub.ArgumentError, match=r"^name = 'synthetic' .*synthetic-sparse"):
        fedsub.load_dataset("synthetic")
    with pytest.raises(
        fedsub.ArgumentError,
        match=r"^unknown keyword argument 'users' .*allowed keys: .*num_users",
    ):
        fedsub.load_dataset("synthetic-sparse", users=10)
    with pytest.raises(fedsub.ArgumentError, match=r"^num_users must be an integer, got 'many'"):
        fedsub.load_dataset("synthetic-sparse", num_users="many")
    with pytest.raises(ValueError, match=r"^seed = -1 is out of range"):  # ArgumentError is one
        fedsub.load_dataset("synthetic-sparse", seed=-1)
    with pytest.raises(fedsub.ArgumentError, match=r"^path = .* is not read: dataset 'synth"):
        fedsub.load_dataset("synthetic-sparse", path="clicks.csv")


def test_train_a_built_in_model_returns_history_summary_and_the_trained_params(data):
    result = fedsub.train("sparse-lr", data, lr=0.2, target_train_loss=0.69, **SMALL)
    assert result.algorithm == "fedsubavg"
    assert [e["round"] for e in result.history] == [0, 1, 2]
    assert {"train_loss", "test_loss", "test_auc", "elapsed"} <= set(result.history[0])
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    assert result.summary["diverged"] is None and result.diverged is None
    assert result.summary["final"]["train_loss"] == result.history[-1]["train_loss"]
    reached = [e["round"] for e in result.history if e["train_loss"] <= 0.69]
    assert result.summary["rounds_to_target"] == (reached[0] if reached else None)
    assert isinstance(result.model, Params) and result.model is result.params
    assert result.model.tables["features"].shape[0] == data.table_rows["features"]
    wider = fedsub.train("embedding-lr", data, model_options={"embedding_dim": 3}, **SMALL)
    assert wider.model.tables["features"].shape == (data.table_rows["features"], 3)


def test_compare_runs_each_algorithm_from_the_same_start_and_summarizes(data):
    runs = fedsub.compare("sparse-lr", data, algorithms=["fedavg", "fedsubavg"], **SMALL)
    assert list(runs) == ["fedavg", "fedsubavg"] and len(runs) == 2
    first = [runs[n].history[0]["train_loss"] for n in runs]
    assert first[0] == first[1]
    assert runs["fedavg"].history[-1] != runs["fedsubavg"].history[-1]
    assert set(runs.summary["algorithms"]) == {"fedavg", "fedsubavg"}
    assert "| fedavg |" in runs.markdown and runs.out is None
    with pytest.raises(KeyError, match="this comparison ran fedavg, fedsubavg"):
        runs["fedprox"]


def test_run_gives_the_command_lines_results(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(CONFIG)
    assert main(["compare", str(path), "--out", str(tmp_path / "cli"), "--quiet"]) == 0
    config = fedsub.Config.from_toml(path)
    folder = fedsub.run(config, out=tmp_path / "api")
    memory = fedsub.run(CONFIG)  # TOML text, nothing written
    assert folder.out == tmp_path / "api" and memory.out is None
    cli_summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert json.loads((tmp_path / "api" / "summary.json").read_text()) == cli_summary
    assert memory.summary == cli_summary
    for name in ("fedavg", "fedsubavg"):
        cli = metrics_file(tmp_path / "cli" / name / "metrics.jsonl")
        assert [e["round"] for e in cli] == [0, 1, 2, 3]
        assert metrics_file(tmp_path / "api" / name / "metrics.jsonl") == cli
        assert without_elapsed(memory[name].history) == cli
        saved = (tmp_path / "cli" / name / "model.safetensors").read_bytes()
        assert (tmp_path / "api" / name / "model.safetensors").read_bytes() == saved
    assert (tmp_path / "api" / "config.toml").read_text() == config.to_toml()
    # the same comparison through fedsub.compare, from keyword options
    data = fedsub.load_dataset("synthetic-sparse", **SMALL_DATA)
    options = {"rounds": 3, "clients_per_round": 6, "local_steps": 2, "batch_size": 3}
    runs = fedsub.compare("sparse-lr", data, lr=0.2, every=1, train_loss_samples=100, **options)
    for name in ("fedavg", "fedsubavg"):
        assert without_elapsed(runs[name].history) == without_elapsed(memory[name].history)


def test_sweep_gives_the_command_lines_sweep(tmp_path):
    """fedsub.sweep from a file, from TOML-shaped data and from a Config writes what
    `fedsub compare --sweep` writes: the same sweep.json and per-value metrics."""
    import tomllib

    path = tmp_path / "tiny.toml"
    path.write_text(CONFIG)
    sweep = ["--sweep", "train.clients_per_round=4,6"]
    assert main(["compare", str(path), *sweep, "--out", str(tmp_path / "cli"), "--quiet"]) == 0
    expected = json.loads((tmp_path / "cli" / "sweep.json").read_text())
    assert expected["values"] == ["4", "6"]
    sources = {
        "file": path,
        "data": tomllib.loads(CONFIG),
        "config": fedsub.Config.from_toml(path),
    }
    for label, source in sources.items():
        result = fedsub.sweep(source, "train.clients_per_round", [4, "6"], out=tmp_path / label)
        assert result.out == tmp_path / label and result.summary == expected, label
        assert json.loads((tmp_path / label / "sweep.json").read_text()) == expected
        for value in ("4", "6"):
            for name in ("fedavg", "fedsubavg"):
                relative = Path(f"train.clients_per_round={value}") / name / "metrics.jsonl"
                cli = metrics_file(tmp_path / "cli" / relative)
                assert metrics_file(tmp_path / label / relative) == cli, (label, value)
    with pytest.raises(fedsub.ConfigError, match="value '4' is given twice"):
        fedsub.sweep(path, "train.clients_per_round", [4, 4], out=tmp_path / "twice")
    with pytest.raises(fedsub.ConfigError, match="at least one value"):
        fedsub.sweep(path, "train.clients_per_round", [], out=tmp_path / "none")
    with pytest.raises(fedsub.ConfigError, match="clients_per_round"):
        fedsub.sweep(path, "train.clients_per_round", [0], out=tmp_path / "zero")
    assert not (tmp_path / "twice").exists() and not (tmp_path / "zero").exists()


def test_run_resumes_a_stopped_run_in_its_folder(tmp_path):
    config = fedsub.Config.from_toml(CONFIG, ["train.checkpoint_every=1"])
    straight = fedsub.run(config)
    stop = {"after": False}

    def stopped_after_round_2(algorithm: str, round_index: int) -> None:
        stop["after"] = algorithm == "fedsubavg" and round_index == 2

    from fedsub.engine.loop import Interrupted

    with pytest.raises(Interrupted):
        fedsub.run(
            config,
            out=tmp_path / "run",
            on_round=stopped_after_round_2,
            stop_requested=lambda: stop["after"],
        )
    resumed = fedsub.run(config, out=tmp_path / "run", resume=True)
    assert resumed.summary == straight.summary
    assert resumed["fedavg"].model is None  # read back from its finished folder
    assert isinstance(resumed["fedsubavg"].model, Params)
    with pytest.raises(fedsub.ConfigError, match="resume=True acts on a run folder: give it"):
        fedsub.run(config, resume=True)


def test_a_user_module_gives_the_same_numbers_on_both_backends():
    dataset = two_tables_with_dense(0)
    results = {}
    for backend in ("sequential", "batched"):
        torch.manual_seed(0)
        results[backend] = fedsub.train(
            TwoBags(), dataset, backend=backend, dtype="float64", lr=0.2, **SMALL
        )
    sequential, batched = results["sequential"], results["batched"]
    assert isinstance(batched.model, TwoBags)
    for key, value in sequential.model.state_dict().items():
        torch.testing.assert_close(batched.model.state_dict()[key], value, rtol=1e-9, atol=1e-12)
    for mine, theirs in zip(sequential.history, batched.history, strict=True):
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-9)
    torch.manual_seed(0)
    untrained = TwoBags()
    assert not torch.equal(untrained.a.weight, batched.model.a.weight.float())


def test_bad_train_options_models_and_data_are_named(data):
    with pytest.raises(fedsub.ArgumentError, match=r"unknown option 'round': .*rounds"):
        fedsub.train("sparse-lr", data, round=2)
    with pytest.raises(fedsub.ArgumentError, match=r"^lr must be a number, got 'fast'$"):
        fedsub.train("sparse-lr", data, lr="fast")
    with pytest.raises(fedsub.ArgumentError, match=r"^model = 'sparse' .*sparse-lr"):
        fedsub.train("sparse", data, **SMALL)
    with pytest.raises(fedsub.ArgumentError, match="model must be a built-in model's name"):
        fedsub.train(42, data)
    with pytest.raises(
        fedsub.ArgumentError, match=r"data must be a FederatedDataset .* \(a dict\)"
    ):
        fedsub.train("sparse-lr", {"features": [1, 2]})
    with pytest.raises(fedsub.ArgumentError, match=r"^data = 'movielens' is not allowed"):
        fedsub.train("sparse-lr", "movielens")
    with pytest.raises(fedsub.ArgumentError, match=r"^algorithm = 'fedsgd' is not allowed"):
        fedsub.train("sparse-lr", data, algorithm="fedsgd", **SMALL)
    with pytest.raises(fedsub.ArgumentError, match=r"^algorithms = 'fedsgd' is not allowed"):
        fedsub.compare("sparse-lr", data, algorithms=["fedavg", "fedsgd"], **SMALL)
    with pytest.raises(fedsub.ArgumentError, match="model_options are a built-in model's"):
        fedsub.train(TwoBags(), two_tables_with_dense(0), model_options={"init_std": 0.1})
    with pytest.raises(fedsub.ArgumentError, match=r"^model_options\['embedding_dim'\] = 0 is"):
        fedsub.train("embedding-lr", data, model_options={"embedding_dim": 0}, **SMALL)
    with pytest.raises(fedsub.ArgumentError, match=r"^algorithm_options\['fedprox'\]\['mu'\]"):
        fedsub.train(
            "sparse-lr", data, algorithm="fedprox", algorithm_options={"fedprox": {"mu": -1}}
        )


def test_config_from_toml_and_from_dict_check_every_key(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nrounds = 7\n")
    assert fedsub.Config.from_toml(path).train.rounds == 7
    assert fedsub.Config.from_toml(str(path), ["train.rounds=8"]).train.rounds == 8
    assert fedsub.Config.from_toml("[train]\nrounds = 9").train.rounds == 9
    assert fedsub.Config.from_toml().train.rounds == 150  # the embedded default
    built = fedsub.Config.from_dict({"train": {"rounds": 4}, "data": {"num_users": 50}})
    assert built.train.rounds == 4 and built.data.options.num_users == 50
    assert fedsub.Config.from_toml(built.to_toml()) == built
    with pytest.raises(fedsub.ConfigError, match=r"config text: train\.rounds must be an integer"):
        fedsub.Config.from_toml('[train]\nrounds = "x"')
    with pytest.raises(fedsub.ConfigError, match=r"--set train\.lr=-1: train\.lr = -1"):
        fedsub.Config.from_toml("[train]\nrounds = 2", ["train.lr=-1"])
    with pytest.raises(fedsub.ConfigError, match=r"config file .*missing\.toml does not exist"):
        fedsub.Config.from_toml(str(tmp_path / "missing.toml"))
    with pytest.raises(fedsub.ConfigError, match=r"\[eval\] unknown key 'evry'"):
        fedsub.Config.from_dict({"eval": {"evry": 2}})


@pytest.mark.parametrize("module", ["fedsub.library", "fedsub.config", "fedsub.data.from_python"])
def test_the_docstring_examples_run(module, tmp_path, monkeypatch):
    import doctest
    import importlib

    monkeypatch.chdir(tmp_path)
    found = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert found.attempted > 0 and found.failed == 0
