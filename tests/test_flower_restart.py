"""A SuperLink restart, survived as the example's README says ("If the SuperLink restarts"):
the SuperLink is killed after round 1's checkpoint (its ServerApp dies with it), then
restarted on its port and database, every SuperNode is restarted with its node config, and
the run submitted again with ``resume=true`` ends with the uninterrupted in-process model.
A deployment test (``make test-deployment``): it starts two federations' worth of processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from .processes import Processes, flower_env, free_ports, port_open, wait_for
from .test_flower import BIN, in_process_model, start_insecure_federation, submit_example

OVERRIDES = (
    "data.num_users=3; train.rounds=2; train.clients_per_round=3; "
    "train.algorithms=['fedsubavg']; train.lr_schedule='exponential'"
)


@pytest.mark.deployment
def test_a_run_resumes_after_a_superlink_restart_to_the_uninterrupted_model(tmp_path):
    link, *node_ports = free_ports(4)
    env = flower_env(tmp_path, link, "insecure = true", BIN)
    processes = Processes(tmp_path, env, BIN)
    out = tmp_path / "out"
    run_config = (
        f'set="{OVERRIDES}" out-dir="{out}" round-timeout=120.0 checkpoint-every=1 '
        "eval-every=0 node-wait=300.0"
    )
    try:
        nodes = start_insecure_federation(processes, tmp_path, link, node_ports)
        first = submit_example(env, run_config)
        wait_for(lambda: (out / "checkpoints" / "round-000001").exists(), 400, "checkpoint 1")
        os.killpg(processes.started[0].pid, signal.SIGKILL)  # the SuperLink dies
        wait_for(lambda: not port_open(link), 60, "the SuperLink to be gone")
        # 1. the SuperLink, as it was started (same port, same database)
        processes.start(
            "superlink-restarted",
            "flower-superlink",
            "--insecure",
            "--disable-runtime-dependency-installation",
            f"--port={link}",
            f"--database={tmp_path / 'state.db'}",
        )
        wait_for(lambda: port_open(link), 60, "the restarted SuperLink")
        subprocess.run(  # Flower's record of the old run, if the database kept it
            [str(BIN / "flwr"), "stop", str(first), "test"], env=env, timeout=120, check=False
        )
        # 2. every SuperNode, with its node config (a new node id each)
        for i, (node, port) in enumerate(zip(nodes, node_ports, strict=True)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            processes.start(
                f"supernode{i}-restarted",
                "flower-supernode",
                "--insecure",
                f"--superlink=127.0.0.1:{link}",
                f"--port={port}",
                "--node-config",
                f"partition-id={i} num-partitions=3",
            )
        # 3. the run, resumed
        submit_example(env, f"{run_config} resume=true")
        expected = in_process_model(tuple(o.strip() for o in OVERRIDES.split(";")))
        wait_for(lambda: (out / "flower-result.json").exists(), 600, "the resumed run")
    finally:
        processes.stop_all()
    result = json.loads((out / "flower-result.json").read_text())
    assert result["succeeded"] is True and [r["round"] for r in result["rounds"]] == [1, 2]
    flower = load_file(out / "model.safetensors")
    for name, value in expected.items():
        torch.testing.assert_close(flower[name], value, rtol=0, atol=1e-5)
