"""The randomized-response heat's secret as a feature: its one piece is the checkpoint stage
``heat_secret`` (privacy/randomness.py ``HeatCoins``), so that a resumed run reads back the key
its heat was computed from, before it builds the algorithms (runs/experiment.py). Only in secret
mode: a seeded run's coins are train.seed's, nothing to keep. The heat is computed in every
process alike (row-sharded tables: each its rows'), so every process keeps the stage."""

from __future__ import annotations

from fedsub.engine.contribution import Feature, RoundContribution, RoundSetup
from fedsub.privacy.randomness import HEAT_STAGE

NAME = "heat_secret"


def contribute(setup: RoundSetup) -> RoundContribution | None:
    coins = setup.algorithm.heat_coins
    if coins is None or not coins.guaranteed:
        return None
    return RoundContribution(NAME, stages={HEAT_STAGE: coins})


FEATURE = Feature(NAME, contribute)
