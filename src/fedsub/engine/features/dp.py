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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedsub.dp.distributed import DistributedDp
from fedsub.dp.ledger import Ledger
from fedsub.dp.mechanisms import MECHANISMS, CentralMechanism, MechanismInputs, MechanismSpec
from fedsub.dp.participation import STAGE as PARTICIPATION
from fedsub.dp.participation import ParticipationBound
from fedsub.dp.randomness import NOT_A_GUARANTEE, DpStreams, streams_of
from fedsub.dp.randomness import STAGE as DP_SECRET
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
from fedsub.stateful import Stateful
from fedsub.submodel.transfer import CohortUpdate

if TYPE_CHECKING:
    from fedsub.engine.loop import Evaluation

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

    def distributed(self, seed: int) -> DistributedDp:
        """Distributed DP's part in the private rounds' secure sums (privacy.level "full"),
        its members' shares keyed by this run's streams."""
        return distributed_dp(self.ledger.settings, seed, self.streams)


def distributed_dp(
    settings: DpSettings, seed: int = 0, streams: DpStreams | None = None
) -> DistributedDp:
    """[dp]'s public settings of a secure row sum's noise (dp/distributed.py), its members'
    shares keyed by ``streams`` (None: by ``seed``)."""
    z, k_min = settings.noise_multiplier, settings.survivors_needed
    k = settings.accounting.clients_per_round
    return DistributedDp(settings.clip, z, k_min, k, seed, streams)


def dp_settings(schedule: Schedule) -> DpSettings | None:
    """The run's [dp] settings, or None without [dp]."""
    return schedule.setting(DpSettings)


def server_noise(schedule: Schedule) -> DistributedDp | None:
    """Distributed DP's public settings for a Flower server's secure row sums (the nodes draw
    their shares), or None without [dp]."""
    settings = schedule.setting(DpSettings)
    return None if settings is None else distributed_dp(settings)


def flower_result(dp: DpRound | None, schedule: Schedule) -> dict[str, object]:
    """[dp]'s part of a Flower run's result: the model's epsilon after the rounds run (the
    ledger's) and where the noise and the cohorts came from (dp/randomness.py)."""
    result: dict[str, object] = {}
    if dp is not None:
        ledger = dp.ledger
        result["dp"] = {
            "epsilon": ledger.epsilon(),
            "rounds": ledger.rounds,
            **ledger.settings.as_json(),
        }
    settings = schedule.setting(DpSettings)
    if settings is not None:
        result["dp_randomness"] = settings.randomness
        if settings.randomness == "seeded":
            result["dp_not_a_guarantee"] = NOT_A_GUARANTEE
    return result


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
    settings = schedule.setting(DpSettings)
    streams = dp_streams(schedule)
    if settings is None or streams is None or params is None:
        return None
    mechanism, spec = None, None
    if settings.distributed is None:  # the central mechanism (dp.mechanism, dp/mechanisms.py)
        spec = MECHANISMS.get_or_refuse(settings.mechanism)
        table_rows = {t: int(table.shape[0]) for t, table in params.tables.items()}
        heat = setup.algorithm.aggregation.coefficients is not None  # FedSubAvg: private heat
        keep = settings.weights.download_keep  # the private download's p (1 without one)
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


# what a [dp] run's epsilon covers and what it does not (summary.json's dp records, summary.md;
# docs/getting-started/run-folder.md lists every file)
DP_COVERED = ["model.safetensors (the released model of every round, checkpoints too)", "epsilon"]
DP_NOT_COVERED = [
    "train and test metrics (computed in the clear on the users' training and held-out data)",
    "best",
    "rounds_to_target",
    "diverged (a stop decided from the train loss in the clear)",
]
DP_SCOPE_MARKDOWN = (
    "Differential privacy: epsilon covers the released models only. The metrics above (final "
    "and best, computed in the clear on the users' training and held-out data), the rounds to "
    "target and a divergence stop are not covered: they are the operator's, not for "
    "publication as private (docs: the run folder).\n"
)
# dp.public_test = true: the test split is declared public, so what is computed from the
# released models on it alone is post-processing, covered by the same epsilon
DP_COVERED_PUBLIC_TEST = [
    *DP_COVERED,
    "test metrics, their best and rounds_to_target (on the test split declared public: "
    "dp.public_test)",
]
DP_NOT_COVERED_PUBLIC_TEST = [
    "train metrics and their best (computed in the clear on the users' training data)",
    "diverged (a stop decided from the train loss in the clear)",
]
DP_SCOPE_MARKDOWN_PUBLIC_TEST = (
    "Differential privacy: epsilon covers the released models and, the test split being "
    "declared public (dp.public_test = true: your declaration, not checked), the test metrics, "
    "their best and the rounds to target. The train metrics and a divergence stop (computed "
    "in the clear on the users' training data) are not covered (docs: the run folder).\n"
)


def dp_scope_markdown(public_test: bool) -> str:
    """summary.md's sentence on what epsilon covers."""
    return DP_SCOPE_MARKDOWN_PUBLIC_TEST if public_test else DP_SCOPE_MARKDOWN


def dp_record(
    settings: DpSettings, history: Sequence[Evaluation], public_test: bool = False
) -> dict:
    """summary.json's ``dp`` of an algorithm: the epsilon its last evaluation had spent, the
    round it stopped at, the settings that epsilon is of (seeded randomness: a note that it
    is not a guarantee), and what it covers (``public_test``: the test split declared public)."""
    last = history[-1] if history else None
    spent = last.metrics.get("epsilon", 0.0) if last is not None else 0.0
    rounds = last.round if last is not None else 0
    record = {"epsilon": spent, "rounds": rounds, **settings.as_json()}
    if settings.randomness == "seeded":
        record["not_a_guarantee"] = NOT_A_GUARANTEE
    covered, not_covered = (
        (DP_COVERED_PUBLIC_TEST, DP_NOT_COVERED_PUBLIC_TEST)
        if public_test
        else (DP_COVERED, DP_NOT_COVERED)
    )
    return {
        **record,
        "public_test": public_test,
        "covered_by_epsilon": covered,
        "not_covered": not_covered,
    }


@dataclass(frozen=True)
class DpReport:
    """[dp]'s part of a run's reports (runs/run_setup.py's ``reports_of``): the epsilon spent
    after each round (in process a function of the settings and the round), summary.json's
    ``dp`` record of each algorithm, summary.md's sentences on what epsilon covers, and the
    note that seeded randomness is not a guarantee (privacy.json)."""

    settings: DpSettings
    public_test: bool = False  # dp.public_test: the test split declared public

    def round_metrics(self, round_index: int) -> dict[str, float]:
        return {"epsilon": self.settings.epsilon(round_index)}

    def summary(self, history: Sequence[Evaluation]) -> dict[str, object]:
        return {"dp": dp_record(self.settings, history, self.public_test)}

    def markdown(self) -> str:
        text = "\n" + dp_scope_markdown(self.public_test)
        if self.settings.randomness == "seeded":
            text += f"\n**The epsilon above is not a guarantee.** {NOT_A_GUARANTEE}.\n"
        return text

    def notes(self) -> dict[str, str]:
        seeded = self.settings.randomness == "seeded"
        return {"dp_not_a_guarantee": NOT_A_GUARANTEE} if seeded else {}
