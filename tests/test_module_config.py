"""A user's nn.Module named in a config file (``[model] name = "torch-module"``,
``module = "package.module:factory"``, models/module_spec.py): the command line trains what
``fedsub.train`` trains from the module object, on both backends; every algorithm and every
privacy level runs with it; torchrun's two processes give the one process's model. (The
Flower apps: tests/test_flower.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fedsub
from fedsub.algorithms.registry import algorithm_names
from fedsub.cli import commands as cli
from fedsub.errors import ConfigError
from fedsub.models.torch_module import wrap
from fedsub.numerics import secret_streams
from fedsub.numerics.seeding import Secret
from fedsub.privacy.levels import LEVELS

from .test_distributed import TOLERANCE, torchrun
from .torch_modules import ANY_DATA, FLOAT64_HEAD, AnyData

ROOT = Path(__file__).parents[1]  # on PYTHONPATH, `tests.torch_modules` imports
DATA = {"name": "synthetic-sparse", "num_users": 12, "num_items": 15, "seed": 1}
TRAIN = {"rounds": 2, "clients_per_round": 3, "local_steps": 2, "batch_size": 4, "lr": 0.3}
MODEL = {"name": "torch-module", "module": ANY_DATA, "arguments": {"dim": 2}, "init_seed": 7}


def toml(algorithms: list[str], backend: str) -> str:
    """The config file: the module by its path, a tiny federation."""
    train = "\n".join(f"{k} = {v}" for k, v in TRAIN.items())
    return f"""
[data]
name = "synthetic-sparse"
num_users = 12
num_items = 15
seed = 1

[model]
name = "torch-module"
module = "{ANY_DATA}"
arguments = {{ dim = 2 }}
init_seed = 7

[train]
algorithms = {json.dumps(algorithms)}
backend = "{backend}"
{train}

[eval]
every = 1
"""


def module_object(dataset) -> AnyData:
    """What a Python user builds: the factory under the config's seed."""
    torch.manual_seed(MODEL["init_seed"])
    return AnyData(dataset, dim=2)


def dataset():
    options = {k: v for k, v in DATA.items() if k not in ("name", "seed")}
    return fedsub.load_dataset(DATA["name"], seed=DATA["seed"], **options)


def without_time(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in entry.items() if k != "elapsed"} for entry in history]


@pytest.mark.parametrize("backend", ["sequential", "batched"])
def test_the_command_line_trains_what_fedsub_train_trains_from_the_module(tmp_path, backend):
    algorithms = ["fedsubavg", "fedavg"]
    config = tmp_path / "module.toml"
    config.write_text(toml(algorithms, backend))
    out = tmp_path / "out"
    assert cli.main(["compare", str(config), "--out", str(out), "--quiet"]) == 0

    data = dataset()
    runs = fedsub.compare(
        module_object(data), data, algorithms=algorithms, backend=backend, every=1, **TRAIN
    )
    for name in algorithms:
        saved = load_file(out / name / "model.safetensors")
        expected = runs[name].params
        assert expected is not None
        assert saved.keys() == expected.state_dict().keys()
        for key, value in expected.state_dict().items():
            assert torch.equal(saved[key], value), (name, key)
        lines = (out / name / "metrics.jsonl").read_text().splitlines()
        history = [json.loads(line) for line in lines]
        assert without_time(history) == without_time(runs[name].history)
        assert history[-1]["train_loss"] < history[0]["train_loss"]  # it trained


@pytest.mark.parametrize("algorithm", algorithm_names())
def test_every_algorithm_trains_the_module_named_in_a_config(algorithm):
    config = fedsub.Config.from_dict(
        {"data": DATA, "model": MODEL, "train": {**TRAIN, "rounds": 1, "algorithms": [algorithm]}}
    )
    result = fedsub.run(config)[algorithm]
    assert result.diverged is None and result.params is not None
    data = dataset()
    initial = wrap(module_object(data), data).init(torch.Generator(), torch.float32).state_dict()
    moved = [not torch.equal(v, initial[k]) for k, v in result.params.state_dict().items()]
    assert all(torch.isfinite(v).all() for v in result.params.tensors())
    assert any(moved)


@pytest.mark.parametrize("privacy", LEVELS)
def test_each_privacy_level_trains_the_module_named_in_a_config(privacy):
    private = {"privacy": privacy, "secagg_group": 6}  # secure sums over 6 of the 12 clients
    train = {**TRAIN, **private, "algorithms": ["fedsubavg"]}
    config = fedsub.Config.from_dict({"data": DATA, "model": MODEL, "train": train})
    pinned = Secret.fresh()  # the clients' request secret, the same for both runs
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(secret_streams, "draw_secret", lambda: pinned)
        result = fedsub.run(config)["fedsubavg"]
        data = dataset()
        direct = fedsub.train(module_object(data), data, **private, **TRAIN)
    assert result.params is not None and direct.params is not None
    for key, value in direct.params.state_dict().items():
        assert torch.equal(result.params.state_dict()[key], value), key
    assert math.isfinite(result.history[-1]["train_loss"])
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({}, r"model\.module is required .* 'package\.module:factory'"),
        ({"module": "tests.torch_modules"}, r"model\.module = 'tests\.torch_modules' is not"),
        ({"module": "tests.nowhere:AnyData"}, r"cannot import module 'tests\.nowhere'"),
        ({"module": ANY_DATA, "arguments": {"width": 3}}, r"model\.arguments \(width\)"),
        ({"module": ANY_DATA, "tables": {"features": "out"}}, r"module 'out' .* is a Linear"),
        ({"module": ANY_DATA, "tables": {"features": 3}}, r"model\.tables\.features must be a"),
    ],
)
def test_a_bad_module_key_is_named(model, message):
    with pytest.raises(ConfigError, match=message):
        config = fedsub.Config.from_dict(
            {"data": DATA, "model": {"name": "torch-module", **model}, "train": TRAIN}
        )
        fedsub.run(config)


def test_a_config_modules_forward_is_checked_in_the_configs_dtype():
    model = {"name": "torch-module", "module": FLOAT64_HEAD}
    train = {**TRAIN, "algorithms": ["fedsubavg"], "rounds": 1}
    config = fedsub.Config.from_dict({"data": DATA, "model": model, "train": train})
    with pytest.raises(
        ConfigError, match=r"trains it in float32 .execution.dtype = 'float32'.*float64"
    ):
        fedsub.run(config)
    wide = {**train, "dtype": "float64"}
    config = fedsub.Config.from_dict({"data": DATA, "model": model, "train": wide})
    assert fedsub.run(config)["fedsubavg"].diverged is None


def test_tables_say_which_module_holds_a_table_whose_name_it_does_not_bear():
    train = {**TRAIN, "algorithms": ["fedsubavg"]}
    renamed = {**MODEL, "arguments": {"dim": 2, "prefix": "emb_"}}
    with pytest.raises(ConfigError, match=r"no embedding module is named after .* 'features'"):
        fedsub.run(fedsub.Config.from_dict({"data": DATA, "model": renamed, "train": train}))
    given = {**renamed, "tables": {"features": "tables.emb_features"}}
    runs = [
        fedsub.run(fedsub.Config.from_dict({"data": DATA, "model": m, "train": train}))
        for m in (given, MODEL)
    ]
    mapped, found = (r["fedsubavg"].params for r in runs)
    assert mapped is not None and found is not None
    assert mapped.state_dict().keys() == found.state_dict().keys()
    for key, value in found.state_dict().items():  # the same weights, as rows and as dense
        assert torch.equal(mapped.state_dict()[key], value), key


def test_torchrun_trains_the_module_by_its_path_as_one_process(tmp_path):
    config = tmp_path / "module.toml"
    config.write_text(toml(["fedsubavg"], "batched"))
    one, two = tmp_path / "one", tmp_path / "two"
    assert cli.main(["compare", str(config), "--out", str(one), "--quiet"]) == 0
    done = torchrun(tmp_path, "compare", str(config), "--out", str(two), "--quiet", path=ROOT)
    assert done.returncode == 0, done.stderr
    alone, split = (load_file(f / "fedsubavg" / "model.safetensors") for f in (one, two))
    assert alone.keys() == split.keys()
    tolerance = TOLERANCE[torch.float32]  # a share of the cohort's batched loss rounds apart
    for key, value in alone.items():
        torch.testing.assert_close(split[key], value, rtol=tolerance, atol=tolerance, msg=key)


def test_the_module_keys_survive_the_run_folders_config_toml():
    """A run folder keeps the resolved config as TOML (resume and reruns read it back)."""
    model = {**MODEL, "arguments": {"dim": 2, "names": ["a.b"], "nested": {"k": 1.5}}}
    config = fedsub.Config.from_dict({"model": {**model, "tables": {"features": "x.y"}}})
    assert fedsub.Config.from_toml(config.to_toml()).model == config.model
