"""Federated evaluation over Flower: each node scores the global model on its own samples and
reports sums (engine/federated_metrics.py's arithmetic), so the server gets global metrics
without any sample.

A node's query reply carries, beside its S(k), the rows its held-out samples read
(``eval-index``); an evaluation round sends each node those rows of the global model, and the
node replies its sums (``node_report``); the server adds them up (``FederatedEvaluation``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedsub.engine.binned_auc import BINS
from fedsub.engine.federated_metrics import SUMS, client_sums, pooled_metrics
from fedsub.errors import FedsubError
from fedsub.flower.node_data import NodeData
from fedsub.flower.records import number_of, packed, record_of, rows_in, submodel_record
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import pull

EVAL_INDEX = "eval-index"  # the query reply's record of the rows a node's evaluation reads
LOG = logging.getLogger("fedsub")


class FederatedEvaluation:
    """The server half: which rows each node's evaluation reads, the evaluation messages of a
    round, and the global metrics from the replies (the loop keeps them by round)."""

    def __init__(self) -> None:
        # the rows a client's evaluation reads; None: it keeps them to itself (a private heat
        # source), and is sent the whole model
        self.rows: dict[int, dict[str, np.ndarray] | None] = {}
        # nodes that missed their latest training round: not asked to evaluate (a dead node
        # would hold the evaluation up for the whole round timeout) until they reply again
        self.silent: set[int] = set()

    def note_replies(self, sampled: set[int], left_out: list[int]) -> None:
        self.silent = (self.silent - sampled) | set(left_out)

    def learn(self, client: int, content: RecordDict | None) -> None:
        """Keep a query reply's evaluation rows (a node that sent none is not evaluated);
        ``None``: evaluate ``client`` on the whole model, it does not tell its rows."""
        if content is None:
            self.rows[client] = None
        elif EVAL_INDEX in content:
            self.rows[client] = rows_in(record_of(content, EVAL_INDEX, ArrayRecord))

    def messages(
        self, server_round: int, params: Params, node_of: dict[int, int], query: dict
    ) -> list[Message]:
        """The round's evaluation Messages to the nodes online (``node_of``), each carrying
        ``query`` (the run's feature spec)."""
        config = ConfigRecord({"round": server_round, **query})
        messages = []
        whole = None
        for client in sorted(set(self.rows) - self.silent):
            if client not in node_of:  # its node is offline or left out: not asked
                continue
            if (named := self.rows[client]) is None:  # no rows named: the node takes its own
                submodel = whole = whole or packed(params.state_dict())
            else:
                rows = {t: torch.from_numpy(r) for t, r in named.items()}
                submodel = submodel_record(rows, pull(params, rows))
            content = RecordDict({"arrays": submodel, "config": config})
            messages.append(
                Message(content, node_of[client], MessageType.EVALUATE, group_id=str(server_round))
            )
        return messages

    def aggregate(self, server_round: int, replies: Iterable[Message]) -> dict[str, float]:
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
            try:  # a node's garbage leaves its samples out, never stops the run
                report = record_of(reply.content, "metrics", MetricRecord)
                self.combine([report])
            except FedsubError as error:
                LOG.warning(
                    "round %d: evaluation on node %d left out: %s",
                    server_round,
                    reply.metadata.src_node_id,
                    error,
                )
                continue
            reports.append(report)
        return self.combine(reports)

    def combine(self, reports: list[MetricRecord]) -> dict[str, float]:
        """The global metrics from the nodes' reports."""
        sums = [{k: float(number_of(m, k)) for k in SUMS if k in m} for m in reports]
        histograms = [
            (_histogram(m, "auc-positives"), _histogram(m, "auc-negatives"))
            for m in reports
            if "auc-positives" in m
        ]
        result = pooled_metrics(sums, histograms)
        result["eval_nodes"] = float(len(reports))
        return result


def _histogram(metrics: MetricRecord, key: str) -> np.ndarray:
    counts = np.asarray(metrics[key], np.int64)
    if counts.shape != (BINS,):
        raise FedsubError(
            f"Flower: an evaluation reply's {key!r} has {counts.size} bins, expected {BINS}"
        )
    return counts


def node_report(node: NodeData, rows: dict[str, torch.Tensor], params: Params) -> MetricRecord:
    """The node's sums on its held-out and training samples under ``params`` (its rows)."""
    return MetricRecord(
        client_sums(
            node.model,
            node.held_out,
            node.train,
            lambda field: rows[node.table_of(field)].numpy(),
            params,
            node.client,
        )
    )
