"""Nodes joining a Flower run: registration over Flower Messages, fed over time into the
engine's membership, pushed and pulled apart from the rounds so that a slow or dead newcomer
never holds a round up. The policy: docs/tutorials/flower.md, "Elastic membership".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedsub.engine.membership import Membership, Registration
from fedsub.errors import FedsubError
from fedsub.flower.heat_exchange import Recorder
from fedsub.flower.records import number_of, query_message, record_of, rows_in

LOG = logging.getLogger("fedsub")
NEWCOMERS_EVERY = 1.0  # seconds between two looks for new nodes while a round waits


class Joining:
    """Who has registered with this ServerApp, asked or to be asked (``membership`` keeps the
    registrations; ``on_registered`` sees each with its reply's content). A node is asked when
    it comes online, its answer collected whenever it has arrived, so a node that is slow to
    start (or dies before answering) never holds a round up."""

    def __init__(
        self,
        membership: Membership,
        query: dict[str, int | str],
        min_nodes: int,
        node_wait: float,
        on_registered: Callable[[Registration, RecordDict], None],
        on_reply: Recorder | None = None,
    ) -> None:
        self.membership = membership
        # what the query asks ("index", or "partition" with a private heat source) and what
        # else it carries (the run's feature spec); on_reply sees every answer (a transcript)
        self.query, self.on_reply = query, on_reply
        self.min_nodes = min_nodes
        self.node_wait = node_wait
        self.on_registered = on_registered
        self.joined = False  # min_nodes registered once
        # nodes that answered this ServerApp's query: a resumed run asks again, which also
        # waits (node-wait) for the nodes' ClientApps to start serving the new Flower run
        self.answered: set[int] = set()
        self.to_probe: set[int] = set()  # nodes that missed a round, to be asked again
        self.next_newcomers = 0.0  # when a waiting round next looks for new nodes
        self.pending: dict[int, str] = {}  # node id -> its query's message id
        # answers pulled (maybe while a round waited for its replies), until the next update
        self.arrived: list[tuple[Registration, RecordDict]] = []
        self.failed: list[int] = []

    def update(self, grid: Grid) -> set[int]:
        """Ask the nodes that came online since the last round to register (new clients and
        replacements), take the answers that arrived (the first call waits up to
        ``node_wait`` seconds for ``min_nodes`` of them); the nodes online."""
        deadline = time.monotonic() + self.node_wait
        while True:
            online = set(grid.get_node_ids())
            self.membership.forget_offline(online)
            self._ask(grid, self._not_asked(online) + sorted(self.to_probe - self._awaiting()))
            self.to_probe.clear()
            self._pull(grid)
            for registration, content in self.arrived:
                self.membership.register(registration)  # also readmits a dropped node
                self.answered.add(registration.node)
                self.on_registered(registration, content)
            for node in self.failed:
                self.membership.drop(node)
            self.arrived, self.failed = [], []
            if self.joined or len(self.answered) >= self.min_nodes:
                self.joined = True
                return online
            if time.monotonic() > deadline:
                raise FedsubError(
                    f"Flower: {len(self.answered)} node(s) registered (of "
                    f"{len(online)} online) within node-wait = {self.node_wait:g} s; "
                    f"min-nodes = {self.min_nodes}"
                )
            time.sleep(0.2)

    def leave_out(self, node: int) -> None:
        """A node that did not reply: not sampled until it answers a registration question
        (asked at the next round), so a slow node comes back."""
        self.membership.drop(node)
        self.to_probe.add(node)

    def ask_newcomers(self, grid: Grid) -> set[int]:
        """While a round waits for its replies, ask the nodes that came online to register
        and pull the answers that arrived (at most every ``NEWCOMERS_EVERY`` seconds); they
        are taken at the next round. The nodes whose partition a newcomer took over: the
        round waits no longer for them (a dead node's replacement ends the wait for it)."""
        now = time.monotonic()
        if now < self.next_newcomers:
            return set()
        self.next_newcomers = now + NEWCOMERS_EVERY
        self._ask(grid, self._not_asked(set(grid.get_node_ids())))
        taken_over = set()
        for registration in self._pull(grid):
            before = self.membership.registered.get(registration.partition)
            if before is not None and before.node != registration.node:
                taken_over.add(before.node)
        return taken_over

    def _not_asked(self, online: set[int]) -> list[int]:
        """The nodes online that were never asked to register (nor are being asked)."""
        asked = self.answered | self.membership.dropped | self._awaiting()
        return sorted(online - asked)

    def _awaiting(self) -> set[int]:
        """The nodes asked whose answer was not taken yet (in flight or pulled early)."""
        return {*self.pending, *(r.node for r, _ in self.arrived), *self.failed}

    def _ask(self, grid: Grid, nodes: list[int]) -> None:
        if nodes:
            sent = grid.push_messages([query_message(n, self.query) for n in nodes])
            self.pending.update(zip(nodes, sent, strict=True))

    def _pull(self, grid: Grid) -> list[Registration]:
        """Pull the answers that arrived, kept for the next ``update``; their registrations."""
        if not self.pending:
            return []
        answers = []
        for reply in grid.pull_messages(list(self.pending.values())):
            node = reply.metadata.src_node_id
            self.pending.pop(node, None)
            if reply.has_error():
                LOG.warning("query: node %d failed: %s", node, reply.error.reason)
                self.failed.append(node)
                continue
            if self.on_reply is not None:
                self.on_reply(node, "query", reply.content)
            answers.append((registration_of(reply), reply.content))
        self.arrived += answers
        return [registration for registration, _ in answers]


def registration_of(reply: Message) -> Registration:
    """A node's answer to the query: ``metrics`` partition-id / num-examples, ``index``
    rows.<table>; a node whose heat source is private answers its partition only (no rows,
    no sample count: its heat goes by the private exchange)."""
    metrics = record_of(reply.content, "metrics", MetricRecord)
    partition = int(number_of(metrics, "partition-id"))
    if "index" not in reply.content:
        return Registration(partition, reply.metadata.src_node_id, 0, {})
    rows = rows_in(record_of(reply.content, "index", ArrayRecord))
    return Registration(
        partition, reply.metadata.src_node_id, int(number_of(metrics, "num-examples")), rows
    )
