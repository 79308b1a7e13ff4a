"""examples/two-tower: the script runs (smoke size), and FedSubAvg's heat coefficients act on
the plain nn.Module's embedding rows: from the same weights, one round of FedSubAvg moves each
row by exactly its heat coefficient times FedAvg's move, and the dense towers alike.

The full-size claim (FedSubAvg beats FedAvg: test AUC and train loss after 300 rounds) is
measured by the script itself and reported in examples/two-tower/README.md."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.models.torch_module import wrap
from fedsub.submodel.index import SubmodelIndex

from .equivalence import algorithm_for

EXAMPLE = Path(__file__).parents[1] / "examples" / "two-tower"


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    spec = importlib.util.spec_from_file_location("two_tower_train", EXAMPLE / "train.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    import two_tower

    return script, two_tower


def test_the_script_trains_both_algorithms_plots_and_saves_the_module(example, tmp_path):
    script, _ = example
    runs = script.main(["--rounds", "2", "--users", "24", "--out", str(tmp_path)])
    assert (tmp_path / "curves.png").stat().st_size > 0
    histories = json.loads((tmp_path / "histories.json").read_text())
    assert [e["round"] for e in histories["fedsubavg"]] == [0, 2]
    state = torch.load(tmp_path / "two_tower.pt")
    assert torch.equal(state["item.weight"], runs["fedsubavg"].params.tables["item"].float())


def test_fedsubavg_moves_each_row_by_its_heat_coefficient_times_fedavgs_move(example):
    _, two_tower = example
    data = two_tower.clicks(users=40, items=120, seed=1)
    rows = data.table_rows
    torch.manual_seed(0)
    module = two_tower.TwoTower(rows["user"], rows["age"], rows["item"], rows["category"])
    model = wrap(module, data)
    index = SubmodelIndex.build(data)
    schedule = Schedule(
        1,
        10,
        local=LocalWork(3, 4, ClientStep(lr=0.2)),
        seed=0,
        execution=Execution(dtype=torch.float64),
    )
    start = initial_params(model, schedule)
    moved, coefficients = {}, {}
    for name in ("fedavg", "fedsubavg"):
        algorithm = algorithm_for(name, data, index, 10)
        params = train(model, algorithm, data, index, schedule)
        moved[name] = {k: v - start.state_dict()[k] for k, v in params.state_dict().items()}
        coefficients[name] = algorithm.aggregation.coefficients
    assert coefficients["fedavg"] is None
    for table in rows:
        heat = coefficients["fedsubavg"][table].unsqueeze(1)
        fedavg, fedsubavg = moved["fedavg"][f"table.{table}"], moved["fedsubavg"][f"table.{table}"]
        torch.testing.assert_close(fedsubavg, heat * fedavg, rtol=1e-9, atol=1e-12)
    touched = moved["fedavg"]["table.user"].abs().sum(1) > 0
    assert touched.any() and (coefficients["fedsubavg"]["user"][touched] > 1).all()
    for name, value in moved["fedavg"].items():
        if name.startswith("dense."):
            torch.testing.assert_close(moved["fedsubavg"][name], value, rtol=1e-9, atol=1e-12)
