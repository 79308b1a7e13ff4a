"""Nodes joining a Flower run: registration over Flower Messages, fed over time into the
engine's membership, pushed and pulled apart from the rounds so that a slow or dead newcomer
never holds a round up. The policy: docs/tutorials/flower.md, "Elastic membership".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from logging import INFO

from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid

from fedsub.engine.membership import Membership, Registration
from fedsub.errors import FedsubError
from fedsub.flower.exchange import attributed
from fedsub.flower.federated_eval import EVAL_INDEX
from fedsub.flower.protocols import Recorder
from fedsub.flower.records import count_of, query_message, record_of, rows_in

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
        on_registered: Callable[[Registration, RecordDict, Registration | None], None],
        on_reply: Recorder | None = None,
    ) -> None:
        self.membership = membership
        # what the query asks ("index", or "partition" with a private heat source) and what
        # else it carries (the run's feature spec); on_reply sees every answer (a transcript)
        self.query, self.on_reply = query, on_reply
        self.exact = query.get("what", "index") == "index"  # S(k) and counts registered
        self.min_nodes = min_nodes
        self.partitions = 0  # the partitions the run expects (0: min_nodes of them)
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
        self.round = 1  # the round about to run (set by the runtime): what the log lines name
        self.online: set[int] = set()  # the nodes online at the last update

    def update(self, grid: Grid) -> set[int]:
        """Ask the nodes that came online since the last round to register (new clients and
        replacements), take the answers that arrived (the first call waits up to
        ``node_wait`` seconds for ``min_nodes`` of them); the nodes online."""
        deadline = time.monotonic() + self.node_wait
        while True:
            online = set(grid.get_node_ids())
            self._log_comings_and_goings(online)
            self.membership.forget_offline(online)
            # a node left out is asked again if it is online (offline, its question would
            # only come back from the SuperLink as unavailable)
            probe = (self.to_probe & online) - self._awaiting()
            self._ask(grid, self._not_asked(online) + sorted(probe))
            self.to_probe.clear()
            self._pull(grid)
            for registration, content in self.arrived:
                before = self.membership.registered.get(registration.partition)
                self.membership.register(registration)  # also readmits a dropped node
                self.answered.add(registration.node)
                self.on_registered(registration, content, before)
            for node in self.failed:
                self.membership.drop(node)
            self.arrived, self.failed = [], []
            if self.joined or len(self.answered) >= self.min_nodes:
                self.joined = True
                return online
            if time.monotonic() > deadline:
                registered = sorted(self.membership.registered)
                missing = sorted(set(range(self.partitions or self.min_nodes)) - set(registered))
                raise FedsubError(
                    f"Flower: {len(self.answered)} node(s) registered (of "
                    f"{len(online)} online) within node-wait = {self.node_wait:g} s; "
                    f"min-nodes = {self.min_nodes}; partition(s) missing: "
                    f"{_listed(missing)} (registered: {_listed(registered)}); each node's "
                    "failure, if it answered one, is logged above as 'registration: node ...'"
                )
            time.sleep(0.2)

    def _log_comings_and_goings(self, online: set[int]) -> None:
        """One line per registered node that went offline or came back since the last
        update (a node's first appearance is its registration's line)."""
        partition = {r.node: k for k, r in self.membership.registered.items()}
        for node in sorted((self.online - online) & partition.keys()):
            flwr_log(
                INFO,
                "fedsub: node %d (partition %d) went offline before round %d: not sampled "
                "while it is away",
                node,
                partition[node],
                self.round,
            )
        for node in sorted((online - self.online) & partition.keys() & self.answered):
            if self.online:  # not the first look
                flwr_log(
                    INFO, "fedsub: node %d (partition %d) is online again", node, partition[node]
                )
        self.online = online

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
        node_of = {message: node for node, message in self.pending.items()}
        for reply in grid.pull_messages(list(self.pending.values())):
            node = node_of.get(reply.metadata.reply_to_message_id)
            if node is None or node not in self.pending:  # not a question of ours (any more)
                continue
            reply = attributed(reply, node)  # the SuperLink's answer for a node that is gone
            del self.pending[node]
            if reply.has_error():
                LOG.warning("registration: node %d failed: %s", node, reply.error.reason)
                self.failed.append(node)
                continue
            if self.on_reply is not None:
                self.on_reply(node, "query", reply.content)
            try:
                registration = registration_of(
                    reply, self.membership.tables, self.partitions or None, self.exact
                )
                answers.append((registration, reply.content))
            except FedsubError as error:  # garbage: left out as a node that failed
                LOG.warning("registration: node %d: %s; left out", node, error)
                self.failed.append(node)
        self.arrived += answers
        return [registration for registration, _ in answers]


def registration_of(
    reply: Message, tables: Mapping[str, int], partitions: int | None = None, exact: bool = True
) -> Registration:
    """A node's answer to the query: ``metrics`` partition-id / num-examples, ``index``
    rows.<table>; with a private heat source (not ``exact``) a node answers its partition
    only (no rows, no sample count: its heat goes by the private exchange). Checked: a
    partition id >= 0 (below ``partitions`` when given), a count >= 0, row ids of every one
    of the model's ``tables`` (name -> rows); a ``FedsubError`` otherwise."""
    metrics = record_of(reply.content, "metrics", MetricRecord)
    partition = count_of(metrics, "partition-id", partitions)
    if not exact:
        return Registration(partition, reply.metadata.src_node_id, 0, {})
    rows = rows_in(record_of(reply.content, "index", ArrayRecord), tables)
    if missing := sorted(set(tables) - set(rows)):
        raise FedsubError(f"its registration names no rows of table(s) {missing}")
    if EVAL_INDEX in reply.content:  # the rows its evaluation reads: checked alike
        rows_in(record_of(reply.content, EVAL_INDEX, ArrayRecord), tables)
    examples = count_of(metrics, "num-examples")
    return Registration(partition, reply.metadata.src_node_id, examples, rows)


def _listed(values: list[int], most: int = 20) -> str:
    """``values`` as a list, the first ``most`` of a longer one and how many more."""
    if len(values) <= most:
        return str(values)
    return f"{str(values[:most])[:-1]}, ... ({len(values) - most} more)]"
