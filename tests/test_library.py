"""Training from Python (fedsub.library, ``fedsub.train`` / ``fedsub.compare``): a user's
nn.Module and an in-memory dataset run through the engine's round loop, with the config's keys
checked as a config file's."""

from __future__ import annotations

import pytest
import torch

from fedsub.engine.evaluate import Evaluator
from fedsub.engine.in_process import train as engine_train
from fedsub.errors import ArgumentError, ConfigError
from fedsub.library import compare, train
from fedsub.models.torch_module import wrap
from fedsub.submodel.index import SubmodelIndex

from .equivalence import algorithm_for
from .test_backends import two_tables_with_dense
from .torch_modules import TwoBags

SMALL = {"rounds": 4, "clients_per_round": 3, "local_steps": 2, "batch_size": 3, "lr": 0.2}


def module() -> TwoBags:
    torch.manual_seed(0)
    return TwoBags()


def test_a_module_trains_as_the_engine_trains_it_and_comes_back_trained():
    dataset = two_tables_with_dense(0)
    run = train(module(), dataset, algorithm="fedsubavg", dtype="float64", every=2, **SMALL)
    assert [e["round"] for e in run.history] == [0, 2, 4]
    assert {"train_loss", "test_loss", "test_auc", "elapsed"} <= set(run.history[0])
    model = wrap(module(), dataset)
    index = SubmodelIndex.build(dataset)
    from fedsub.config import parse
    from fedsub.runs.run_setup import schedule_of

    schedule = schedule_of(parse({"train": {**SMALL, "dtype": "float64"}, "eval": {"every": 2}}))
    direct = engine_train(
        model, algorithm_for("fedsubavg", dataset, index, 3), dataset, index, schedule
    )
    for key, value in direct.state_dict().items():
        assert torch.equal(run.params.state_dict()[key], value), key
    trained = run.model
    assert isinstance(trained, TwoBags)
    assert torch.equal(trained.a.weight, direct.tables["a"].float())
    evaluator = Evaluator.build(model, dataset, 10_000, 0)
    assert evaluator.evaluate(direct)["train_loss"] == pytest.approx(run.history[-1]["train_loss"])


def test_a_comparison_runs_each_algorithm_from_the_same_start():
    dataset = two_tables_with_dense(0)
    runs = compare(module(), dataset, algorithms=["fedavg", "fedsubavg"], **SMALL)
    assert list(runs) == ["fedavg", "fedsubavg"]
    assert runs["fedavg"].history[0]["train_loss"] == runs["fedsubavg"].history[0]["train_loss"]
    assert not torch.equal(runs["fedavg"].params.tables["a"], runs["fedsubavg"].params.tables["a"])


def test_options_are_checked_as_a_config_files_keys():
    dataset = two_tables_with_dense(0)
    with pytest.raises(ConfigError, match=r"unknown option 'round': expected a .train. key"):
        train(module(), dataset, round=3)
    with pytest.raises(ArgumentError, match=r"^lr = -1.0 is out of range; expected > 0.0$"):
        train(module(), dataset, lr=-1.0)
    with pytest.raises(ConfigError, match=r"^clients_per_round = 50 is more than the"):
        train(module(), dataset, rounds=1)
    with pytest.raises(ConfigError, match="needs a width-sliceable model; TorchModuleModel"):
        train(module(), dataset, masking="static", **SMALL)
    mu = {"fedprox": {"mu": 0.5}}
    run = train(module(), dataset, algorithm="fedprox", algorithm_options=mu, **SMALL)
    assert run.diverged is None and len(run.history) == 2
