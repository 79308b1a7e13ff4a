"""Federated evaluation: the nodes' sums give the pooled held-out samples' loss and accuracy,
and the histogram AUC is within its stated bound of scikit-learn's exact one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from fedsub.data.feature_spec import dataset_of_nodes
from fedsub.engine.binned_auc import binned_auc, score_histograms
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.initial import initial_params
from fedsub.errors import ConfigError, DataError
from fedsub.flower.federated_eval import FederatedEvaluation, node_report
from fedsub.flower.node_data import node_config_items, node_data
from fedsub.flower.run_model import federation
from fedsub.flower.settings import Deployment, FlowerSettings
from fedsub.submodel.transfer import pull

from .node_files import SPEC, write_federation


@pytest.mark.parametrize("spread", [0.3, 3.0, 30.0])  # from well spread to piled-up scores
def test_binned_auc_is_within_its_bound_of_sklearns_exact_auc(spread):
    rng = np.random.default_rng(int(spread * 10))
    labels = rng.integers(2, size=4000)
    probabilities = 1 / (1 + np.exp(-spread * (rng.normal(size=4000) + labels)))
    exact = roc_auc_score(labels, probabilities)
    # three nodes' histograms, added up by the server
    parts = np.array_split(np.arange(4000), [1000, 2500])
    histograms = [score_histograms(labels[p], probabilities[p]) for p in parts]
    positives = sum(h[0] for h in histograms)
    negatives = sum(h[1] for h in histograms)
    auc, bound = binned_auc(positives, negatives)
    assert abs(auc - exact) <= bound
    assert bound < (0.002 if spread < 10 else 0.5)  # 1000 bins: small unless scores pile up
    assert np.isnan(binned_auc(positives, np.zeros_like(negatives))[0])


def test_nodes_sums_give_the_pooled_held_out_metrics(tmp_path):
    federation = write_federation(tmp_path)
    settings = FlowerSettings(
        overrides=("model.init_std=0.5", "train.clients_per_round=3"),
        deployment=Deployment(feature_spec=str(federation.spec_file), num_nodes=3),
    )
    config = settings.fedsub_config()
    nodes = []
    for k, files in enumerate(federation.nodes):
        given: dict[str, object] = {
            "partition-id": k,
            "data-file": str(files.data_file),
            "feature-spec": str(federation.spec_file),
            "eval-seed": files.eval_seed,
        }
        if files.eval_file is not None:
            given["eval-file"] = str(files.eval_file)
        else:
            given["eval-fraction"] = files.eval_fraction
        nodes.append(node_data(settings, node_config_items(given)))
    params = initial_params(nodes[0].model, nodes[0].schedule)
    reports = []
    for node in nodes:
        rows = {t: torch.from_numpy(r) for t, r in node.eval_rows().items()}
        reports.append(node_report(node, rows, pull(params, rows)))
    federated = FederatedEvaluation().combine(reports)

    pooled = dataset_of_nodes(SPEC, federation.nodes)
    evaluator = Evaluator.build(nodes[0].model, pooled, 10**6, config.data.seed)
    central = evaluator.evaluate(params)
    assert federated["test_samples"] == len(pooled.test) and federated["eval_nodes"] == 3
    for key in ("test_loss", "train_loss", "test_accuracy", "train_accuracy"):
        assert federated[key] == pytest.approx(central[key], rel=1e-6), key
    logits = evaluator.outputs(params, pooled.test).double().numpy()
    exact = roc_auc_score(pooled.test.labels, logits)
    assert 0.5 < exact < 1 and abs(federated["test_auc"] - exact) <= federated["test_auc_bin_error"]

    # the node refuses a run whose spec is another, and a run without one
    with pytest.raises(DataError, match=r"version 9, hash 0000"):
        nodes[0].check_spec(9, "0" * 64)
    with pytest.raises(ConfigError, match="holds its own data-file, but the run has no"):
        nodes[0].check_spec(0, "")
    nodes[0].check_spec(SPEC.version, SPEC.hash)


def test_partition_nodes_hold_out_disjoint_shares_of_the_whole_test_set():
    settings = FlowerSettings(overrides=("data.num_users=3", "train.clients_per_round=3"))
    nodes = [
        node_data(settings, node_config_items({"partition-id": k, "num-partitions": 3}))
        for k in range(3)
    ]
    test = federation(settings).dataset.test
    assert sum(len(n.held_out) for n in nodes) == len(test) > 0
    pooled = np.sort(np.concatenate([n.held_out.labels for n in nodes]))
    np.testing.assert_array_equal(pooled, np.sort(test.labels))
    with pytest.raises(ConfigError, match="the run uses a feature spec"):
        nodes[0].check_spec(SPEC.version, SPEC.hash)


def test_run_settings_for_node_local_data_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="num-nodes = 0; with a feature-spec"):
        FlowerSettings.from_run_config({"feature-spec": str(tmp_path / "spec.json")})
    with pytest.raises(ConfigError, match=r"server-test-file = .* needs a feature-spec"):
        FlowerSettings.from_run_config({"server-test-file": "/srv/test.csv"})
    settings = FlowerSettings.from_run_config(
        {"feature-spec": "~/spec.json", "num-nodes": 2, "set": "train.clients_per_round=3"}
    )
    assert (
        settings.deployment.feature_spec.endswith("/spec.json")
        and "~" not in settings.deployment.feature_spec
    )
    with pytest.raises(ConfigError, match=r"clients_per_round = 3 is more than .* num-nodes = 2"):
        settings.check_against(settings.fedsub_config())
