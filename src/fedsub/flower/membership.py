"""Registration over Flower: a node registers by answering a QUERY message with its partition
id, its sample count and its index sets S(k) (``Registrar``, ``registration_of``); the
population they form is ``fedsub.engine.membership.Membership``."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedsub.engine.membership import Registration
from fedsub.flower.records import number_of, record_of

LOG = logging.getLogger("fedsub")


class Registrar:
    """Registration queries in flight: sent to a node when it comes online, collected whenever
    its answer has arrived, so a node that is slow to start (or dies before answering) never
    holds a round up."""

    def __init__(
        self,
        query: dict[str, int | str] | None = None,
        on_reply: Callable[[int, RecordDict], None] | None = None,
    ) -> None:
        # what the query asks ("index", or "partition" with a private heat source) and what
        # else it carries (the run's feature spec); on_reply sees every answer (a transcript)
        self.query = dict(query or {"what": "index"})
        self.on_reply = on_reply
        self.pending: dict[int, str] = {}  # node id -> the query's message id
        # answers pulled early (while a round waited for its replies), for the next collect
        self.arrived: list[tuple[Registration, RecordDict]] = []
        self.arrived_failed: list[int] = []

    def awaiting(self) -> set[int]:
        """The nodes asked whose answer was not collected yet (in flight or pulled early)."""
        return {*self.pending, *(r.node for r, _ in self.arrived), *self.arrived_failed}

    def ask(self, grid: Grid, nodes: list[int]) -> None:
        query = [
            Message(RecordDict({"query": ConfigRecord(dict(self.query))}), n, MessageType.QUERY)
            for n in nodes
        ]
        sent = list(grid.push_messages(query))
        self.pending.update(zip(nodes, sent, strict=True))

    def pull(self, grid: Grid) -> list[Registration]:
        """Pull the answers that arrived and keep them for the next ``collect``; the
        registrations among them."""
        answers, failed = self._pull(grid)
        self.arrived += answers
        self.arrived_failed += failed
        return [registration for registration, _ in answers]

    def collect(self, grid: Grid) -> tuple[list[tuple[Registration, RecordDict]], list[int]]:
        """The registrations that arrived (each with the reply's content), and the nodes whose
        query failed."""
        answers, failed = self._pull(grid)
        answers, failed = self.arrived + answers, self.arrived_failed + failed
        self.arrived, self.arrived_failed = [], []
        return answers, failed

    def _pull(self, grid: Grid) -> tuple[list[tuple[Registration, RecordDict]], list[int]]:
        if not self.pending:
            return [], []
        answers, failed = [], []
        for reply in grid.pull_messages(list(self.pending.values())):
            node = reply.metadata.src_node_id
            self.pending.pop(node, None)
            if reply.has_error():
                LOG.warning("query: node %d failed: %s", node, reply.error.reason)
                failed.append(node)
                continue
            if self.on_reply is not None:
                self.on_reply(node, reply.content)
            answers.append((registration_of(reply), reply.content))
        return answers, failed


def registration_of(reply: Message) -> Registration:
    """A node's answer to the query: ``metrics`` partition-id / num-examples, ``index``
    rows.<table>; a node whose heat source is private answers its partition only (no rows,
    no sample count: its heat goes by the private exchange)."""
    metrics = record_of(reply.content, "metrics", MetricRecord)
    partition = int(number_of(metrics, "partition-id"))
    if "index" not in reply.content:
        return Registration(partition, reply.metadata.src_node_id, 0, {})
    index = record_of(reply.content, "index", ArrayRecord)
    rows = {
        k[len("rows.") :]: v.numpy().astype(np.int64)
        for k, v in index.to_torch_state_dict().items()
    }
    return Registration(
        partition, reply.metadata.src_node_id, int(number_of(metrics, "num-examples")), rows
    )
