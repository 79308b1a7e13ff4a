"""Width-slice masking as a feature: the members train on their width slices
(engine/masked.py) and the round aggregates the slices (masking/aggregate.py)."""

from __future__ import annotations

from fedsub.algorithms.aggregation import Aggregation, ServerUpdate, aggregation_weights
from fedsub.engine import masked
from fedsub.engine.contribution import (
    Combine,
    Combining,
    Feature,
    RoundContribution,
    RoundSetup,
    taking,
)
from fedsub.masking.aggregate import MaskedCohortUpdate, aggregate_slices

NAME = "masking"


def contribute(setup: RoundSetup) -> RoundContribution | None:
    masking, params = setup.schedule.masking, setup.params
    stage = masked.on_slices(masking)
    if stage is None or masking is None or params is None:
        return None
    dense = params.dense

    def combine(aggregation: Aggregation) -> Combine:
        def combined(update: MaskedCohortUpdate) -> ServerUpdate:
            weights = aggregation_weights(update, aggregation)
            return aggregate_slices(update, weights, dense, masking.aggregation)

        return taking(MaskedCohortUpdate, combined)

    return RoundContribution(NAME, client_stage=stage, combining=Combining(combine=combine))


FEATURE = Feature(NAME, contribute)
