"""A run whose loss blows up stops as diverged, even when every number stays finite."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.cli import main
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.guards import divergence_reason
from fedsub.engine.in_process import train
from fedsub.engine.loop import Diverged, RunControl
from fedsub.models.mlp import MLP
from fedsub.submodel.index import SubmodelIndex
from tests.test_masking import _schedule, dense_dataset

from .conftest import TINY_COMPARISON

TINY = (
    TINY_COMPARISON
    + """
[algorithms.fedavg]
lr = {lr}

[eval]
every = 2
train_loss_samples = 200
target_train_loss = 0.695
"""
)


def strict_json(text: str):
    """json.loads that refuses the bare NaN / Infinity Python's json would accept."""

    def refuse(constant: str):
        raise AssertionError(f"invalid JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_the_rule_nan_inf_and_k_times_the_initial_loss():
    assert divergence_reason(math.nan, 0.7, 10) == "the train loss became NaN"
    assert divergence_reason(math.inf, 0.7, 10) == "the train loss became infinite"
    assert divergence_reason(math.inf, None, 0) == "the train loss became infinite"
    assert divergence_reason(6.9, 0.7, 10) is None
    assert "7.1 > 10 x the round-0 train loss 0.7" in divergence_reason(7.1, 0.7, 10)
    assert divergence_reason(1e9, 0.7, 0) is None  # factor 0: only NaN / Inf
    assert divergence_reason(5.0, 0.0, 10) is None  # no positive round-0 loss to compare to


@pytest.mark.parametrize("lr", ["1e6", "1e30"])
def test_sparse_lr_blow_up_is_recorded_and_the_other_algorithm_still_runs(tmp_path, lr, capsys):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.replace("{lr}", lr))
    out = tmp_path / "out"
    assert main(["compare", str(config), "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("fedsub: error: fedavg diverged at round 2 (")
    assert "fedsubavg" not in last
    summary = strict_json((out / "summary.json").read_text())
    fedavg = summary["algorithms"]["fedavg"]
    assert fedavg["diverged"]["round"] == 2 and fedavg["rounds_to_target"] is None
    loss = fedavg["final"]["train_loss"]
    assert loss is None or loss > 10 * 0.69  # null when it overflowed to Inf
    assert summary["algorithms"]["fedsubavg"]["diverged"] is None
    assert (out / "fedsubavg" / "done").exists() and not (out / "fedavg" / "done").exists()
    assert "diverged at round 2" in (out / "summary.md").read_text()
    assert (out / "curves.png").exists()
    lines = (out / "fedavg" / "metrics.jsonl").read_text().splitlines()
    assert [strict_json(line)["round"] for line in lines] == [0, 2]


def test_masked_mlp_blow_up_stops_naming_algorithm_round_loss_and_rule():
    dataset = dense_dataset()
    model = MLP(inputs=16, classes=3, hidden=(12, 8))
    index = SubmodelIndex.build(dataset)
    algorithm = build_algorithm("fedavg", AlgorithmContext(dataset, index, "samples", 4))
    masked = _schedule("static", rounds=4)
    too_fast = dataclasses.replace(masked.client_step, lr=50.0)
    local = dataclasses.replace(masked.local, client_step=too_fast)
    schedule = dataclasses.replace(masked, local=local, eval_every=1)
    evaluator = Evaluator.build(model, dataset, 1000, 0)
    with pytest.raises(Diverged) as error:
        train(
            model,
            algorithm,
            dataset,
            index,
            schedule,
            evaluator,
            control=RunControl(divergence_factor=10),
        )
    assert error.value.round == 1 and math.isfinite(float(error.value.reason.split()[2]))
    message = str(error.value)
    assert message.startswith("fedavg: train loss ")
    assert "> 10 x the round-0 train loss" in message and "at round 1" in message
    assert "no checkpoint was written yet" in message


def test_a_sweep_records_the_diverged_value_and_exits_1(tmp_path, capsys):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.replace("{lr}", "0.2"))
    out = tmp_path / "sweep"
    argv = ["compare", str(config), "--algorithms", "fedavg", "--out", str(out), "--quiet"]
    assert main([*argv, "--sweep", "algorithms.fedavg.lr=0.2,1e6"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("fedsub: error: fedavg (algorithms.fedavg.lr=1e6) diverged at round 2")
    result = strict_json((out / "sweep.json").read_text())
    assert result["rounds_to_target"]["fedavg"]["1e6"] is None
    assert result["diverged"]["fedavg"]["1e6"]["round"] == 2
    assert result["diverged"]["fedavg"]["0.2"] is None
    assert "| fedavg | 0 | diverged at round 2 |" in (out / "sweep.md").read_text()
