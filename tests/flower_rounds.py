"""A Flower runtime driven one round at a time by the engine's loop (``loop.run_round``, as
``loop.drive`` runs it), for tests that look between rounds (no ServerApp, no processes); and
the node ids of the tests' in-process grids (``wide``).

Flower's node ids are unsigned 64-bit integers drawn at random, so half of a deployment's
nodes have an id at or above 2^63 (which int64 cannot hold). The in-process grids give their
nodes ``wide(n)`` for the small names the tests write (100, 101, ...): ids spread over the
whole range, the first ones on either side of 2^63 and not in the order of their names, so
code that keeps a node id in an int64 (a checkpoint, an array) or relies on their order fails
in process as it would on real nodes."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fedsub.dp.settings import DpSettings
from fedsub.engine.loop import RunControl, run_round
from fedsub.engine.server_round import ServerRound
from fedsub.flower.server_runtime import FlowerRuntime, Served

WIDE = 0x9E3779B97F4A7C15  # odd: n -> n * WIDE mod 2^64 is a bijection of the uint64 ids
UNWIDE = pow(WIDE, -1, 2**64)


def wide(name: int) -> int:
    """The node id the in-process grids give the node a test calls ``name``: 100 -> 1.48e19
    (>= 2^63), 101 -> 7.8e18, 102 -> 7.3e17, 103 -> 1.21e19, ..."""
    return name * WIDE % 2**64


def narrow(node: int) -> int:
    """The test's name of the node with id ``node`` (``wide``'s inverse)."""
    return node * UNWIDE % 2**64


@dataclass
class Stepped:
    """A Flower runtime and the loop's server round (built at the first ``open`` or round)."""

    runtime: FlowerRuntime
    server: ServerRound | None = None

    def __getattr__(self, name: str) -> Any:  # its records, membership, params: the runtime's
        return getattr(self.runtime, name)

    def open(self) -> ServerRound:
        """Registration (and a private heat source's exchange): the run's server round."""
        if self.server is None:
            self.server = self.runtime.open(RunControl())
        return self.server

    def step(self, round_index: int) -> None:
        run_round(self.open(), self.runtime, round_index)

    def train(self, rounds: int) -> None:
        for r in range(1, rounds + 1):
            self.step(r)


def private_runtime(settings, grid) -> Stepped:
    """The ServerApp's runtime for ``settings`` (a fedsub config's dataset partitioned over
    its nodes, every one of them registered before round 1; [dp] resolved for them, as
    flower/run_model.py resolves it) over ``grid``."""
    from fedsub.engine.features.private import server_heat
    from fedsub.engine.initial import initial_params
    from fedsub.flower.run_model import federation
    from fedsub.runs.run_setup import dp_of, heat_privacy_of

    fed = federation(settings)
    dp = dp_of(fed.config, fed.dataset.num_clients)
    schedule = fed.schedule.with_setting(DpSettings, dp)  # as the app
    name = settings.algorithm_name(fed.config)
    served = Served(name, fed.config.algorithm_options(name), fed.config.train.heat)
    return Stepped(
        FlowerRuntime(
            grid,
            initial_params(fed.model, schedule),
            served,
            schedule,
            replace(settings, nodes=replace(settings.nodes, min_nodes=fed.dataset.num_clients)),
            server_heat(heat_privacy_of(fed.config)),
            partitions=fed.dataset.num_clients,
        )
    )


def recorded(grid) -> list:
    """Every message pushed to ``grid`` from now on, in order (its push_messages wrapped)."""
    sent: list = []
    push = grid.push_messages

    def pushing(messages):
        messages = list(messages)
        sent.extend(messages)
        return push(messages)

    grid.push_messages = pushing
    return sent
