"""A Flower runtime driven one round at a time by the engine's loop (``loop.run_round``, as
``loop.drive`` runs it), for tests that look between rounds (no ServerApp, no processes)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fedsub.engine.loop import RunControl, run_round
from fedsub.engine.server_round import ServerRound
from fedsub.flower.server_runtime import FlowerRuntime, Served


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
    from fedsub.engine.loop import initial_params
    from fedsub.flower.run_model import federation
    from fedsub.runs.run_setup import dp_of, heat_privacy_of

    fed = federation(settings)
    schedule = replace(fed.schedule, dp=dp_of(fed.config, fed.dataset.num_clients))  # as the app
    name = settings.algorithm_name(fed.config)
    served = Served(name, fed.config.algorithm_options(name), fed.config.train.heat)
    return Stepped(
        FlowerRuntime(
            grid,
            initial_params(fed.model, schedule),
            served,
            schedule,
            replace(settings, nodes=replace(settings.nodes, min_nodes=fed.dataset.num_clients)),
            heat_privacy_of(fed.config),
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
