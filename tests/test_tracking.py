"""Experiment tracking (runs/tracking.py): what TensorBoard and MLflow hold after a run, read
back with their own readers (TensorBoard's EventAccumulator, MLflow's client on a SQLite
store), compared with the run's metrics.jsonl / history; the hooks' calls; the errors."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

import fedsub
from fedsub.errors import ArgumentError, ConfigError, FedsubError

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

SMALL = {"rounds": 3, "every": 2, "clients_per_round": 5}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One SQLite MLflow store for the module (a new store's tables take seconds to make);
    each test writes its own experiment."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'store.db'}"


def scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar TensorBoard reads from ``folder``: tag -> step -> value."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def runs_of(uri: str, experiment: str) -> list:
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    return client.search_runs([found.experiment_id])


def named(runs: list) -> dict:
    return {r.info.run_name: r for r in runs}


def history_of(uri: str, run_id: str, key: str) -> dict[int, float]:
    client = MlflowClient(tracking_uri=uri)
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def finite(history: list[dict], key: str) -> dict[int, float]:
    return {
        e["round"]: e[key] for e in history if e.get(key) is not None and not math.isnan(e[key])
    }


def test_tensorboard_and_mlflow_hold_every_evaluation_of_the_python_api(tmp_path, store):
    """``fedsub.compare(callbacks=[...])``: per algorithm, every metric of its history (the
    evaluated rounds) in TensorBoard and in one MLflow run, with the config as parameters."""
    callbacks = [
        fedsub.TensorBoardWriter(tmp_path / "tb"),
        fedsub.MlflowWriter(store, experiment="api"),
    ]
    result = fedsub.compare(
        "sparse-lr", "synthetic-sparse", algorithms=["fedavg", "fedsubavg"], callbacks=callbacks,
        **SMALL,
    )  # fmt: skip
    runs = named(runs_of(store, "api"))
    assert sorted(runs) == ["fedavg", "fedsubavg"]
    for name, trained in result.items():
        board = scalars(tmp_path / "tb" / name)
        for key in ("train_loss", "test_auc", "test_loss", "elapsed"):
            expected = finite(trained.history, key)
            assert sorted(expected) == [0, 2, 3]
            assert board[key] == pytest.approx(expected, rel=1e-6)  # TensorBoard keeps float32
            assert history_of(store, runs[name].info.run_id, key) == expected
        assert set(board["round_wall_seconds"]) == {1, 2, 3}  # every round, evaluated or not
        run = runs[name]
        assert run.data.params["train.rounds"] == "3"
        assert run.data.params["train.clients_per_round"] == "5"
        assert run.data.tags["fedsub.algorithm"] == name
        assert run.data.tags["fedsub.status"] == "finished" and run.info.status == "FINISHED"


def test_the_config_tracking_section_writes_into_the_run_folder(tmp_path):
    """``[tracking]`` with its defaults: each algorithm's events in <out>/<algorithm>/tensorboard,
    one MLflow store <out>/mlflow.db, both listed in run.json's manifest, and a run named
    ``run_name`` + algorithm; the numbers are metrics.jsonl's."""
    out = tmp_path / "run"
    config = {
        "train": {"rounds": 2, "algorithms": ["fedsubavg"], "clients_per_round": 5},
        "eval": {"every": 1},
        "tracking": {"tensorboard": True, "mlflow": True, "run_name": "trial-"},
    }
    fedsub.run(config, out=out)
    lines = [json.loads(x) for x in (out / "fedsubavg" / "metrics.jsonl").read_text().split("\n")
             if x]  # fmt: skip
    board = scalars(out / "fedsubavg" / "tensorboard")
    assert board["train_loss"] == pytest.approx(finite(lines, "train_loss"), rel=1e-6)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    run = named(runs_of(uri, "fedsub"))["trial-fedsubavg"]
    assert history_of(uri, run.info.run_id, "test_auc") == finite(lines, "test_auc")
    manifest = json.loads((out / "run.json").read_text())["outputs"]
    assert {"mlflow.db", "fedsubavg/tensorboard/", "fedsubavg/tensorboard/events.*"} <= set(
        manifest
    )
    assert "tensorboard = true" in (out / "config.toml").read_text()


class Recorder(fedsub.RunCallback):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_train_begin(self, run):
        self.calls.append(("begin", run.algorithm, run.resumed_after))

    def after_round(self, run, round_index, metrics):
        self.calls.append(("round", round_index, dict(metrics)))

    def on_train_end(self, run, status):
        self.calls.append(("end", status))


def test_a_resumed_run_continues_the_curves_where_its_checkpoint_left(tmp_path, store):
    """A run that fails after round 3 (its checkpoint: round 2), resumed: TensorBoard's curves
    hold each round once, with metrics.jsonl's values (the failed attempt's round 3 purged);
    MLflow has the failed attempt and the resumed one, which holds every evaluation; a
    callback sees the round the resume continues after."""
    out = tmp_path / "run"
    config = {
        "train": {"rounds": 4, "algorithms": ["fedavg"], "clients_per_round": 5,
                  "checkpoint_every": 2},
        "eval": {"every": 1},
        "tracking": {"tensorboard": True, "mlflow": True, "mlflow_uri": store,
                     "mlflow_experiment": "resume"},
    }  # fmt: skip

    def crash(name: str, round_index: int) -> None:
        if round_index == 3:
            raise RuntimeError("the machine went away")

    with pytest.raises(RuntimeError, match="went away"):
        fedsub.run(config, out=out, on_round=crash)
    first = scalars(out / "fedavg" / "tensorboard")["train_loss"]
    assert sorted(first) == [0, 1, 2, 3]
    recorder = Recorder()
    fedsub.run(config, out=out, resume=True, callbacks=[recorder])
    lines = [json.loads(x) for x in (out / "fedavg" / "metrics.jsonl").read_text().split("\n")
             if x]  # fmt: skip
    board = scalars(out / "fedavg" / "tensorboard")
    assert sorted(board["train_loss"]) == [0, 1, 2, 3, 4]
    assert board["train_loss"] == pytest.approx(finite(lines, "train_loss"), rel=1e-6)
    runs = runs_of(store, "resume")
    by_status = {r.data.tags["fedsub.status"]: r for r in runs}
    assert sorted(by_status) == ["failed", "finished"]
    assert by_status["failed"].info.status == "FAILED"
    resumed = by_status["finished"]
    assert resumed.data.tags["fedsub.resumed_after"] == "2"
    assert history_of(store, resumed.info.run_id, "train_loss") == finite(lines, "train_loss")
    assert recorder.calls[0] == ("begin", "fedavg", 2)
    assert [c[1] for c in recorder.calls if c[0] == "round"] == [0, 1, 2, 3, 4]
    assert recorder.calls[-1] == ("end", "finished")


def test_a_callback_sees_every_round_and_epsilon_under_dp():
    """Rounds 1..R each once, in order, after round 0's evaluation; under [dp] every round
    carries the epsilon spent so far, equal to the evaluation's where one was made."""
    recorder = Recorder()
    result = fedsub.train(
        "sparse-lr", "synthetic-sparse", rounds=3, every=2, clients_per_round=5,
        dp={"mechanism": "gaussian", "noise_multiplier": 1.0, "randomness": "seeded"},
        callbacks=[recorder],
    )  # fmt: skip
    rounds = [c for c in recorder.calls if c[0] == "round"]
    assert [r for _, r, _ in rounds] == [0, 1, 2, 3]
    assert all("epsilon" in m for _, r, m in rounds)
    epsilons = [m["epsilon"] for _, _, m in rounds]
    assert epsilons == sorted(epsilons) and epsilons[-1] > 0
    for evaluation in result.history:
        (metrics,) = [m for _, r, m in rounds if r == evaluation["round"]]
        assert metrics["epsilon"] == evaluation["epsilon"]
        assert metrics["train_loss"] == evaluation["train_loss"]
    assert recorder.calls[0][0] == "begin" and recorder.calls[-1] == ("end", "finished")


def test_a_diverged_run_ends_its_trackers_with_its_status():
    recorder = Recorder()
    result = fedsub.train(
        "sparse-lr", "synthetic-sparse", rounds=3, every=1, clients_per_round=5, lr=1e30,
        callbacks=[recorder],
    )  # fmt: skip
    assert result.diverged is not None
    assert recorder.calls[-1] == ("end", "diverged")
    last = [c for c in recorder.calls if c[0] == "round"][-1]
    assert last[1] == result.history[-1]["round"]  # the evaluation that diverged, sent


def test_tracking_changes_no_number(tmp_path):
    plain = fedsub.train("sparse-lr", "synthetic-sparse", **SMALL)
    tracked = fedsub.train(
        "sparse-lr", "synthetic-sparse", callbacks=[fedsub.TensorBoardWriter(tmp_path)], **SMALL
    )
    for mine, theirs in zip(plain.history, tracked.history, strict=True):
        assert {**mine, "elapsed": 0} == {**theirs, "elapsed": 0}
    for name, tensor in plain.params.state_dict().items():
        assert tensor.equal(tracked.params.state_dict()[name])


@pytest.mark.parametrize(
    ("module", "writer", "extra"),
    [
        ("torch.utils.tensorboard", "TensorBoardWriter", "tensorboard"),
        ("mlflow.tracking", "MlflowWriter", "mlflow-skinny"),
    ],
)
def test_a_missing_library_names_the_extra_to_install(monkeypatch, module, writer, extra):
    monkeypatch.setitem(sys.modules, module, None)  # import fails
    with pytest.raises(FedsubError, match=rf"needs the {extra} package.*fedsub\[tracking\]"):
        getattr(fedsub, writer)()
    tracking = (
        {"tensorboard": True, "tensorboard_dir": "unused"}
        if extra == "tensorboard"
        else {"mlflow": True, "mlflow_uri": "sqlite:///unused.db"}
    )
    with pytest.raises(FedsubError, match=r"fedsub\[tracking\]"):
        fedsub.train("sparse-lr", "synthetic-sparse", tracking=tracking, **SMALL)


def test_bad_tracking_input_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"\[tracking\] unknown key 'tensorbord'"):
        fedsub.Config.from_dict({"tracking": {"tensorbord": True}})
    with pytest.raises(ConfigError, match=r"tracking\.mlflow must be true or false"):
        fedsub.Config.from_dict({"tracking": {"mlflow": "yes"}})
    with pytest.raises(ConfigError, match=r"set tracking\.tensorboard_dir"):
        fedsub.train("sparse-lr", "synthetic-sparse", tracking={"tensorboard": True}, **SMALL)
    with pytest.raises(ConfigError, match=r"set tracking\.mlflow_uri"):
        fedsub.train("sparse-lr", "synthetic-sparse", tracking={"mlflow": True}, **SMALL)
    with pytest.raises(ArgumentError, match=r"callbacks\[1\] must be a fedsub\.RunCallback"):
        fedsub.train("sparse-lr", "synthetic-sparse", callbacks=[Recorder(), print], **SMALL)
    with pytest.raises(ArgumentError, match=r"give \[Recorder\(...\)\]"):
        fedsub.train("sparse-lr", "synthetic-sparse", callbacks=Recorder(), **SMALL)


@pytest.mark.usefixtures("flower_task_identity")
def test_flowers_server_app_feeds_the_trackers_its_rounds_and_evaluations(tmp_path):
    """The ServerApp over in-process nodes, with ``[tracking] tensorboard`` in its out-dir and a
    callback: every round's record (replies, bytes sent) and the federated evaluations, the
    numbers of progress.jsonl and flower-result.json."""
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict

    from fedsub.flower.apps import make_client_app, make_server_app
    from fedsub.flower.settings import FlowerSettings, Output, Replies

    from .test_flower_heat_exchange import AppGrid

    out = tmp_path / "out"
    settings = FlowerSettings(
        overrides=("data.num_users=4", "train.clients_per_round=2", "train.rounds=2",
                   "train.algorithms=['fedsubavg']", "tracking.tensorboard=true"),
        eval_every=1,
        output=Output(out_dir=str(out)),
        replies=Replies(round_timeout=30.0),
    )  # fmt: skip
    recorder = Recorder()
    grid = AppGrid(make_client_app(settings), 4)
    make_server_app(settings, [recorder])(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
    result = json.loads((out / "flower-result.json").read_text())
    rounds = {r: m for kind, r, m in (c for c in recorder.calls if c[0] == "round")}
    assert sorted(rounds) == [1, 2]
    for record in result["rounds"]:
        metrics = rounds[record["round"]]
        assert metrics["replies"] == record["replies"]
        assert metrics["train_arrays_bytes_sent"] == record["train_arrays_bytes_sent"]
    board = scalars(out / "tensorboard")
    assert sorted(result["evaluations"]) == ["1", "2"]
    for r, evaluation in result["evaluations"].items():
        for key, value in evaluation.items():
            if value is not None and not math.isnan(value):
                assert rounds[int(r)][key] == value
                assert board[key][int(r)] == pytest.approx(value, rel=1e-6)
    assert recorder.calls[0] == ("begin", "fedsubavg", 0)
    assert recorder.calls[-1] == ("end", "finished")
    manifest = json.loads((out / "run.json").read_text())["outputs"]
    assert {"tensorboard/", "tensorboard/events.*"} <= set(manifest)
