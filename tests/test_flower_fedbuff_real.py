"""FedBuff over real Flower processes (issue 51): ``clock.mode = "fedbuff"`` on a SuperLink and
three of fedsub's SuperNodes, the example app submitted with ``flwr run``. The in-process grid
(tests/test_flower_fedbuff.py) checks the model against the virtual clock's FedBuff; here the
order of the replies is the processes' own, so the test checks what does not depend on it:
the steps, B updates each, their staleness, the first step's draws, the model trained and
finite. A deployment test (``make test-deployment``): a federation's start and a few steps of
ClientApp processes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedsub import config as config_lib
from fedsub.clock.fedbuff import draw_client
from fedsub.engine.initial import initial_params
from fedsub.models.registry import build_model
from fedsub.runs.run_setup import load_data, schedule_of

from .processes import wait_for
from .test_flower import running_federation, submit_example

STEPS, CONCURRENCY, BUFFER = 3, 3, 2
OVERRIDES = (
    f"data.num_users=3; train.rounds={STEPS}; train.clients_per_round=3; "
    "train.algorithms=['fedsubavg']; clock.mode='fedbuff'; "
    f"clock.concurrency={CONCURRENCY}; clock.buffer_size={BUFFER}"
)


@pytest.mark.deployment
def test_fedbuff_on_real_nodes_steps_on_every_b_replies_and_combines_stale_updates(tmp_path):
    """Three steps of B = 2 with C = 3 nodes training: the run succeeds; every step combined
    B = 2 updates, none left out; step 1's updates are fresh (tau = 0: everything in flight
    was sent version 0) and its sends are the clock's first three draws (all three nodes
    registered before step 1); a later step combined a stale update (tau >= 1: after each
    step C - B = 1 update sent on an older version is still in flight, and it stays out of
    steps 2 and 3 only if four later-sent updates overtake it); a partition is always the
    same node; at most C messages were ever outstanding; the model trained and is finite."""
    out, folder = tmp_path / "out", tmp_path / "federation"
    folder.mkdir()
    with running_federation(folder) as federation:
        submit_example(
            federation.env, f'set="{OVERRIDES}" out-dir="{out}" round-timeout=120.0 eval-every=0'
        )
        wait_for(lambda: (out / "flower-result.json").exists(), 600, "the FedBuff run to end")
        node_ids = [
            int(line.split("SuperNode ID: ")[1].split()[0])
            for log in sorted(federation.folder.glob("supernode*.log"))
            for line in log.read_text(errors="replace").splitlines()
            if "SuperNode ID: " in line
        ]

    result = json.loads((out / "flower-result.json").read_text())
    assert result["succeeded"] is True, result
    steps = result["rounds"]
    assert [s["round"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["updated"] and s["left_out"] == [] for s in steps)
    assert [s["replies"] for s in steps] == [BUFFER] * STEPS
    assert all(len(s["clients"]) == len(s["nodes"]) == len(s["staleness"]) == BUFFER for s in steps)
    # staleness: step r combines updates sent on versions 0..r-1; step 1 only version 0
    assert steps[0]["staleness"] == [0] * BUFFER
    assert all(0 <= tau <= s["round"] - 1 for s in steps for tau in s["staleness"])
    assert max(tau for s in steps for tau in s["staleness"]) >= 1, "no stale update combined"
    # step 1's sends: the clock's draws 0, 1, 2 among the three registered partitions
    overrides = tuple(o.strip() for o in OVERRIDES.split(";"))
    config = config_lib.load(None, overrides)
    free = [0, 1, 2]
    first: list[int] = []
    for count in range(CONCURRENCY):
        first.append(draw_client(config.train.seed, count, np.array(free, dtype=np.int64)))
        free.remove(first[-1])
    assert steps[0]["sent_to"] == first
    assert set(steps[0]["clients"]) <= set(first)
    # the nodes: the federation's, one per partition throughout
    assert sorted(set(node_ids)) == sorted(node_ids) and len(node_ids) == 3
    pairs = {(c, n) for s in steps for c, n in zip(s["clients"], s["nodes"], strict=True)}
    assert {n for _, n in pairs} <= set(node_ids)
    assert len({c for c, _ in pairs}) == len(pairs)  # a partition never changed node
    # never more than C outstanding: each combined update was sent, at most C others pending
    sent = sum(len(s["sent_to"]) for s in steps)
    assert STEPS * BUFFER <= sent <= STEPS * BUFFER + CONCURRENCY
    assert all(s["in_flight"] <= CONCURRENCY for s in steps)

    dataset = load_data(config)
    model = build_model("sparse-lr", dataset, {"init_std": 0.0})
    before = initial_params(model, schedule_of(config)).state_dict()
    after = load_file(out / "model.safetensors")
    assert after.keys() == before.keys()
    assert all(bool(torch.isfinite(v).all()) for v in after.values())
    assert any(not torch.equal(after[n], v) for n, v in before.items())  # it trained
