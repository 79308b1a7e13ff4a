"""Central differential privacy ([dp]) on Flower: the ServerApp runs the engine's round loop,
so a Flower run with [dp] clips, noises and accounts as the in-process run with the same seed
(the same model), and reports the epsilon spent."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import Context, RecordDict
from safetensors.torch import load_file

from fedsub.flower.settings import FlowerSettings

from .test_flower import OVERRIDES
from .test_flower_heat_exchange import AppGrid

DP = ("dp.mechanism='gaussian'", "dp.noise_multiplier=0.8", "dp.clip=0.5")


def in_process_model(overrides: tuple[str, ...], name: str) -> dict[str, torch.Tensor]:
    """The run on fedsub's own engine, with [dp] resolved as ``fedsub compare`` resolves it
    (tests/test_flower.py's reference, plus the schedule's dp)."""
    from dataclasses import replace

    from fedsub import config as config_lib
    from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
    from fedsub.engine.loop import train
    from fedsub.models.registry import build_model
    from fedsub.runs.run_setup import dp_of, load_data, schedule_of
    from fedsub.submodel.index import SubmodelIndex

    config = config_lib.load(None, overrides)
    dataset = load_data(config)
    index = SubmodelIndex.build(dataset)
    model = build_model("sparse-lr", dataset, {"init_std": 0.0})
    schedule = replace(schedule_of(config), dp=dp_of(config, dataset.num_clients))
    context = AlgorithmContext(dataset, index, config.train.heat, schedule.clients_per_round)
    algorithm = build_algorithm(name, context, config.algorithm_options(name))
    return train(model, algorithm, dataset, index, schedule).state_dict()


pytestmark = pytest.mark.usefixtures("flower_task_identity")


@pytest.mark.parametrize("name", ["fedavg", "fedsubavg"])
def test_a_flower_run_with_dp_is_the_in_process_run_with_dp(tmp_path, name):
    from fedsub.flower.apps import make_client_app, make_server_app

    overrides = (*OVERRIDES, *DP, f"train.algorithms=['{name}']")
    settings = FlowerSettings(
        overrides=overrides, out_dir=str(tmp_path), round_timeout=30.0, eval_every=1
    )
    grid = AppGrid(make_client_app(settings), 6)
    make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
    flower = load_file(tmp_path / "model.safetensors")
    expected = in_process_model(overrides, name)
    for key, value in expected.items():
        torch.testing.assert_close(flower[key], value, rtol=0, atol=1e-5)
    plain = in_process_model((*OVERRIDES, f"train.algorithms=['{name}']"), name)
    assert any(not torch.allclose(v, plain[k], atol=1e-3) for k, v in expected.items())
    result = json.loads((tmp_path / "flower-result.json").read_text())
    epsilons = [result["evaluations"][r]["epsilon"] for r in ("1", "2", "3")]
    assert 0 < epsilons[0] < epsilons[1] < epsilons[2]  # spent round by round
