"""``--profile``: the phases of a round are timed, nest by self time, cover the round, and are
written to the run folder; without a profile nothing is timed (fedsub/profiling.py)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from fedsub import profiling
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.cli import main
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.models.registry import build_model
from fedsub.profiling import ROUND, RoundProfile, timed
from fedsub.profiling import profiling as recording

from .test_resume_matrix import OPTIONS, dataset_for

ROUND_PHASES = {"cohort", "pull", "push", "aggregation", "server step", "checkpoint", "other"}
STEP_PHASES = {"forward", "backward", "client rule"}


def test_a_phase_counts_its_own_time_not_its_childrens(monkeypatch):
    clock = iter([0.0, 1.0, 4.0, 10.0, 12.0, 20.0, 21.0, 23.0])  # perf_counter's readings
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: next(clock))
    synced = []
    profile = RoundProfile(synchronize=lambda: synced.append(1))
    with recording(profile):
        # a round 0 .. 20, its pull 1 .. 12, of which 4 .. 10 in forward
        with timed(ROUND), timed("pull"), timed("forward"):
            pass
        with timed("evaluation"):  # 21 .. 23, outside every round
            pass
    assert profile.seconds == {"forward": 6.0, "pull": 5.0, ROUND: 9.0}
    assert profile.outside == {"evaluation": 2.0}
    assert len(synced) == 2 * 4  # entering and leaving each phase
    record = profile.as_json()
    assert record["seconds"] == 20.0 and record["phases"]["other"]["seconds"] == 9.0


def test_nothing_is_timed_without_a_profile():
    assert timed("forward") is timed("backward")  # one shared do-nothing context
    with timed("forward"):
        pass


@pytest.mark.parametrize("backend", ["batched", "sequential"])
def test_a_profiled_runs_phases_cover_its_rounds(backend, tmp_path):
    dataset, index = dataset_for("din", str(tmp_path))
    model = build_model("din", dataset, {**OPTIONS, "widths": []})
    algorithm = build_algorithm("fedsubavg", AlgorithmContext(dataset, index, "samples", 3))
    schedule = Schedule(
        4,
        3,
        LocalWork(2, 2, ClientStep(0.1, clip_norm=1.0)),
        0,
        execution=Execution(backend=backend),
        eval_every=2,
    )
    evaluator = Evaluator.build(model, dataset, 20, 0)
    profile = RoundProfile()
    started = time.perf_counter()
    with recording(profile):
        trained = train(model, algorithm, dataset, index, schedule, evaluator)
    wall = time.perf_counter() - started
    unprofiled = train(model, algorithm, dataset, index, schedule, evaluator)
    for name, tensor in trained.state_dict().items():  # profiling changes no number
        assert torch.equal(tensor, unprofiled.state_dict()[name]), name

    record = profile.as_json()
    phases = record["phases"]
    assert record["rounds"] == 4
    assert ROUND_PHASES | STEP_PHASES | {"evaluation"} <= set(phases)
    assert phases["forward"]["calls"] == 4 * 2 * (3 if backend == "sequential" else 1)
    assert phases["evaluation"]["calls"] == 2  # rounds 2 and 4; round 0's is outside
    assert set(record["outside_rounds"]) == {"evaluation"}
    # the phases add up to the rounds' time, which is the run's time less its set-up
    assert sum(p["seconds"] for p in phases.values()) == pytest.approx(record["seconds"])
    assert sum(p["share"] for p in phases.values()) == pytest.approx(1.0)
    timed_in_all = record["seconds"] + sum(record["outside_rounds"].values())
    assert timed_in_all <= wall
    assert phases["other"]["seconds"] < 0.5 * record["seconds"]  # the phases cover the round


def test_compare_profile_writes_each_algorithms_profile(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "compare",
            "--set",
            "train.rounds=2",
            "--set",
            "eval.every=2",
            "--algorithms",
            "fedavg,fedsubavg",
            "--profile",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    for name in ("fedavg", "fedsubavg"):
        record = json.loads((out / name / "profile.json").read_text())
        assert record["rounds"] == 2 and "aggregation" in record["phases"]
        assert f"{name}: 2 rounds" in printed
    assert "server step" in printed
