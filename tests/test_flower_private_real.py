"""``privacy.level = "full"`` on real Flower processes: a SuperLink and three SuperNodes. The
run takes about 85 s on a quiet machine (11 message waves: registration, 4 heat stages, the
request, train, 4 secure-sum stages, each some seconds on Flower 1.41), so it is marked
``deployment``: `make test` leaves it out, `make test-deployment` runs it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fedsub import config as config_lib
from fedsub.runs.run_setup import load_data
from fedsub.submodel.index import SubmodelIndex

from .processes import wait_for
from .test_flower import (
    in_process_model,
    running_federation,
    submit_example,
)


@pytest.fixture(scope="module")
def full_nodes(tmp_path_factory):
    with running_federation(tmp_path_factory.mktemp("federation")) as federation:
        yield federation


@pytest.mark.deployment
def test_real_run_at_privacy_full_trains_the_in_process_model_and_the_server_sees_no_rows(
    full_nodes, tmp_path
):
    """``privacy.level = "full"`` on the SuperLink and three SuperNodes, one round (randomized
    response download, secure heat and secure row sums over Flower messages): the model is
    the in-process engine's (within the fixed-point bound); nothing the server received
    (``heat-transcript``: queries, heat exchange, secure sums, train replies) holds a node's
    S(k), a nonzero float (a delta) or a sample count; each round's costs are recorded."""
    from .test_flower_heat import leaks

    overrides = (
        "data.num_users=3; train.rounds=1; train.clients_per_round=3; "
        "train.algorithms=['fedsubavg']; train.heat='samples'; privacy.level='full'; "
        "privacy.download='randomized-response'; privacy.download_keep=0.6; "
        "privacy.secagg_group=3; privacy.randomness='seeded'"
    )
    out = tmp_path / "out"
    run_config = (
        f'set="{overrides}" out-dir="{out}" round-timeout=120.0 heat-transcript=true eval-every=0'
    )
    submit_example(full_nodes.env, run_config)
    # 11 message waves (registration, 4 heat stages, the request, train, 4 secure-sum
    # stages), each a few seconds on Flower 1.41 (node polling, a ClientApp process each)
    wait_for(lambda: (out / "flower-result.json").exists(), 600, "the run at full to finish")

    result = json.loads((out / "flower-result.json").read_text())
    assert result["succeeded"] is True and [r["replies"] for r in result["rounds"]] == [3]
    settings = tuple(o.strip() for o in overrides.split(";"))
    flower = load_file(out / "model.safetensors")
    for name, value in in_process_model(settings).items():
        torch.testing.assert_close(flower[name], value, rtol=0, atol=1e-6)
    assert float(flower["table.features"].abs().sum()) > 0  # it trained

    recorded = json.loads((out / "heat-transcript.json").read_text())
    replies = recorded["replies"] + recorded["train_replies"]
    assert [e["stage"] for e in recorded["train_replies"]] == ["train"] * 3
    config = config_lib.load(None, settings)
    dataset = load_data(config)
    index = SubmodelIndex.build(dataset)
    rows = [{"features": index.client_rows("features", k)} for k in range(3)]
    assert leaks(replies, rows, dataset.sample_counts().tolist()) == []
    assert "num-examples" not in json.dumps(replies)
    floats = [
        value["array"]
        for entry in replies
        for record in entry["records"].values()
        for value in record.values()
        if isinstance(value, dict) and str(value.get("dtype", "")).startswith("torch.float")
    ]
    assert floats and not any(torch.tensor(a).abs().sum() > 0 for a in floats)
    assert result["costs"]["level"] == "full"
    assert all(n["bytes_up"] > 0 for r in result["rounds"] for n in r["costs"]["nodes"].values())


@pytest.mark.deployment
def test_real_run_with_distributed_dp_is_the_in_process_run(full_nodes, tmp_path):
    """[dp] at ``privacy.level = "full"`` on the SuperLink and three SuperNodes, one round:
    each SuperNode adds its seeded noise share (``dp-seeded-noise``) inside the secure row
    sum, and the model is the in-process engine's, noise included."""
    from .test_flower_dp import in_process_model as in_process_dp_model

    overrides = (
        "data.num_users=3; train.rounds=1; train.clients_per_round=3; "
        "train.algorithms=['fedavg']; train.heat='samples'; privacy.level='full'; "
        "privacy.download='randomized-response'; privacy.download_keep=0.6; "
        "privacy.secagg_group=3; dp.mechanism='gaussian'; dp.noise_multiplier=1.5; "
        "dp.clip=0.5; dp.rows='all'; dp.min_survivors=2; dp.randomness='seeded'; "
        "privacy.randomness='seeded'"
    )
    out = tmp_path / "out"
    run_config = (
        f'set="{overrides}" out-dir="{out}" round-timeout=120.0 eval-every=0 dp-seeded-noise=true'
    )
    submit_example(full_nodes.env, run_config)
    wait_for(lambda: (out / "flower-result.json").exists(), 600, "the run with [dp] to finish")
    result = json.loads((out / "flower-result.json").read_text())
    assert result["succeeded"] is True and [r["replies"] for r in result["rounds"]] == [3]
    flower = load_file(out / "model.safetensors")
    settings = tuple(o.strip() for o in overrides.split(";"))
    for name, value in in_process_dp_model(settings, "fedavg").items():
        torch.testing.assert_close(flower[name], value, rtol=0, atol=1e-6)
