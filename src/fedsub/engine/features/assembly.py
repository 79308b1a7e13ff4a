"""The one assembler: the round's features asked in one explicit order (``FEATURES``), their
contributions (engine/contribution.py) folded into the server round and the client work.

The order is the order of the client stages, innermost first: the torchrun split, width-slice
masking, [dp] (no stage: it comes before the private rounds, which read its random streams),
the private rounds, host tables, row-sharded tables (alone: config.py refuses the others with
it, ``check_combinations``), then the randomized-response heat's secret (a checkpoint stage
only, with any of them). Round 0's model is placed by the first feature that places it
(host tables, row sharding), else drawn whole on the device.

A runtime that runs its own client work (Flower) gets only the server's features
(``SERVER_FEATURES``) through ``build_server_round``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fedsub.algorithms.aggregation import ServerUpdate, aggregate
from fedsub.algorithms.registry import Algorithm
from fedsub.algorithms.scaffold import ControlVariates
from fedsub.data.federated import Population
from fedsub.engine.backends import backend_for
from fedsub.engine.cohort_job import RunCohort, composed
from fedsub.engine.contribution import (
    Combine,
    Feature,
    OneProcess,
    RoundContribution,
    RoundFeatures,
    RoundSetup,
    Safety,
    taking,
)
from fedsub.engine.features import (
    dp,
    host_tables,
    masking,
    private,
    row_sharding,
    torchrun_split,
)
from fedsub.engine.guards import Rejection
from fedsub.engine.initial import ModelStart, initial_params
from fedsub.engine.schedule import Schedule
from fedsub.engine.server_round import ServerRound
from fedsub.errors import ConfigError
from fedsub.models.base import Model
from fedsub.stateful import Stateful
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import CohortUpdate, Updates

FEATURES: tuple[Feature, ...] = (
    torchrun_split.FEATURE,
    masking.FEATURE,
    dp.FEATURE,
    private.FEATURE,
    host_tables.FEATURE,
    row_sharding.FEATURE,
    private.HEAT_SECRET,  # only a checkpoint stage: the randomized-response heat's secret
)
"""Every feature of the round, in the one order they are asked and composed in."""

EXCLUSIVE: dict[tuple[str, str], str] = {
    (masking.NAME, private.NAME): "the private rounds aggregate whole rows, not width slices",
    (dp.NAME, host_tables.NAME): "the mechanism adds noise on the device",
    (masking.NAME, dp.NAME): "the mechanism clips whole updates, not width slices",
    (masking.NAME, row_sharding.NAME): "row sharding splits the cohort its own way",
    (private.NAME, row_sharding.NAME): "row sharding routes whole row updates to their owners",
    (dp.NAME, row_sharding.NAME): "the mechanism needs every row in one process",
    (host_tables.NAME, row_sharding.NAME): "row sharding keeps its rows on the device",
    (torchrun_split.NAME, row_sharding.NAME): "row sharding splits the cohort its own way",
}
"""Pairs of features the assembler never composes (the later one's stage would not see what
the earlier one's assumes); config.py refuses each pair (tests/test_contribution.py)."""

SERVER_FEATURES: tuple[Feature, ...] = (dp.FEATURE,)
"""The features of a runtime that runs its own client work and aggregation (Flower)."""


@dataclass(frozen=True)
class Assembly:
    """How a run's rounds are kept safe and watched: screening (``max_update_norm``,
    ``on_reject``) and, by feature name, a callback given its handle before round 1 (e.g.
    ``{"private_rounds": ...}`` to keep a transcript)."""

    max_update_norm: float = 0.0
    on_reject: Callable[[Rejection], None] | None = None
    watch: Mapping[str, Callable[[object], None]] = field(default_factory=dict)


@dataclass(frozen=True)
class Assembled:
    """A run's server round and its client work (the backend inside the features' stages)."""

    rounds: ServerRound
    run_cohort: RunCohort


def placed(
    setup: RoundSetup, start: ModelStart | None, features: Sequence[Feature] | None = None
) -> tuple[Params, dict[str, object]]:
    """Round 0's model where the run keeps it (the first feature that places it, else whole on
    the device) and the placing feature's handle by name: the seeded draw, its values replaced
    by the model file ``start``'s (copied in place: each tensor stays where it is kept)."""
    params, handles = None, {}
    for feature in FEATURES if features is None else features:
        where = None if feature.place is None else feature.place(setup)
        if where is not None:
            params, handles = where.params, {feature.name: where.handle}
            break
    if params is None:
        assert setup.model is not None, "only a run that draws its model places it"
        params = initial_params(setup.model, setup.schedule)
    if start is not None:
        start.read_into(params)
    return params, handles


def contributions(
    setup: RoundSetup, features: Sequence[Feature] | None = None
) -> tuple[RoundContribution, ...]:
    """Each feature's contribution in order (default ``FEATURES``), each seeing the handles of
    those before it; a combination ``EXCLUSIVE`` names is refused."""
    earlier, given = dict(setup.earlier), []
    for feature in FEATURES if features is None else features:
        contribution = feature.contribute(dataclasses.replace(setup, earlier=dict(earlier)))
        if contribution is not None:
            given.append(contribution)
            earlier[contribution.name] = contribution.handle
    check_combination([c.name for c in given])
    return tuple(given)


def check_combination(names: Sequence[str]) -> None:
    """Refuse two features ``EXCLUSIVE`` names together (config.py refuses them first, with
    the keys to change; this says which assumption of the order broke if it ever did not)."""
    for (first, second), why in EXCLUSIVE.items():
        if first in names and second in names:
            raise ConfigError(f"features {first!r} and {second!r} cannot run together: {why}")


def folded(given: Sequence[RoundContribution], assembly: Assembly) -> RoundFeatures:
    """The contributions as the server round and the loop run them (the last agreement and
    saver given win: row sharding's)."""
    agreements = [c.processes.agreement for c in given if c.processes.agreement is not None]
    savers = [c.processes.saver for c in given if c.processes.saver is not None]
    return RoundFeatures(
        tuple(given),
        agreement=agreements[-1] if agreements else OneProcess(),
        saver=savers[-1] if savers else None,
        safety=Safety(assembly.max_update_norm, assembly.on_reject),
    )


def combine_of(
    given: Sequence[RoundContribution], algorithm: Algorithm, schedule: Schedule
) -> Combine:
    """How the round's cohort update becomes the server's update: the algorithm's aggregation
    as the features adjust it, on the run's device; aggregated plainly or as the last feature
    that builds a combine does; then each feature's ``received`` in order."""
    aggregation = algorithm.aggregation
    parts = [c.combining for c in given]
    for part in parts:
        if part.aggregation is not None:
            aggregation = part.aggregation(aggregation)
    aggregation = aggregation.to(schedule.execution.device)
    builders = [p.combine for p in parts if p.combine is not None]

    def plain(update: CohortUpdate) -> ServerUpdate:
        return aggregate(update, aggregation)

    combine = builders[-1](aggregation) if builders else taking(CohortUpdate, plain)
    received = [p.received for p in parts if p.received is not None]
    if not received:
        return combine

    def combined(update: Updates) -> ServerUpdate:
        server_update = combine(update)
        for receive in received:
            server_update = receive(server_update)
        return server_update

    return combined


def build_server_round(
    algorithm: Algorithm,
    dataset: Population,
    index: SubmodelIndex,
    schedule: Schedule,
    params: Params,
    combine: Combine,
    assembly: Assembly,
    features: RoundFeatures | None = None,
    stages: Mapping[str, Stateful] | None = None,
) -> ServerRound:
    """The server half of the run's rounds, with every stateful stage freshly initialised;
    ``features``: the run's (default: ``SERVER_FEATURES``' for it); ``stages``: a runtime's
    own, checkpointed after the features' (Flower's population)."""
    variates = (
        ControlVariates(params, index, dataset.num_clients) if algorithm.control_variates else None
    )
    counts = dataset.sample_counts()
    if features is None:
        setup = RoundSetup(None, algorithm, schedule, counts, params)
        features = folded(contributions(setup, SERVER_FEATURES), assembly)
    if stages:
        extra = RoundContribution("runtime", stages=dict(stages))
        features = dataclasses.replace(features, contributions=(*features.contributions, extra))
    server = algorithm.make_server(params)
    return ServerRound(algorithm, schedule, counts, params, server, combine, variates, features)


def assemble(
    model: Model,
    algorithm: Algorithm,
    dataset: Population,
    index: SubmodelIndex,
    schedule: Schedule,
    assembly: Assembly,
    start: ModelStart | None = None,
) -> Assembled:
    """The in-process run's server round and client work, every feature in ``FEATURES``'s
    order."""
    counts = dataset.sample_counts()
    setup = RoundSetup(model, algorithm, schedule, counts)
    params, handles = placed(setup, start)
    given = contributions(dataclasses.replace(setup, params=params, earlier=handles))
    features = folded(given, assembly)
    for name, watch in assembly.watch.items():
        contribution = features.of(name)
        if contribution is not None:
            watch(contribution.handle)
    backend = backend_for(schedule.execution.backend, model, algorithm.name).run_cohort
    run_cohort = composed(backend, [c.client_stage for c in given])
    combine = combine_of(given, algorithm, schedule)
    rounds = build_server_round(
        algorithm, dataset, index, schedule, params, combine, assembly, features
    )
    features.check(rounds.server)
    return Assembled(rounds, run_cohort)
