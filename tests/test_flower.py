"""fedsub on Flower: the simulation runtime against the in-process engine, and a real
SuperLink with three SuperNodes: a ServerApp killed and resumed, a node killed mid-round and
replaced."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fedsub
from fedsub import config as config_lib
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.engine.features import assembly
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.flower.settings import FlowerSettings, Output, Replies
from fedsub.models.registry import build_model
from fedsub.runs.run_setup import load_data, model_of, schedule_of
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params

from .processes import (
    FEDSUB_SUPERNODE,
    Processes,
    descendants,
    flower_env,
    free_ports,
    port_open,
    wait_for,
)
from .torch_modules import ANY_DATA

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "flower-fedsubavg"
BIN = Path(sys.executable).parent
OVERRIDES = (
    "data.num_users=6",
    "train.rounds=3",
    "train.clients_per_round=3",
    "train.algorithms=['fedsubavg']",
    "train.lr_schedule='exponential'",
)


def in_process_model(
    overrides: tuple[str, ...], name: str = "fedsubavg"
) -> dict[str, torch.Tensor]:
    """The same run on fedsub's own engine (sequential backend)."""
    config = config_lib.load(None, overrides)
    dataset = load_data(config)
    index = SubmodelIndex.build(dataset)
    model = build_model("sparse-lr", dataset, {"init_std": 0.0})
    schedule = schedule_of(config)
    context = AlgorithmContext(dataset, index, config.train.heat, schedule.clients_per_round)
    algorithm = build_algorithm(name, context, config.algorithm_options(name))
    return train(model, algorithm, dataset, index, schedule).state_dict()


def test_flower_simulation_gives_the_in_process_engines_model(tmp_path):
    from flwr.simulation import run_simulation

    from fedsub.flower.apps import make_client_app, make_server_app

    overrides = OVERRIDES
    expected = in_process_model(overrides)
    out = tmp_path / "out"
    settings = FlowerSettings(overrides=overrides, output=Output(out_dir=str(out)))
    run_simulation(
        server_app=make_server_app(settings),
        client_app=make_client_app(settings),
        num_supernodes=6,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    flower = load_file(out / "model.safetensors")
    for name, value in expected.items():
        torch.testing.assert_close(flower[name], value, rtol=0, atol=1e-5)
    assert float(flower["table.features"].abs().sum()) > 0  # it trained
    result = json.loads((out / "flower-result.json").read_text())
    assert [r["replies"] for r in result["rounds"]] == [3, 3, 3]
    # Each node received only its rows: far fewer bytes than three full tables per round.
    full_tables = 3 * flower["table.features"].numel() * 4
    assert all(r["train_arrays_bytes_sent"] < full_tables / 5 for r in result["rounds"])


@pytest.mark.usefixtures("flower_task_identity")
def test_server_adam_on_flower_gives_the_in_process_engines_model(tmp_path):
    """fedsubavg-adam (heat coefficients and Reddi et al.'s full-model server Adam): the real
    ServerApp and ClientApp, called as Flower calls them, on an in-process grid of six nodes
    (Flower's own runtime runs the test above; a second Ray start would add 15 s)."""
    from flwr.app import Context, RecordDict

    from fedsub.flower.apps import make_client_app, make_server_app

    from .test_flower_heat_exchange import AppGrid

    overrides = (*OVERRIDES, "train.algorithms=['fedsubavg-adam']")
    settings = FlowerSettings(
        overrides=overrides,
        output=Output(out_dir=str(tmp_path)),
        replies=Replies(round_timeout=30.0),
    )
    grid = AppGrid(make_client_app(settings), 6)
    make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
    flower = load_file(tmp_path / "model.safetensors")
    expected = in_process_model(overrides, "fedsubavg-adam")
    for name, value in expected.items():
        torch.testing.assert_close(flower[name], value, rtol=0, atol=1e-5)
    fedsubavg = in_process_model(OVERRIDES)  # the server optimizer made a difference
    assert any(not torch.allclose(flower[n], v, atol=1e-3) for n, v in fedsubavg.items())
    result = json.loads((tmp_path / "flower-result.json").read_text())
    assert [r["replies"] for r in result["rounds"]] == [3, 3, 3]


@pytest.mark.usefixtures("flower_task_identity")
def test_scheme2_on_flower_is_the_papers_model_average(tmp_path):
    """fedavg@scheme2 through Flower's strategy (ServerRound, as in process) rescales the
    whole old model by f: the model equals the in-process engine's, not the delta form's."""
    from flwr.app import Context, RecordDict

    from fedsub.flower.apps import make_client_app, make_server_app

    from .test_flower_heat_exchange import AppGrid

    name = "fedavg@scheme2"
    overrides = (*OVERRIDES, f"train.algorithms=['{name}']")
    settings = FlowerSettings(
        overrides=overrides,
        output=Output(out_dir=str(tmp_path)),
        replies=Replies(round_timeout=30.0),
    )
    grid = AppGrid(make_client_app(settings), 6)
    make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
    flower = load_file(tmp_path / "model.safetensors")
    for key, value in in_process_model(overrides, name).items():
        torch.testing.assert_close(flower[key], value, rtol=0, atol=1e-5)
    delta_name = "fedavg@scheme2-delta"
    delta = in_process_model((*OVERRIDES, f"train.algorithms=['{delta_name}']"), delta_name)
    assert any(not torch.allclose(flower[n], v, atol=1e-3) for n, v in delta.items())


def start_insecure_federation(
    processes: Processes,
    folder: Path,
    link: int,
    node_ports: list[int],
    node_configs: list[str] | None = None,
) -> list[subprocess.Popen]:
    """A plain-text SuperLink on ``link`` and one SuperNode per port (partition i of them, or
    the ``node_configs`` given): fedsub's SuperNode (fedsub.flower.supernode, as the docs
    recommend: Flower's, with short polls and warm ClientApps); returns the SuperNodes once
    the SuperLink listens."""
    processes.start(
        "superlink",
        "flower-superlink",
        "--insecure",
        "--disable-runtime-dependency-installation",
        f"--port={link}",
        f"--database={folder / 'state.db'}",
    )
    nodes = [
        processes.start(
            f"supernode{i}",
            *FEDSUB_SUPERNODE,
            "--insecure",
            f"--superlink=127.0.0.1:{link}",
            f"--port={port}",
            "--node-config",
            node_configs[i]
            if node_configs
            else f"partition-id={i} num-partitions={len(node_ports)}",
        )
        for i, port in enumerate(node_ports)
    ]
    wait_for(lambda: port_open(link), 60, "the SuperLink")
    return nodes


def submit_example(env: dict, run_config: str) -> int:
    """``flwr run`` of the example app on the "test" connection (it only submits the run);
    the run's id."""
    submitted = subprocess.run(
        [
            str(BIN / "flwr"),
            "run",
            str(EXAMPLE),
            "test",
            *("--format", "json", "--run-config", run_config),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    return int(json.loads(submitted.stdout)["run-id"])


def run_status(env: dict, run_id: int) -> dict:
    """``flwr ls --run-id`` of a run: its ``status`` ("finished:failed", ...) and details."""
    listed = subprocess.run(
        [str(BIN / "flwr"), "ls", "test", "--run-id", str(run_id), "--format", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stdout + listed.stderr
    (run,) = json.loads(listed.stdout)["runs"]
    return run


def run_log(env: dict, run_id: int) -> str:
    """What ``flwr log <run> --show`` prints: the run's log, the ServerApp's lines (what
    ``flwr run --stream`` shows as it goes)."""
    shown = subprocess.run(
        [str(BIN / "flwr"), "log", str(run_id), "test", "--show"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr
    return shown.stdout


@dataclass(frozen=True)
class NodeLog:
    """What a SuperNode's log (Flower's own lines) says about a run's round. A test ending or
    stopping a run waits until its nodes hold (received) or answered its messages: a Flower
    1.41 SuperNode receiving a message as its run ends logs "Ignoring message" and stalls for
    minutes, and the next test's run with it."""

    path: Path

    def _after(self, run: int, server_round: int) -> list[str]:
        """The log split at each ``[RUN r, ROUND n]`` line: [before, receiving, sending]."""
        return self.path.read_text(errors="replace").split(f"[RUN {run}, ROUND {server_round}]")

    def received(self, run: int, server_round: int) -> bool:
        parts = self._after(run, server_round)
        return len(parts) >= 2 and "Received successfully" in parts[1]

    def answered(self, run: int, server_round: int) -> bool:
        parts = self._after(run, server_round)
        return len(parts) >= 3 and ("Sent successfully" in parts[2] or "Ignoring" in parts[2])


def node_logs(folder: Path, node_ids: list[int]) -> list[NodeLog]:
    """The logs of the SuperNodes with these ids (each logs "SuperNode ID: <id>" at start)."""
    logs = {
        node: NodeLog(path)
        for path in folder.glob("*.log")
        for node in node_ids
        if f"SuperNode ID: {node}" in path.read_text(errors="replace")
    }
    assert sorted(logs) == sorted(node_ids), f"no log names nodes {set(node_ids) - set(logs)}"
    return [logs[node] for node in node_ids]


def progress(out: Path) -> list[dict]:
    path = out / "progress.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@dataclass
class Federation:
    """A running SuperLink with three SuperNodes (partitions 0, 1, 2), shared by the tests
    below, in file order: a user's module, a run from a model file, resume, a killed node
    (replaced), then min-replies (whose run ends while its nodes still train)."""

    folder: Path
    env: dict
    processes: Processes
    link: int
    nodes: list[subprocess.Popen]

    def start_node(self, name: str, partition: int) -> subprocess.Popen:
        (port,) = free_ports(1)
        return self.processes.start(
            name,
            *FEDSUB_SUPERNODE,
            "--insecure",
            f"--superlink=127.0.0.1:{self.link}",
            f"--port={port}",
            "--node-config",
            f"partition-id={partition} num-partitions=3",
        )


@contextlib.contextmanager
def running_federation(folder: Path) -> Iterator[Federation]:
    """A plain-text SuperLink with SuperNodes of partitions 0, 1, 2, stopped on exit."""
    link, *node_ports = free_ports(4)  # the SuperLink serves every API on one port
    # the repository on PYTHONPATH: a config names a user's module in tests/ by its path
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = flower_env(folder, link, "insecure = true", BIN, PYTHONPATH=os.pathsep.join(paths))
    processes = Processes(folder, env, BIN)
    try:
        nodes = start_insecure_federation(processes, folder, link, node_ports)
        yield Federation(folder, env, processes, link, nodes)
    finally:
        processes.stop_all()


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    with running_federation(tmp_path_factory.mktemp("federation")) as federation:
        yield federation


@pytest.mark.deployment  # 16 s of a real run: make test-deployment (a real SuperLink and
# SuperNodes stay in make test through the model-file run below)
def test_a_real_run_builds_a_users_module_from_its_import_path(three_nodes, tmp_path):
    """``model.module`` names a module of tests/ (tests/torch_modules.py: AnyData): the
    ServerApp and every node's ClientApp process import it by that path (PYTHONPATH) and
    train the in-process engine's model."""
    overrides = (
        "data.num_users=3; train.rounds=1; train.clients_per_round=2; "
        "train.algorithms=['fedsubavg']; model.name='torch-module'; "
        f"model.module='{ANY_DATA}'"
    )
    out = tmp_path / "out"
    run_id = submit_example(
        three_nodes.env, f'set="{overrides}" out-dir="{out}" round-timeout=30.0 eval-every=0'
    )
    listed = [o.strip() for o in overrides.split(";")]  # meanwhile, the in-process run
    config = config_lib.load(None, [*listed, "execution.backend='sequential'"])
    expected = fedsub.run(config)["fedsubavg"].params
    initial = model_of(config, load_data(config)).init(torch.Generator(), torch.float32)
    wait_for(lambda: (out / "flower-result.json").exists(), 300, f"run {run_id} to finish")
    result = json.loads((out / "flower-result.json").read_text())
    assert result["succeeded"] is True, result
    assert [r["replies"] for r in result["rounds"]] == [2]
    flower = load_file(out / "model.safetensors")
    assert expected is not None
    assert flower.keys() == expected.state_dict().keys()
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(flower[name], value, rtol=0, atol=1e-5)
    assert any(not torch.equal(flower[k], v) for k, v in initial.state_dict().items())  # trained
    for log in sorted(three_nodes.folder.glob("supernode*.log")):  # fedsub's SuperNodes
        text = log.read_text(errors="replace")
        forked = text.count("fedsub warm ClientApp launcher: ClientApp process")
        assert forked == text.count("Receiving:") > 0, log.name  # every message's ClientApp


def test_a_real_run_starts_from_the_model_file_of_fedsub_run(three_nodes, tmp_path, monkeypatch):
    """``initial-model`` in the run config (as ``flwr run --run-config`` spells it) names the
    ``model.safetensors`` of an in-process ``fedsub run``: the ServerApp process starts round
    1 from it and ends with the in-process engine's model started from that file."""
    overrides = (
        "data.num_users=3; train.rounds=1; train.clients_per_round=2; "
        "train.algorithms=['fedsubavg']"
    )
    listed = tuple(o.strip() for o in overrides.split(";"))
    fedsub.run(config_lib.load(None, listed), out=tmp_path / "first")
    start = tmp_path / "first" / "fedsubavg" / "model.safetensors"
    out = tmp_path / "out"
    submit_example(
        three_nodes.env,
        f'set="{overrides}" out-dir="{out}" round-timeout=30.0 eval-every=0 '
        f'initial-model="{start}"',
    )
    tensors = load_file(start)
    monkeypatch.setattr(  # meanwhile, the in-process run from the file's model
        assembly,
        "initial_params",
        lambda model, schedule: Params.from_state_dict({n: v.clone() for n, v in tensors.items()}),
    )
    expected = in_process_model(listed)
    monkeypatch.undo()
    wait_for(lambda: (out / "flower-result.json").exists(), 300, "the run to finish")
    result = json.loads((out / "flower-result.json").read_text())
    assert result["succeeded"] is True, result
    flower = load_file(out / "model.safetensors")
    for name, value in expected.items():
        torch.testing.assert_close(flower[name], value, rtol=0, atol=1e-5)
    assert any(not torch.allclose(flower[n], v, atol=1e-4) for n, v in tensors.items())


@pytest.mark.deployment  # 84 s of real processes: make test-deployment
# (the in-process grid resumes the same way in test_flower_membership.py)
def test_real_run_resumed_after_its_serverapp_is_killed_ends_with_the_uninterrupted_model(
    three_nodes, tmp_path
):
    """Checkpoints every round; the ServerApp process is killed after round 1's checkpoint
    (of 2 rounds: round 2 is still to come); ``resume=true`` continues it to the in-process
    engine's model (= an uninterrupted run)."""
    overrides = (
        "data.num_users=3; train.rounds=2; train.clients_per_round=2; "
        "train.algorithms=['fedsubavg']; train.lr_schedule='exponential'"
    )
    out = tmp_path / "out"
    run_config = (
        f'set="{overrides}" out-dir="{out}" round-timeout=30.0 checkpoint-every=1 eval-every=0'
    )
    killed = submit_example(three_nodes.env, run_config)
    wait_for(lambda: (out / "checkpoints" / "round-000001").exists(), 300, "checkpoint 1")

    def sent_in_round_2() -> list[int]:
        return [
            n for p in progress(out) if p.get("sent_to") and p["round"] == 2 for n in p["nodes"]
        ]

    wait_for(lambda: bool(sent_in_round_2()), 60, "round 2 to be sent", 0.02)
    round_2 = sent_in_round_2()
    logs = node_logs(three_nodes.folder, round_2)
    # killed once its nodes hold round 2's messages: they train, the server is gone
    wait_for(lambda: all(log.received(killed, 2) for log in logs), 60, "round 2's messages", 0.02)
    (serverapp,) = descendants(three_nodes.processes.started[0].pid, "flwr-serverapp")
    os.kill(serverapp, signal.SIGKILL)
    assert not (out / "flower-result.json").exists()  # it stopped before the end
    assert not (out / "checkpoints" / "round-000002").exists()
    # as the example's README says: stop the dead run, or Flower keeps it running (and its
    # nodes keep its last messages) until its heartbeat times out, about a minute later; and
    # stop it once its nodes have answered (a node receiving a stopped run's message stalls)
    wait_for(lambda: all(log.answered(killed, 2) for log in logs), 60, "round 2's replies")
    stopped = subprocess.run(
        [str(BIN / "flwr"), "stop", str(killed), "test"],
        env=three_nodes.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr

    submit_example(three_nodes.env, f"{run_config} resume=true")
    expected = in_process_model(tuple(o.strip() for o in overrides.split(";")))  # meanwhile
    wait_for(lambda: (out / "flower-result.json").exists(), 300, "the resumed run to finish")
    result = json.loads((out / "flower-result.json").read_text())
    assert result["succeeded"] is True
    assert [r["round"] for r in result["rounds"]] == [1, 2]
    assert all(r["updated"] and r["replies"] == 2 for r in result["rounds"])
    flower = load_file(out / "model.safetensors")
    for name, value in expected.items():
        torch.testing.assert_close(flower[name], value, rtol=0, atol=1e-5)


@pytest.mark.deployment  # 23 s of real processes: make test-deployment (membership changes
# in process: test_flower_membership.py)
def test_a_killed_node_costs_one_round_and_its_replacement_is_sampled(three_nodes, tmp_path):
    """Node 2 is killed in round 2 (as the round is sent: a node replies 2 s later) and a
    new SuperNode with partition 2 is started: round 2 goes on without it (its wait ends
    once the replacement has registered, at most the round timeout), and round 3, the next
    round, samples the replacement. The ServerApp's log (in the SuperLink's) names the
    replacement once, with the round it is sampled from, and never a "node 1" (the
    SuperLink's own id, which its error replies carry)."""
    out = tmp_path / "out"
    overrides = "data.num_users=3; train.rounds=3; train.clients_per_round=3"
    run_config = f'set="{overrides}" out-dir="{out}" round-timeout=60.0 eval-every=0'
    run_config += " train-delay=2.0"  # each reply 2 s late: node 2 dies before it answers

    run_id = submit_example(three_nodes.env, run_config)
    wait_for(
        lambda: any(p.get("sent_to") and p["round"] == 2 for p in progress(out)), 300, "round 2"
    )
    os.killpg(three_nodes.nodes[2].pid, signal.SIGKILL)
    three_nodes.start_node("replacement2", partition=2)
    wait_for(lambda: (out / "flower-result.json").exists(), 300, "the run to finish")

    result = json.loads((out / "flower-result.json").read_text())
    rounds = {r["round"]: r for r in result["rounds"]}
    assert sorted(rounds) == [1, 2, 3] and result["succeeded"] is True
    assert rounds[1]["replies"] == 3 and rounds[1]["left_out"] == []
    assert rounds[2]["replies"] == 2 and rounds[2]["left_out"] == [2]
    assert all(r["updated"] for r in rounds.values())
    killed = dict(zip(rounds[1]["clients"], rounds[1]["nodes"], strict=True))[2]
    replaced = [
        r
        for r in rounds.values()
        if 2 in r["clients"] and r["nodes"][r["clients"].index(2)] != killed
    ]
    assert replaced, "the replacement of partition 2 was never sampled"
    assert all(r["replies"] == r["sampled"] == 3 for r in replaced)
    log = run_log(three_nodes.env, run_id)
    new = replaced[0]["nodes"][replaced[0]["clients"].index(2)]
    assert log.count(f"fedsub: node {killed} registered partition 2") == 1
    assert log.count(f"partition 2: node {new} takes over from node {killed}, sampled from") == 1
    assert log.count(f"node {killed} failed: the SuperLink: ") <= 1  # no flood
    assert re.search(r"\bnode 1\b", log) is None
    config = config_lib.load(None, [o.strip() for o in overrides.split(";")])
    dataset = load_data(config)
    model = build_model("sparse-lr", dataset, {"init_std": 0.0})
    before = initial_params(model, schedule_of(config)).state_dict()
    after = load_file(out / "model.safetensors")
    assert any(not torch.equal(after[n], v) for n, v in before.items())


@pytest.mark.deployment  # 14 s of real processes: make test-deployment
def test_real_run_stops_with_an_error_when_rounds_cannot_reach_min_replies(three_nodes, tmp_path):
    """min-replies = 3, and every node takes longer than the round timeout (train-delay):
    no round can update the model; after max-failed-rounds = 1 such round the ServerApp
    fails, names the missing partitions, and flower-result says so (no model written);
    Flower records the run as failed, with fedsub's reason. The module's last test: its run
    ends while the nodes train, maybe while one receives (see NodeLog), and no run follows."""
    out = tmp_path / "out"
    overrides = "data.num_users=3; train.rounds=3; train.clients_per_round=3"
    run_config = (
        f'set="{overrides}" out-dir="{out}" train-delay=4.0 round-timeout=3.0 '
        "min-replies=3 max-failed-rounds=1"
    )
    run_id = submit_example(three_nodes.env, run_config)
    wait_for(lambda: (out / "flower-result.json").exists(), 300, "the run to stop")
    status: dict = {}

    def finished() -> bool:
        status.update(run_status(three_nodes.env, run_id))
        return str(status["status"]).startswith("finished")

    wait_for(finished, 60, "Flower to record the run's end")
    assert status["status"] == "finished:failed"
    assert "min-replies = 3" in status["status-details"]

    result = json.loads((out / "flower-result.json").read_text())
    assert result["succeeded"] is False
    (first,) = result["rounds"]
    assert first["round"] == 1 and not first["updated"] and first["left_out"] == [0, 1, 2]
    assert result["failed"]["round"] == 1
    assert "0 of 3 sampled nodes replied, fewer than min-replies = 3" in result["failed"]["reason"]
    assert not (out / "model.safetensors").exists()


def run_config_keys() -> list[str]:
    """Every run-config key: FlowerSettings' fields and its groups', spelled with '-', and
    ``set`` (which fills ``overrides``)."""
    from fedsub.keys import key_names, spelled

    return sorted([spelled(k) for k in key_names(FlowerSettings) if k != "overrides"] + ["set"])


def documented_keys(heading: str) -> set[str]:
    """The keys in the first column of the tables under a heading of the Flower page."""
    page = (ROOT / "docs" / "tutorials" / "flower.md").read_text()
    section = page.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z-]+)` \|", section, flags=re.MULTILINE))


def test_the_flower_page_documents_every_run_and_node_config_key():
    """docs/tutorials/flower.md's "Run-config keys" is the one place the keys are described:
    every key the settings read, and every node-config key a node reads, has its row there,
    and no row names a key that is not read."""
    from fedsub.flower.node_data import NodeConfig
    from fedsub.keys import key_names, spelled

    node_keys = {spelled(k) for k in key_names(NodeConfig)}
    assert documented_keys("Run-config keys") == set(run_config_keys()) | node_keys


def test_the_example_app_declares_every_run_config_key():
    """Flower refuses a ``--run-config`` key that the app's pyproject.toml does not declare
    ("Key ... is not present in the main dictionary"): the example declares every key the
    settings read, so each can be given on the command line."""
    import tomllib

    declared = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert sorted(declared["config"]) == run_config_keys()


def test_flower_settings_refuse_a_device_other_than_the_cpu(monkeypatch):
    """On a machine with a GPU, execution.device = "cuda" loads, and Flower refuses it by name."""
    from fedsub.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    settings = FlowerSettings.from_run_config({"set": "execution.device='cuda'"})
    with pytest.raises(ConfigError, match=r"execution\.device = 'cuda'.*CPU"):
        settings.fedsub_config()
    assert FlowerSettings.from_run_config({"set": "execution.device='cpu'"}).fedsub_config()


def test_flower_settings_refuse_a_seeded_randomized_response_heat():
    """Each node draws its randomized-response bits from OS entropy: a seeded heat (the
    simulator's one stream) cannot be honoured on Flower, so it is refused, not ignored."""
    from fedsub.errors import ConfigError

    rr = ("privacy.heat_source='randomized-response'", "privacy.rr_epsilon=2.0")
    seeded = FlowerSettings(overrides=(*rr, "privacy.randomness='seeded'"))
    with pytest.raises(ConfigError, match=r"privacy\.randomness = 'seeded'.*own OS entropy"):
        seeded.fedsub_config()
    assert FlowerSettings(overrides=rr).fedsub_config().privacy.randomness == "secret"
    download = ("privacy.level='download'", "privacy.randomness='seeded'")
    assert FlowerSettings(overrides=download).fedsub_config().privacy.randomness == "seeded"


def test_flower_settings_read_the_run_config_and_refuse_what_flower_cannot_run():
    from fedsub.errors import ConfigError

    settings = FlowerSettings.from_run_config(
        {"set": "train.rounds=2; data.num_users=4", "payload": "full", "min-replies": 2}
    )
    assert settings.overrides == ("train.rounds=2", "data.num_users=4")
    assert settings.fedsub_config().train.rounds == 2 and settings.replies.min_replies == 2
    with pytest.raises(ConfigError, match="unknown key 'rounds'"):
        FlowerSettings.from_run_config({"rounds": 3})
    with pytest.raises(ConfigError, match="payload = 'half'"):
        FlowerSettings.from_run_config({"payload": "half"})
    with pytest.raises(ConfigError, match="max-failed-rounds = 0 is out of range; expected >= 1"):
        FlowerSettings.from_run_config({"max-failed-rounds": 0})
    with pytest.raises(ConfigError, match=r"min-replies = 9 exceeds train\.clients_per_round"):
        FlowerSettings(replies=Replies(min_replies=9)).check_against(
            FlowerSettings(overrides=("train.clients_per_round=3",)).fedsub_config()
        )
    config = settings.fedsub_config()
    with pytest.raises(ConfigError, match="keeps per-client state"):
        FlowerSettings(algorithm="scaffold").algorithm_name(config)
    masked = FlowerSettings(overrides=("model.name='cnn'", "masking.scheme='static'"))
    with pytest.raises(ConfigError, match="masking runs in-process only"):
        masked.fedsub_config()
