"""Differential privacy ([dp]) as a feature of the round.

Its pieces (engine/contribution.py): the run's random streams (dp/randomness.py: a secret, or
train.seed in seeded mode) key the cohort's draw; the central mechanism (``dp.mechanism``, from
dp/mechanisms.py's registry: the Gaussian one is dp/mechanism.py) overrides the round's
combine, and a round with no member left still adds its noise; the ledger (dp/ledger.py)
composes each round, stops the run before a round the budget cannot pay for, and adds the
epsilon spent so far to each evaluation; the ledger, the mechanism's own stages (adaptive
clipping's C) and the secret are checkpoint stages. When the accounting assumes a participation
pattern instead of sampling (DP-FTRL's, ``Accounting.ftrl``), the cohort draw enforces it
(dp/participation.py, a ``draw.filter``: on every runtime, Flower's ServerApp included), and
its state is a checkpoint stage (``dp_participation``). At ``privacy.level = "full"`` the clients
add the noise (distributed DP: engine/features/private.py gives the private rounds the streams
of this feature's ``DpRound``), and there is no central mechanism.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fedsub.dp.ledger import Ledger
from fedsub.dp.mechanisms import MECHANISMS, CentralMechanism, MechanismInputs, MechanismSpec
from fedsub.dp.participation import STAGE as PARTICIPATION
from fedsub.dp.participation import ParticipationBound
from fedsub.dp.randomness import STAGE as DP_SECRET
from fedsub.dp.randomness import DpStreams, streams_of
from fedsub.dp.settings import DpSettings
from fedsub.engine.contribution import (
    CohortDraw,
    Combining,
    Feature,
    Override,
    RoundContribution,
    RoundFeatures,
    RoundHooks,
    RoundSetup,
    handle_of,
    narrowed,
)
from fedsub.engine.schedule import Schedule
from fedsub.privacy.levels import Privacy
from fedsub.stateful import Stateful
from fedsub.submodel.transfer import CohortUpdate

LOG = logging.getLogger("fedsub")
NAME = "dp"


@dataclass(frozen=True)
class DpRound:
    """[dp]'s pieces of a run: its ledger, its random streams, and the central mechanism
    (None when the clients add the noise)."""

    ledger: Ledger
    streams: DpStreams
    mechanism: CentralMechanism | None
    spec: MechanismSpec | None = None
    # the participation pattern the accounting assumes, enforced at the cohort draw (DP-FTRL);
    # None: sampled cohorts, every client may be drawn in every round
    participation: ParticipationBound | None = None

    def stop_before(self, round_index: int) -> bool:
        """Whether round ``round_index``'s mechanism would spend more than the budget (then
        say so: the run stops before it)."""
        ledger = self.ledger
        if not ledger.would_exceed():
            return False
        spent, after = ledger.epsilon(), ledger.settings.epsilon(ledger.rounds + 1)
        LOG.warning(
            "stopped before round %d: its mechanism would bring epsilon from %.4g to %.4g, over "
            "the budget %.4g (dp.epsilon_budget or dp.target_epsilon) at delta %.3g",
            round_index,
            spent,
            after,
            ledger.settings.budget,
            ledger.settings.accounting.delta,
        )
        return True

    def stages(self) -> dict[str, Stateful]:
        stages: dict[str, Stateful] = {"dp_ledger": self.ledger}
        if self.mechanism is not None and self.spec is not None:
            stages.update(self.spec.stages(self.mechanism))  # e.g. adaptive clipping's C
        if self.streams.guaranteed:
            stages[DP_SECRET] = self.streams  # the secret: only checkpoints keep it
        if self.participation is not None:
            stages[PARTICIPATION] = self.participation  # who is still inside its window
        return stages


def dp_streams(schedule: Schedule) -> DpStreams | None:
    """[dp]'s random streams for this run (dp/randomness.py): a fresh secret (process 0's in
    every process), or train.seed in seeded mode; None without [dp]. A resumed run's secret
    is read back from its checkpoint (the ``dp_secret`` stage)."""
    settings = schedule.setting(DpSettings)
    return None if settings is None else streams_of(settings.randomness, schedule.seed)


def overriding(mechanism: CentralMechanism) -> Override:
    """The central mechanism's combine as the round's override: it reads the members' whole
    ``CohortUpdate`` (masking's slices are refused with [dp] by config.py)."""
    return lambda update, round_index: mechanism.combine(
        narrowed(update, CohortUpdate), round_index
    )


def contribute(setup: RoundSetup) -> RoundContribution | None:
    schedule, params = setup.schedule, setup.params
    settings, privacy = schedule.setting(DpSettings), schedule.setting(Privacy)
    streams = dp_streams(schedule)
    if settings is None or streams is None or params is None:
        return None
    mechanism, spec = None, None
    distributed = privacy is not None and privacy.secure_aggregation
    if not distributed:  # the central mechanism (dp.mechanism, dp/mechanisms.py)
        spec = MECHANISMS.get_or_refuse(settings.mechanism)
        table_rows = {t: int(table.shape[0]) for t, table in params.tables.items()}
        heat = setup.algorithm.aggregation.coefficients is not None  # FedSubAvg: private heat
        keep = privacy.keep if privacy is not None else 1.0
        inputs = MechanismInputs(settings, table_rows, setup.counts, heat, keep, streams)
        mechanism = spec.build(inputs)
    pattern = settings.accounting.ftrl  # DP-FTRL: no sampling, an enforced pattern
    bound = None if pattern is None else ParticipationBound(pattern, len(setup.counts))
    dp = DpRound(Ledger(settings), streams, mechanism, spec, bound)
    return RoundContribution(
        NAME,
        combining=Combining(
            override=None if mechanism is None else overriding(mechanism),
            combines_empty=mechanism is not None,  # the noise is added all the same
        ),
        hooks=RoundHooks(
            before_finish=lambda round_index: dp.ledger.compose_round(),
            stop_before=dp.stop_before,
            metrics=lambda: {"epsilon": dp.ledger.epsilon()},
        ),
        stages=dp.stages(),
        draw=CohortDraw(key=lambda: streams.key, filter=bound),
        handle=dp,
    )


def dp_round_of(features: RoundFeatures) -> DpRound | None:
    """The run's ``DpRound``, or None without [dp]."""
    return handle_of(features, NAME, DpRound)


FEATURE = Feature(NAME, contribute)
