"""A real SuperLink and three SuperNodes, each with its own data file and the shared feature
spec, their heat by secure aggregation over Flower messages: the heat is exact, the model
equals the in-process engine's (exact heat) on the same files, nothing the server received in
the query round and the heat exchange holds a node's S(k), and the federated evaluation equals
the metrics computed centrally on the pooled held-out samples. (One run checks all of it: each
Flower message starts a ClientApp process, so the Flower tests share their runs.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sklearn.metrics import roc_auc_score

from fedsub import config as config_lib
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.data.feature_spec import dataset_of_nodes
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.in_process import train
from fedsub.engine.metrics import roc_auc
from fedsub.runs.run_setup import model_of, schedule_of
from fedsub.submodel import heat as heat_lib
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params

from .node_files import SPEC, write_federation
from .processes import Processes, flower_env, free_ports, wait_for
from .test_flower import BIN, start_insecure_federation, submit_example
from .test_flower_heat import leaks

OVERRIDES = (
    "train.rounds=1; train.clients_per_round=3; train.algorithms=['fedsubavg']; "
    "train.heat='samples'"
)
PRIVATE = f"{OVERRIDES}; privacy.heat_source='secagg'; privacy.secagg_group=3"


@pytest.mark.deployment  # a SuperLink and three SuperNodes for 85 s: make test-deployment
def test_supernodes_with_their_own_files_train_the_in_process_model(tmp_path):
    federation = write_federation(tmp_path / "data")
    link, *node_ports = free_ports(4)
    env = flower_env(tmp_path, link, "insecure = true", BIN)
    processes = Processes(tmp_path, env, BIN)
    out = tmp_path / "out"
    try:
        start_insecure_federation(processes, tmp_path, link, node_ports, federation.node_configs)
        submit_example(
            env,
            f'set="{PRIVATE}" out-dir="{out}" round-timeout=60.0 eval-every=1 num-nodes=3 '
            f'feature-spec="{federation.spec_file}" '
            f'server-test-file="{federation.server_test_file}" heat-transcript=true',
        )
        # meanwhile, the in-process engine on the same three files, read with the same spec
        config = config_lib.load(None, [o.strip() for o in OVERRIDES.split(";")])
        dataset = dataset_of_nodes(SPEC, federation.nodes)
        index = SubmodelIndex.build(dataset)
        model, schedule = model_of(config, dataset), schedule_of(config)
        context = AlgorithmContext(dataset, index, config.train.heat, schedule.clients_per_round)
        algorithm = build_algorithm("fedsubavg", context, config.algorithm_options("fedsubavg"))
        expected = train(model, algorithm, dataset, index, schedule)
        wait_for(lambda: (out / "flower-result.json").exists(), 400, "the run to finish")
    finally:
        processes.stop_all()
    result = json.loads((out / "flower-result.json").read_text())
    assert result["succeeded"] and [r["replies"] for r in result["rounds"]] == [3]

    flower = load_file(out / "model.safetensors")
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(flower[name], value, rtol=0, atol=1e-6)
    assert float(flower["table.features"].abs().sum()) > 0  # it trained

    # the secure heat is the exact heat, and the server never received an index set
    counts = dataset.sample_counts()
    heat = load_file(out / "heat.safetensors")
    for table, size in dataset.table_rows.items():
        exact = heat_lib.heat(index.rows[table], size, counts, "samples")
        np.testing.assert_array_equal(heat[f"heat.{table}"].numpy(), exact)
    replies = json.loads((out / "heat-transcript.json").read_text())["replies"]
    stages = [r["stage"] for r in replies]
    assert {s: stages.count(s) for s in set(stages)} == {
        "query": 3,
        "advertise": 3,
        "share": 3,
        "mask": 3,
        "unmask": 3,
    }
    rows = [{t: index.client_rows(t, k) for t in dataset.table_rows} for k in range(3)]
    assert leaks(replies, rows, counts.tolist()) == []
    assert "num-examples" not in json.dumps(replies)  # sample counts only inside the sum

    # federated evaluation against the pooled held-out samples, computed centrally
    evaluation = result["evaluations"]["1"]
    params = Params.from_state_dict(flower)
    evaluator = Evaluator.build(model, dataset, 10**6, config.data.seed)
    central = evaluator.evaluate(params)
    assert evaluation["eval_nodes"] == 3 and evaluation["test_samples"] == len(dataset.test)
    for key in ("test_loss", "test_accuracy", "train_loss", "train_accuracy"):
        assert abs(evaluation[key] - central[key]) <= 1e-6 * abs(central[key]) + 1e-9, key
    logits = evaluator.outputs(params, dataset.test).double().numpy()
    exact_auc = roc_auc_score(dataset.test.labels, logits)
    assert abs(evaluation["test_auc"] - exact_auc) <= evaluation["test_auc_bin_error"] < 0.05
    server_test = SPEC.encode(federation.server_test_file)
    logits = evaluator.outputs(params, server_test).double().numpy()
    assert evaluation["server_test_auc"] == pytest.approx(roc_auc(server_test.labels, logits))
    loss = float(
        model.loss(torch.from_numpy(logits), torch.from_numpy(server_test.labels).double())
    )
    assert evaluation["server_test_loss"] == pytest.approx(loss, rel=1e-9)


@pytest.mark.usefixtures("flower_task_identity")
def test_a_nodes_data_error_reaches_the_server_as_its_partition_and_kind_only(tmp_path, caplog):
    """Node 1's file has a bad label: the server hears "partition-id=1: its data cannot be
    read (DataError)" (never the file's path or the value), the node's own log has the whole
    error, and the run fails naming the missing partition (in process: the real ServerApp
    and ClientApps over a grid)."""
    import logging

    from flwr.app import Context, RecordDict
    from flwr.common.logger import FLOWER_LOGGER

    from fedsub.errors import FedsubError
    from fedsub.flower.apps import make_client_app, make_server_app
    from fedsub.flower.settings import Deployment, FlowerSettings, Nodes

    from .flower_rounds import wide

    federation = write_federation(tmp_path / "data")
    broken = federation.nodes[1].data_file
    lines = broken.read_text().splitlines()
    lines[1] = ",".join(["u1", "7", *lines[1].split(",")[2:]])  # label 7
    broken.write_text("\n".join(lines) + "\n")
    settings = FlowerSettings(
        overrides=tuple(o.strip() for o in OVERRIDES.split(";")),
        nodes=Nodes(node_wait=0.5),
        deployment=Deployment(feature_spec=str(federation.spec_file), num_nodes=3),
    )
    grid = file_nodes(make_client_app(settings), federation)
    node_log: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: node_log.append(record.getMessage())  # type: ignore[method-assign]
    FLOWER_LOGGER.addHandler(handler)
    try:
        missing = r"partition\(s\) missing: \[1\] \(registered: \[0, 2\]\)"
        with (
            caplog.at_level(logging.INFO, logger="fedsub"),
            pytest.raises(FedsubError, match=missing) as failure,
        ):
            make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    failed = [m for m in grid.received if m.has_error()]
    assert len(failed) == 1 and failed[0].metadata.src_node_id == wide(101)
    assert "partition-id=1: its data cannot be read (DataError)" in failed[0].error.reason
    server_log = [r.getMessage() for r in caplog.records if r.name == "fedsub"]  # the server's
    server_side = "".join(server_log) + "".join(
        str(m.content) for m in grid.received if not m.has_error()
    )
    server_side += failed[0].error.reason + str(failure.value)
    assert any(f"registration: node {wide(101)} failed: " in line for line in server_log)
    assert str(tmp_path) not in server_side and "'7'" not in server_side
    assert any(str(broken) in line and "7" in line for line in node_log)  # the node's own log


def file_nodes(app, federation):
    """The in-process grid (tests/test_flower_private_download.py's Recording) of one node per
    file of ``federation``, each with its node config as `flower-supernode --node-config`
    gives it (node ids ``wide(100 + k)``)."""
    from flwr.app import Context, RecordDict

    from .flower_rounds import wide
    from .test_flower_private_download import Recording

    grid = Recording(app, len(federation.nodes))
    for k, files in enumerate(federation.nodes):
        held_out = {"eval-file": str(files.eval_file)} if files.eval_file else {}
        held_out = held_out or {"eval-fraction": files.eval_fraction, "eval-seed": k}
        node_config = {
            "partition-id": k,
            "data-file": str(files.data_file),
            "feature-spec": str(federation.spec_file),
            **held_out,
        }
        grid.contexts[wide(100 + k)] = Context(1, wide(100 + k), node_config, RecordDict(), {})
    return grid


@pytest.mark.usefixtures("flower_task_identity")
def test_fedsub_run_on_the_nodes_files_is_the_in_process_reference_of_the_deployment(tmp_path):
    """``data.name = "nodes"`` reads a deployment's feature spec and node files as one
    dataset: ``fedsub.run`` of the same config (``[dp]`` included: central DP) ends with the
    Flower run's model (the real ServerApp and ClientApps in process, each node holding only
    its own file); without ``[dp]`` the model differs (control)."""
    from flwr.app import Context, RecordDict

    import fedsub
    from fedsub.flower.apps import make_client_app, make_server_app
    from fedsub.flower.settings import Deployment, FlowerSettings, Output

    federation = write_federation(tmp_path / "data")
    # seeded: the two runs must draw the same noise (a secret run draws its own)
    dp = (
        "dp.mechanism='gaussian'",
        "dp.noise_multiplier=0.8",
        "dp.clip=0.5",
        "dp.randomness='seeded'",
    )
    overrides = (*(o.strip() for o in OVERRIDES.split(";")), "train.rounds=2", *dp)
    settings = FlowerSettings(
        overrides=overrides,
        deployment=Deployment(feature_spec=str(federation.spec_file), num_nodes=3),
        output=Output(out_dir=str(tmp_path / "flower")),
    )
    grid = file_nodes(make_client_app(settings), federation)
    make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
    flower = load_file(tmp_path / "flower" / "model.safetensors")

    files = [str(n.data_file) for n in federation.nodes]
    evals = [str(n.eval_file) if n.eval_file else "" for n in federation.nodes]
    nodes = (
        "data.name='nodes'",
        f"data.feature_spec='{federation.spec_file}'",
        f"data.files={files}",
        f"data.eval_files={evals}",
        "data.eval_fraction=0.3",
        "data.eval_seeds=[0, 1, 2]",
    )
    reference = fedsub.run(config_lib.load(None, (*overrides, *nodes)))["fedsubavg"].params
    assert reference is not None
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(flower[name], value, rtol=0, atol=1e-5)
    plain = fedsub.run(config_lib.load(None, (*overrides[: -len(dp)], *nodes)))["fedsubavg"]
    assert plain.params is not None
    assert any(
        not torch.allclose(v, flower[n], atol=1e-4) for n, v in plain.params.state_dict().items()
    )
