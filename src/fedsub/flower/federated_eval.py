"""Federated evaluation: each node scores the global model on its own samples and reports
sums, so the server gets global metrics without any sample.

A node's query reply carries, beside its S(k), the rows its held-out samples read
(``eval-index``); an evaluation round sends each node those rows of the global model, and the
node replies (flower/node_eval.py) its held-out loss sum, sample count and correct predictions,
the same for its training samples, and for a binary model the positives and negatives per
score bin (engine/binned_auc.py). The server adds them up (``FederatedEvaluation``): the
test loss and accuracy are exactly those of the pooled held-out samples; the AUC is the
binned one, reported with its bound ``test_auc_bin_error``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedsub.data.federated import SampleSet
from fedsub.engine.binned_auc import BINS, binned_auc
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.metrics import roc_auc
from fedsub.errors import FedsubError
from fedsub.flower.records import number_of, record_of, submodel_record
from fedsub.models.base import Model
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import pull

EVAL_INDEX = "eval-index"  # the query reply's record of the rows a node's evaluation reads
LOG = logging.getLogger("fedsub")
SUMS = [f"{p}{k}" for p in ("", "train-") for k in ("num-examples", "loss-sum", "correct")]


class FederatedEvaluation:
    """The server half: which rows each node's evaluation reads, the evaluation messages of a
    round, and the global metrics from the replies (kept in ``results`` by round)."""

    def __init__(self, every: int, rounds: int, query: dict[str, int | str] | None = None):
        self.every = every
        self.rounds = rounds
        self.query = dict(query or {})  # sent with every message, e.g. the run's spec hash
        self.rows: dict[int, dict[str, np.ndarray]] = {}
        self.results: dict[int, dict[str, float]] = {}
        # nodes that keep their rows to themselves (a private heat source): sent the whole model
        self.whole: set[int] = set()
        # nodes that missed their latest training round: not asked to evaluate (a dead node
        # would hold the evaluation up for the whole round timeout) until they reply again
        self.silent: set[int] = set()

    def note_replies(self, sampled: set[int], left_out: list[int]) -> None:
        self.silent = (self.silent - sampled) | set(left_out)

    def due(self, server_round: int) -> bool:
        if not self.every:
            return False
        return server_round % self.every == 0 or server_round == self.rounds

    def learn(self, client: int, content: RecordDict) -> None:
        """Keep a query reply's evaluation rows (a node that sent none is not evaluated)."""
        if EVAL_INDEX not in content:
            return
        record = record_of(content, EVAL_INDEX, ArrayRecord)
        self.rows[client] = {
            k[len("rows.") :]: v.numpy() for k, v in record.to_torch_state_dict().items()
        }

    def learn_whole(self, client: int) -> None:
        """Evaluate ``client`` on the whole model: it does not tell its rows."""
        self.whole.add(client)

    def messages(self, server_round: int, params: Params, node_of: dict[int, int]) -> list[Message]:
        if not self.due(server_round):
            return []
        config = ConfigRecord({"round": server_round, **self.query})
        messages = []
        whole = None
        for client in sorted((set(self.rows) | self.whole) - self.silent):
            if client not in node_of:  # its node is offline or left out: not asked
                continue
            if client in self.whole:  # no rows named: the node takes its own
                submodel = whole = whole or ArrayRecord(params.state_dict())
            else:
                rows = {t: torch.from_numpy(r) for t, r in self.rows[client].items()}
                submodel = submodel_record(rows, pull(params, rows))
            content = RecordDict({"arrays": submodel, "config": config})
            messages.append(
                Message(content, node_of[client], MessageType.EVALUATE, group_id=str(server_round))
            )
        return messages

    def aggregate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        if not self.due(server_round):
            return None
        reports = []
        for reply in replies:
            if reply.has_error():  # that node's samples are left out of this evaluation
                LOG.warning(
                    "round %d: evaluation on node %d failed: %s",
                    server_round,
                    reply.metadata.src_node_id,
                    reply.error.reason,
                )
                continue
            reports.append(record_of(reply.content, "metrics", MetricRecord))
        return MetricRecord(dict(self.combine(server_round, reports)))

    def combine(self, server_round: int, reports: list[MetricRecord]) -> dict[str, float]:
        """The global metrics from the nodes' reports (kept in ``results``)."""
        total: dict[str, float] = {}
        positives = np.zeros(BINS, np.int64)
        negatives = np.zeros(BINS, np.int64)
        histograms = False
        for metrics in reports:
            for key in SUMS:
                if key in metrics:
                    total[key] = total.get(key, 0.0) + number_of(metrics, key)
            if "auc-positives" in metrics:
                histograms = True
                positives += _histogram(metrics, "auc-positives")
                negatives += _histogram(metrics, "auc-negatives")
        result = global_metrics(total, *((positives, negatives) if histograms else (None, None)))
        result["eval_nodes"] = float(len(reports))
        self.results[server_round] = result
        return result


def _histogram(metrics: MetricRecord, key: str) -> np.ndarray:
    counts = np.asarray(metrics[key], np.int64)
    if counts.shape != (BINS,):
        raise FedsubError(
            f"Flower: an evaluation reply's {key!r} has {counts.size} bins, expected {BINS}"
        )
    return counts


def global_metrics(
    total: dict[str, float], positives: np.ndarray | None, negatives: np.ndarray | None
) -> dict[str, float]:
    """Means over the pooled samples from the nodes' sums."""
    result: dict[str, float] = {}
    for prefix, name in (("train-", "train"), ("", "test")):
        n = total.get(f"{prefix}num-examples", 0.0)
        if n:
            result[f"{name}_loss"] = total[f"{prefix}loss-sum"] / n
            if f"{prefix}correct" in total:
                result[f"{name}_accuracy"] = total[f"{prefix}correct"] / n
            result[f"{name}_samples"] = n
    if positives is not None and negatives is not None:
        auc, bound = binned_auc(positives, negatives)
        result["test_auc"], result["test_auc_bin_error"] = auc, bound
    return result


def server_test_metrics(model: Model, params: Params, samples: SampleSet) -> dict[str, float]:
    """Exact metrics of the global model on the server's own test file (``server-test-file``:
    data the server holds, never a client's)."""
    outputs = Evaluator(model, samples, samples).outputs(params, samples).double()
    labels = torch.from_numpy(samples.labels).double()
    metrics = {"server_test_loss": float(model.loss(outputs, labels))}
    if model.task == "binary":
        metrics["server_test_accuracy"] = float(((outputs > 0) == (labels > 0.5)).double().mean())
        metrics["server_test_auc"] = roc_auc(samples.labels, outputs.numpy())
    return metrics
