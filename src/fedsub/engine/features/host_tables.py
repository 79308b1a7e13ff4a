"""Host tables (``execution.table_placement = "host"``) as a feature: the tables are drawn
and kept on the host, each round's rows are staged on the device around the client work, the
aggregate's rows come back to the host and get the heat coefficients there
(engine/placement.py), and the model is evaluated on the host."""

from __future__ import annotations

import dataclasses

from fedsub.algorithms.aggregation import Aggregation
from fedsub.algorithms.server_optimizer import ServerOptimizer
from fedsub.engine import placement
from fedsub.engine.contribution import (
    Combining,
    Evaluate,
    Feature,
    Placed,
    RoundContribution,
    RoundSetup,
)
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.initial import initial_params

NAME = "host_tables"


def place(setup: RoundSetup) -> Placed | None:
    """Round 0's model with its tables drawn on the host, where they stay."""
    schedule = setup.schedule
    execution = schedule.execution
    if execution.table_placement != "host" or setup.model is None:
        return None
    on_host = dataclasses.replace(execution, device=placement.HOST)
    drawn = initial_params(setup.model, dataclasses.replace(schedule, execution=on_host))
    params = placement.place(drawn, execution.device)
    return Placed(params, placement.HostTables.of(setup.algorithm, execution.device))


def without_coefficients(aggregation: Aggregation) -> Aggregation:
    """The aggregation with its per-row coefficients left to whoever applies them."""
    return dataclasses.replace(aggregation, coefficients=None)


def on_host(evaluator: Evaluator) -> Evaluate:
    return lambda params: evaluator.evaluate(params.to(placement.HOST))


def contribute(setup: RoundSetup) -> RoundContribution | None:
    host = setup.earlier.get(NAME)
    if not isinstance(host, placement.HostTables):
        return None
    algorithm = setup.algorithm

    def check(server: ServerOptimizer) -> None:
        placement.check_row_local(algorithm, server)

    return RoundContribution(
        NAME,
        client_stage=host.wrap,  # config.py refuses privacy with host tables
        combining=Combining(aggregation=without_coefficients, received=host.receive),
        evaluator=on_host,
        checks=check,
        handle=host,
    )


FEATURE = Feature(NAME, contribute, place)
