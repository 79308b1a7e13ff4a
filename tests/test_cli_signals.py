"""What only a real process shows: the folder lock between two `fedsub` processes (the second
is refused naming the holder, whose run is untouched), SIGTERM treated as Ctrl-C (checkpoint,
exit 143, the resume command, and the resume completes), Ctrl-C during the imports (exit 130,
no traceback)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .processes import wait_for

FEDSUB = Path(sys.executable).parent / "fedsub"
RUN = [
    "--set",
    "data.num_users=40",
    "--set",
    "data.num_items=30",
    "--set",
    # long enough that SIGTERM always lands mid-run (a quiet machine runs ~600 of these tiny
    # rounds a second; 60 were over before the signal), short enough to resume to the end
    "train.rounds=3000",
    "--set",
    "train.clients_per_round=4",
    "--set",
    "train.local_steps=1",
    "--set",
    "train.checkpoint_every=0",
    "--set",
    "eval.every=1",
    "--set",
    "eval.train_loss_samples=50",
    "--quiet",
]


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(FEDSUB), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def holder(out: Path) -> dict:
    try:
        return json.loads((out / ".fedsub.lock").read_text())
    except (OSError, ValueError):
        return {}


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.deployment  # 38 s of three real processes: make test-deployment (in make test: the
# lock's refusal in tests/test_flower_out_dir.py, a real SIGTERM in tests/test_reproduce.py)
def test_a_second_writer_is_refused_naming_the_holder_and_sigterm_checkpoints(tmp_path):
    out = tmp_path / "out"
    first = start("run", "--algorithm", "fedsubavg", "--out", str(out), *RUN)
    try:
        wait_for(lambda: holder(out).get("pid") == first.pid, 120, "the first run's lock")
        first.send_signal(signal.SIGSTOP)  # held, not running: the second comes meanwhile
        second = start("run", "--algorithm", "fedavg", "--out", str(out), "--overwrite", *RUN)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err
        assert "Traceback" not in err
        record = holder(out)
        assert (
            f"output folder {out} is in use by another fedsub run (pid {first.pid} on host "
            f"{socket.gethostname()}, started {record['started']}: fedsub run --algorithm "
            "fedsubavg" in err
        )
        first.send_signal(signal.SIGCONT)
        metrics = out / "fedsubavg" / "metrics.jsonl"
        wait_for(lambda: lines(metrics) >= 3, 120, "three evaluations", every=0.005)
        first.send_signal(signal.SIGTERM)  # as a batch scheduler does before it kills a job
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 143, err
    assert "SIGTERM: finishing this round, then checkpointing" in err
    assert f"Resume with: fedsub run --resume {out}" in err and "Traceback" not in err
    assert list((out / "fedsubavg" / "checkpoints").iterdir())
    assert not (out / ".fedsub.lock").exists() and not (out / "fedavg").exists()
    for line in metrics.read_text().splitlines():  # one writer: whole JSON lines
        json.loads(line)
    resumed = start("run", "--resume", str(out), "--quiet")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert json.loads((out / "summary.json").read_text())["algorithms"]["fedsubavg"]


def test_ctrl_c_during_the_imports_exits_130_quietly():
    process = start("list", "keys")
    time.sleep(0.3)  # Python is up; torch and the command line are being imported
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    if process.returncode == 0:  # the imports were already done on a fast machine
        return
    assert process.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
