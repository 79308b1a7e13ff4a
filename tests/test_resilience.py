"""Runs that survive: checkpoints, resume after SIGKILL or Ctrl-C, update guards, determinism."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedsub.algorithms.registry import AlgorithmContext, ServerLrOptions, build_algorithm
from fedsub.cli import main
from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.loop import Diverged, RunControl
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.errors import FedsubError
from fedsub.files.run_folder import hash_config
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.moved_keys import ADDED_SINCE, MOVED
from fedsub.runs.experiment import check_free_space
from fedsub.submodel.index import SubmodelIndex

from .conftest import SquaredDistance

RUN = """
[data]
name = "synthetic-sparse"
num_users = 300
num_items = 100
mean_samples_per_user = 12

[train]
algorithms = ["fedavg", "fedadam", "scaffold"]
rounds = 24
clients_per_round = 20
local_steps = 4
batch_size = 4
lr = 0.2
backend = "sequential"
checkpoint_every = 1

[eval]
every = 1
train_loss_samples = 500
target_train_loss = 0.69
"""


def fedsub_process(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fedsub.cli", *args, "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def outputs(out: Path) -> dict:
    """Everything a run leaves that must not depend on interruptions (elapsed aside)."""
    result = {}
    for name in ("fedavg", "fedadam", "scaffold"):
        lines = (out / name / "metrics.jsonl").read_text().splitlines()
        result[f"{name}/metrics"] = [
            {k: v for k, v in json.loads(x).items() if k != "elapsed"} for x in lines
        ]
        model = load_file(str(out / name / "model.safetensors"))
        result[f"{name}/model"] = {k: v.numpy().tobytes() for k, v in model.items()}
    summary = json.loads((out / "summary.json").read_text())
    result["summary"] = summary
    return result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    config = folder / "run.toml"
    config.write_text(RUN)
    process = fedsub_process("compare", str(config), "--out", str(folder / "out"))
    assert process.wait(timeout=300) == 0, process.stderr.read()
    return config, outputs(folder / "out")


def wait_for_checkpoint(out: Path, algorithm: str, at_least: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        newest = checkpoint_lib.latest(out / algorithm / "checkpoints")
        if newest is not None and int(newest.name.split("-")[1]) >= at_least:
            return
        time.sleep(0.005)
    raise AssertionError(f"no checkpoint of round {at_least} within {timeout} s")


# seed 0 in make test; 1 and 2 (other algorithms and rounds) in make test-deployment
@pytest.mark.parametrize(
    "seed", [0, *(pytest.param(s, marks=pytest.mark.deployment) for s in (1, 2))]
)
def test_sigkill_at_a_random_round_then_resume_gives_identical_results(
    tmp_path, uninterrupted, seed
):
    config, expected = uninterrupted
    rng = np.random.default_rng(seed)
    algorithm = ["fedavg", "fedadam", "scaffold"][int(rng.integers(3))]
    kill_after = int(rng.integers(1, 20))
    out = tmp_path / "out"
    process = fedsub_process("compare", str(config), "--out", str(out))
    try:
        wait_for_checkpoint(out, algorithm, kill_after)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert not (out / "summary.json").exists()  # it really was cut off

    resumed = fedsub_process("compare", "--resume", str(out))
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert outputs(out) == expected


def test_a_run_written_before_later_keys_existed_resumes_to_the_same_results(
    tmp_path, uninterrupted
):
    """A run folder written by an older fedsub has no line for a key added since (its
    config.toml and run.json's hash are of the text without it), and the keys that have since
    moved out of [train] in [train] under their old names: resume reads the new key's
    default, which keeps the old behaviour, and each moved key at its new place (with a
    note), and continues to the uninterrupted results bit for bit."""
    config, expected = uninterrupted
    out = tmp_path / "out"
    process = fedsub_process("compare", str(config), "--out", str(out))
    try:
        wait_for_checkpoint(out, "fedadam", 5)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    written = (out / "config.toml").read_text()
    older = "\n".join(
        line
        for line in in_old_sections(written.split("\n[dp]\n")[0]).splitlines()
        if not line.startswith(("sampling = ", "regularized_loss = "))
    )
    assert older != written and "[dp]" in written  # keys this fedsub added, gone
    assert "[execution]" in written and "[execution]" not in older
    assert 'backend = "sequential"' in older.split("[train]")[1].split("[eval]")[0]
    (out / "config.toml").write_text(older)
    for stamped in [out / "run.json", *out.glob("*/done"), *out.glob("*/checkpoints/*/*.json")]:
        # what the older fedsub stamped: run.json, each finished algorithm, each checkpoint
        text = stamped.read_text()
        assert stamped.name != "run.json" or hash_config(written) in text
        stamped.write_text(text.replace(hash_config(written), hash_config(older)))

    resumed = fedsub_process("compare", "--resume", str(out))
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert "train.backend is now execution.backend" in resumed.stderr.read()
    assert outputs(out) == expected


def in_old_sections(text: str) -> str:
    """A config.toml as fedsub wrote it before keys moved out of [train] (moved_keys.py):
    the lines of [execution], [privacy] and [masking] in [train], by their old names."""
    old_name = {place: old for old, place in MOVED.items()}
    blocks = [block.splitlines() for block in text.split("\n\n")]
    kept, moved = [], []
    for block in blocks:
        section = block[0].strip("[]") if block else ""
        if section in ("execution", "privacy", "masking"):
            for line in block[1:]:
                key, value = line.split(" = ", 1)
                if ADDED_SINCE.get((section, key)) == value:
                    continue  # a key added after the move: an older fedsub never wrote it
                moved.append(f"{old_name[(section, key)]} = {value}")
        else:
            kept.append(block)
    train = next(b for b in kept if b and b[0] == "[train]")
    train += moved
    return "\n\n".join("\n".join(block) for block in kept)


def test_ctrl_c_checkpoints_says_how_to_resume_and_resume_matches(tmp_path, uninterrupted):
    config, expected = uninterrupted
    out = tmp_path / "out"
    process = fedsub_process(
        "compare", str(config), "--out", str(out), "--set", "train.checkpoint_every=0"
    )
    wait_for_checkpoint_or_metrics(out / "fedadam" / "metrics.jsonl", lines=5)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    assert f"Resume with: fedsub compare --resume {out}" in stderr
    assert checkpoint_lib.latest(out / "fedadam" / "checkpoints") is not None

    resumed = fedsub_process("compare", "--resume", str(out))
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert outputs(out) == expected


def wait_for_checkpoint_or_metrics(path: Path, lines: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return
        time.sleep(0.005)
    raise AssertionError(f"{path} did not reach {lines} lines")


def test_same_config_and_seed_give_identical_outputs(tmp_path, uninterrupted):
    config, expected = uninterrupted
    assert main(["compare", str(config), "--out", str(tmp_path / "again"), "--quiet"]) == 0
    assert outputs(tmp_path / "again") == expected


def test_checkpoints_are_written_every_n_rounds_and_only_two_kept(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(RUN.replace("checkpoint_every = 1", "checkpoint_every = 5"))
    out = tmp_path / "out"
    assert main(["run", str(config), "--algorithm", "scaffold", "--out", str(out), "--quiet"]) == 0
    kept = sorted(p.name for p in (out / "scaffold" / "checkpoints").iterdir())
    assert kept == ["round-000015", "round-000020"]
    saved = checkpoint_lib.load(out / "scaffold" / "checkpoints" / "round-000020")
    assert saved.round == 20 and len(saved.history) == 21
    assert any(name.startswith("client.") for name in saved.stages["variates"])  # c_i are saved
    assert not list((out / "scaffold" / "checkpoints").glob(".*"))  # no staging leftovers


def poisoned_dataset(bad_client: int) -> FederatedDataset:
    rng = np.random.default_rng(0)
    parts = []
    for k in range(6):
        n = 8
        dense = rng.normal(size=(n, 2)).astype(np.float32)
        if k == bad_client:
            dense[0, 0] = np.nan
        ids = Ragged.from_lists([[int(rng.integers(10))] for _ in range(n)])
        parts.append(SampleSet({"t": ids}, rng.integers(2, size=n).astype(np.float32), dense))
    return FederatedDataset.from_clients("poisoned", {"t": 10}, parts, parts[0])


def test_nan_update_and_oversized_update_are_rejected_and_the_round_goes_on():
    dataset = poisoned_dataset(bad_client=2)
    index = SubmodelIndex.build(dataset)
    model = SparseLogisticRegression(dict(dataset.table_rows), dense_dim=2)
    algorithm = build_algorithm("fedsubavg", AlgorithmContext(dataset, index, "samples", 6))
    rejections = []
    control = RunControl(max_update_norm=1e6, on_reject=rejections.append)
    schedule = Schedule(
        3, 6, LocalWork(2, 4, ClientStep(0.5)), seed=0, execution=Execution(dtype=torch.float64)
    )
    params = train(model, algorithm, dataset, index, schedule, control=control)
    assert all(torch.isfinite(t).all() for t in params.tensors())
    assert [(r.client, r.round) for r in rejections] == [(2, 1), (2, 2), (2, 3)]
    assert rejections[0].reason == "update contains NaN or Inf"
    assert params.dense["dense_weight"].abs().sum() > 0  # the others' updates were applied

    clean = poisoned_dataset(bad_client=-1)
    clean_index = SubmodelIndex.build(clean)
    tight = []
    control = RunControl(max_update_norm=1e-3, on_reject=tight.append)
    algorithm = build_algorithm("fedavg", AlgorithmContext(clean, clean_index, "samples", 6))
    params = train(model, algorithm, clean, clean_index, schedule, control=control)
    assert len(tight) == 18 and "update norm" in tight[0].reason and "> 0.001" in tight[0].reason
    assert all(bool((t == 0).all()) for t in params.tensors())  # nothing was applied


def test_divergence_stops_with_the_round_and_last_checkpoint(tmp_path):
    """A server step of 1e30 on (w - 1)^2 overflows float32 in round 2 while every client
    update stays finite; the run must stop naming that round and the last checkpoint."""
    parts = [SampleSet({"w": Ragged.from_lists([[0]])}, np.ones(1, np.float32)) for _ in range(6)]
    dataset = FederatedDataset.from_clients("quadratic", {"w": 1}, parts, parts[0])
    index = SubmodelIndex.build(dataset)
    context = AlgorithmContext(dataset, index, "samples", 6)
    algorithm = build_algorithm("scaffold-approx", context, ServerLrOptions(server_lr=1e30))
    schedule = Schedule(10, 6, LocalWork(1, 1, ClientStep(0.1)), seed=0)
    control = RunControl(checkpoints=tmp_path, checkpoint_every=1)
    with pytest.raises(Diverged) as error:
        train(SquaredDistance(rows=1, w0=0.0), algorithm, dataset, index, schedule, control=control)
    message = str(error.value)
    assert message.startswith("scaffold-approx: the model overflowed at round 2")
    assert f"last good checkpoint: {tmp_path / 'round-000001'}" in message


def test_full_disk_is_reported_before_training(tmp_path):
    with pytest.raises(FedsubError, match="MiB free; need at least"):
        check_free_space(tmp_path, needed=2**62)


def test_resume_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["compare", "--resume", str(tmp_path), "--quiet"]) == 2
    assert "is not a fedsub run folder" in capsys.readouterr().err
    assert main(["compare", "c.toml", "--resume", str(tmp_path), "--quiet"]) == 2
    assert "drop CONFIG" in capsys.readouterr().err


def test_broken_checkpoint_is_a_clear_error(tmp_path):
    broken = tmp_path / "round-000003"
    broken.mkdir()
    (broken / "state.json").write_text("{not json")
    with pytest.raises(FedsubError, match="not a readable fedsub checkpoint"):
        checkpoint_lib.load(broken)
    os.remove(broken / "state.json")
