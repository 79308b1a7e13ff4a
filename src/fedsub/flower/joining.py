"""Nodes joining a Flower run (the elastic membership of flower/membership.py, over time).

Each round, the nodes online (``grid.get_node_ids()``) that were never asked are asked to
register (their partition id, and with exact heat their sample count and index sets S(k)),
and the answers that arrived are taken; the first round waits up to ``node_wait`` seconds for
``min_nodes`` of them. A node that missed a round (``leave_out``) is asked again and is
sampled once it answers. While a round waits for its replies, new nodes are asked too
(``ask_newcomers``): a replacement started during a round is sampled from the next round on,
and the round stops waiting for the node it replaced.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flwr.app import RecordDict
from flwr.serverapp import Grid

from fedsub.engine.membership import Membership, Registration
from fedsub.errors import FedsubError
from fedsub.flower.membership import Registrar

NEWCOMERS_EVERY = 1.0  # seconds between two looks for new nodes while a round waits


class Joining:
    """Who has registered with this ServerApp, asked or to be asked (``membership`` keeps the
    registrations; ``on_registered`` sees each with its reply's content)."""

    def __init__(
        self,
        membership: Membership,
        registrar: Registrar,
        min_nodes: int,
        node_wait: float,
        on_registered: Callable[[Registration, RecordDict], None],
    ) -> None:
        self.membership = membership
        self.registrar = registrar
        self.min_nodes = min_nodes
        self.node_wait = node_wait
        self.on_registered = on_registered
        self.joined = False  # min_nodes registered once
        # nodes that answered this ServerApp's query: a resumed run asks again, which also
        # waits (node-wait) for the nodes' ClientApps to start serving the new Flower run
        self.answered: set[int] = set()
        self.to_probe: set[int] = set()  # nodes that missed a round, to be asked again
        self.next_newcomers = 0.0  # when a waiting round next looks for new nodes

    def update(self, grid: Grid) -> set[int]:
        """Ask the nodes that came online since the last round to register (new clients and
        replacements), take the answers that arrived (the first call waits up to
        ``node_wait`` seconds for ``min_nodes`` of them); the nodes online."""
        deadline = time.monotonic() + self.node_wait
        while True:
            online = set(grid.get_node_ids())
            self.membership.forget_offline(online)
            probe = sorted(self.to_probe - self.registrar.awaiting())
            if new := self._not_asked(online) + probe:
                self.registrar.ask(grid, new)
            self.to_probe.clear()
            answers, failed = self.registrar.collect(grid)
            for registration, content in answers:
                self.membership.register(registration)  # also readmits a dropped node
                self.answered.add(registration.node)
                self.on_registered(registration, content)
            for node in failed:
                self.membership.drop(node)
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

    def _not_asked(self, online: set[int]) -> list[int]:
        """The nodes online that were never asked to register (nor are being asked)."""
        asked = self.answered | self.membership.dropped | self.registrar.awaiting()
        return sorted(online - asked)

    def ask_newcomers(self, grid: Grid) -> set[int]:
        """While a round waits for its replies, ask the nodes that came online to register
        and pull the answers that arrived (at most every ``NEWCOMERS_EVERY`` seconds); they
        are taken at the next round. The nodes whose partition a newcomer took over: the
        round waits no longer for them (a dead node's replacement ends the wait for it)."""
        now = time.monotonic()
        if now < self.next_newcomers:
            return set()
        self.next_newcomers = now + NEWCOMERS_EVERY
        if new := self._not_asked(set(grid.get_node_ids())):
            self.registrar.ask(grid, new)
        taken_over = set()
        for registration in self.registrar.pull(grid):
            before = self.membership.registered.get(registration.partition)
            if before is not None and before.node != registration.node:
                taken_over.add(before.node)
        return taken_over
