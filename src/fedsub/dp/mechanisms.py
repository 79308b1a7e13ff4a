"""[dp]'s central mechanisms as a registry (``MECHANISMS``, a ``plugins.Registry``), like every
other extension: ``dp.mechanism`` names one (``"none"`` aside: no [dp]).

A mechanism replaces the round's aggregation: given the cohort's updates and the round, it
returns the server's update (clipped, noised, divided by a public denominator). Its spec says
how it is built from what the run knows (``MechanismInputs``: the settings, the tables' row
counts, the clients' sample counts, whether the rule's heat is private, the download's p, the
run's random streams) and which of its state a checkpoint keeps (``stages``); optionally how
its noise is calibrated and accounted for (``accounting``: default the sampled Gaussian's), what
it cannot run with (``refusals``, checked by config.py), the optional [dp] keys it reads
(``keys``: set for another mechanism, config.py refuses them) and whether its accounting counts
on sampled cohorts (``sampled``). Everything else [dp] does for any mechanism (the ledger and its
budget stop, the secret key of the cohort, epsilon in every evaluation) is
engine/features/dp.py's. A new mechanism is one module here, its entry in ``MECHANISMS`` (or a
plugin's entry point) and its test: docs/develop/extending.md, "A DP mechanism".
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from fedsub.algorithms.aggregation import ServerUpdate
from fedsub.dp import blt_noise, ftrl, ftrl_blt, tree_noise
from fedsub.dp import settings as dp_settings
from fedsub.dp.accountant import Accountant, Sampling
from fedsub.dp.mechanism import DpMechanism
from fedsub.dp.participation import Pattern
from fedsub.dp.randomness import DpStreams
from fedsub.dp.settings import Accounting, DpSettings
from fedsub.errors import ConfigError
from fedsub.plugins import Registry
from fedsub.progress import phase
from fedsub.stateful import Stateful
from fedsub.submodel.transfer import CohortUpdate


class CentralMechanism(Protocol):
    """What the round asks of a central mechanism."""

    def combine(self, update: CohortUpdate, round_index: int) -> ServerUpdate:
        """The server's update of round ``round_index`` from the cohort's updates."""
        ...


Mechanism = TypeVar("Mechanism", bound=DpMechanism)


@dataclass(frozen=True)
class MechanismInputs:
    """What a run knows when it builds its mechanism (all public, but ``streams``' key)."""

    settings: DpSettings
    table_rows: dict[str, int]
    counts: np.ndarray  # the clients' sample counts
    heat: bool  # FedSubAvg: the rows' heat is the mechanism's noisy histogram
    keep: float  # p: the private download's probability that a held row is sent
    streams: DpStreams


@dataclass(frozen=True)
class Calibration:
    """[dp]'s noise as the config asks for it: a multiplier z, or a target epsilon to
    calibrate one for; delta (None: the default), the accountant, and a budget."""

    noise_multiplier: float | None
    target_epsilon: float | None
    delta: float | None
    accountant: Accountant
    epsilon_budget: float | None


@dataclass(frozen=True)
class SelectionAsked:
    """The private row selection asked: dp.rows, dp.selection_window, dp.selection_max_rows,
    dp.selection_refresh."""

    rows: str = "all"
    window: int = 1
    max_rows: int = 0
    refresh: int = 1


@dataclass(frozen=True)
class ParticipationAsked:
    """The participation pattern asked (0: unset) and the BLT's buffers (0: jax-privacy's
    choice)."""

    min_separation: int = 0
    max_participations: int = 0
    blt_buffers: int = 0


@dataclass(frozen=True)
class DpAsked:
    """What a config asks of [dp] and of the rounds around it, as a mechanism's
    ``accounting`` and ``refusals`` read it (config.py's ``dp_asked`` builds it)."""

    calibration: Calibration
    sampling: Sampling  # train.sampling
    clients_per_round: int
    rounds: int
    distributed: bool  # privacy.level = "full": the clients add the noise
    adaptive_clip: bool
    selection: SelectionAsked
    participation: ParticipationAsked


def no_stages(mechanism: CentralMechanism) -> dict[str, Stateful]:
    return {}


def sampled_accounting(asked: DpAsked, num_clients: int) -> tuple[float, Accounting]:
    """The sampled Gaussian mechanism's z and accounting (dp/settings.py ``resolve``): each
    round's cohort sampled (amplification), distributed DP at privacy.level = "full"."""
    c = asked.calibration
    return dp_settings.resolve(
        noise_multiplier=c.noise_multiplier,
        target_epsilon=c.target_epsilon,
        delta=c.delta,
        accountant=c.accountant,
        sampling=asked.sampling,
        num_clients=num_clients,
        clients_per_round=asked.clients_per_round,
        rounds=asked.rounds,
        epsilon_budget=c.epsilon_budget,
        distributed=asked.distributed,
    )


def no_refusals(asked: DpAsked) -> list[tuple[bool, str]]:
    return []


@dataclass(frozen=True)
class MechanismSpec:
    """A central mechanism: its name (``dp.mechanism``), how it is built, its checkpoint
    stages by name (state it carries across rounds), and one line for ``fedsub list``; then,
    optional: how its z and accounting are resolved for a population (``accounting``), what it
    cannot run with (``refusals``: (refused?, why) pairs, config.py says them naming the
    mechanism), the optional [dp] keys it reads (``keys``, e.g. ``"dp.min_separation"``: set
    with a mechanism that does not list them, config.py refuses them) and whether its
    accounting counts on sampled cohorts (``sampled``: then the PLD accountant needs Poisson
    sampling)."""

    name: str
    build: Callable[[MechanismInputs], CentralMechanism]
    stages: Callable[[CentralMechanism], dict[str, Stateful]] = no_stages
    summary: str = ""
    accounting: Callable[[DpAsked, int], tuple[float, Accounting]] = sampled_accounting
    refusals: Callable[[DpAsked], list[tuple[bool, str]]] = no_refusals
    keys: frozenset[str] = frozenset()
    sampled: bool = True


def built(kind: type[Mechanism]) -> Callable[[MechanismInputs], Mechanism]:
    """How a mechanism of class ``kind`` (the Gaussian's ``DpMechanism`` or a DP-FTRL
    subclass: the tree's, BLT's) is built from what the run knows."""

    def build(inputs: MechanismInputs) -> Mechanism:
        return kind(
            inputs.settings,
            inputs.table_rows,
            inputs.counts,
            inputs.heat,
            inputs.keep,
            streams=inputs.streams,
        )

    return build


gaussian = built(DpMechanism)  # the Gaussian mechanism's builder (a plugin may wrap it)


def gaussian_stages(mechanism: CentralMechanism) -> dict[str, Stateful]:
    """Adaptive clipping's C (``dp_clip``), when it adapts."""
    adaptive = isinstance(mechanism, DpMechanism) and mechanism.settings.adaptive is not None
    return {"dp_clip": mechanism} if adaptive else {}  # type: ignore[dict-item]


def ftrl_stages(mechanism: CentralMechanism) -> dict[str, Stateful]:
    """The noise stream version (``dp_noise_stream``) and, with rows = "private", the selected
    rows' last rounds (``dp_ftrl``)."""
    if not isinstance(mechanism, ftrl.FtrlMechanism):
        return {}
    stages: dict[str, Stateful] = {
        tree_noise.VERSION_STAGE: tree_noise.StreamVersionRecord(mechanism)
    }
    if mechanism.settings.rows == "private":
        stages[ftrl.STAGE] = mechanism
    return stages


def ftrl_accounting(asked: DpAsked, num_clients: int) -> tuple[float, Accounting]:
    """DP-FTRL's z and accounting for the participation pattern (dp/settings.py
    ``resolve_ftrl``): no sampling assumed; a population too small for the separation is
    refused."""
    c, k = asked.calibration, asked.clients_per_round
    pattern = Pattern(
        max(asked.participation.min_separation, 1), asked.participation.max_participations
    )
    if k * pattern.min_separation > num_clients:
        raise ConfigError(
            f"dp.min_separation = {pattern.min_separation} with train.clients_per_round = "
            f"{k} needs at least {k * pattern.min_separation}"
            f" clients (each cohort is drawn outside the previous b - 1 cohorts), got "
            f"{num_clients}; lower dp.min_separation or the cohort"
        )
    return dp_settings.resolve_ftrl(
        noise_multiplier=c.noise_multiplier,
        target_epsilon=c.target_epsilon,
        delta=c.delta,
        accountant=c.accountant,
        num_clients=num_clients,
        clients_per_round=k,
        rounds=asked.rounds,
        epsilon_budget=c.epsilon_budget,
        pattern=pattern,
    )


def ftrl_refusals(asked: DpAsked) -> list[tuple[bool, str]]:
    """What DP-FTRL cannot run with."""
    return [
        (
            asked.adaptive_clip,
            "dp.adaptive_clip = true: DP-FTRL runs with a fixed clip; set it to false",
        ),
        (
            asked.distributed,
            "privacy.level = 'full' (distributed DP over secure aggregation): the tree's noise "
            "is added by the server (central DP); use mechanism = 'gaussian' there",
        ),
        (
            asked.selection.window > max(asked.participation.min_separation, 1),
            f"dp.selection_window = {asked.selection.window} exceeds "
            f"dp.min_separation = {asked.participation.min_separation}: a user could then add "
            "to one window's histogram twice, which the accounting does not charge; keep the "
            "window <= b",
        ),
        (
            asked.selection.refresh > 1
            and (asked.selection.window <= 1 or asked.selection.rows != "private"),
            f"dp.selection_refresh = {asked.selection.refresh} reuses a windowed selection; it "
            f"needs dp.rows = 'private' and dp.selection_window > 1 (got dp.rows = "
            f"{asked.selection.rows!r}, dp.selection_window = {asked.selection.window})",
        ),
        (
            asked.selection.max_rows > 0 and asked.selection.rows != "private",
            f"dp.selection_max_rows = {asked.selection.max_rows} caps the privately selected "
            f"rows; with dp.rows = {asked.selection.rows!r} every row is noised (set "
            "dp.rows = 'private' or dp.selection_max_rows = 0)",
        ),
        (
            asked.sampling == "poisson",
            "train.sampling = 'poisson': DP-FTRL assumes no sampling and draws fixed-size "
            "cohorts among the eligible users; use train.sampling = 'fixed'",
        ),
    ]


FTRL_KEYS = frozenset(
    {
        "dp.heat_cap",
        "dp.selection_window",
        "dp.selection_max_rows",
        "dp.selection_refresh",
        "dp.min_separation",
        "dp.max_participations",
    }
)
"""The [dp] keys DP-FTRL reads: its heat cap, its selection (window, cap) and its pattern."""


def ftrl_blt_accounting(asked: DpAsked, num_clients: int) -> tuple[float, Accounting]:
    """DP-FTRL's accounting with the BLT strategy jax-privacy optimises for the rounds and the
    pattern (dp/blt_noise.py): its sensitivity replaces the tree's."""
    noise_multiplier, accounting = ftrl_accounting(asked, num_clients)
    assert accounting.ftrl is not None
    with phase("optimising the BLT strategy (jax-privacy)"):
        strategy = blt_noise.optimized(
            asked.rounds, accounting.ftrl, asked.participation.blt_buffers
        )
    return noise_multiplier, dataclasses.replace(accounting, blt=strategy)


def ftrl_blt_refusals(asked: DpAsked) -> list[tuple[bool, str]]:
    """DP-FTRL's refusals, and jax-privacy missing (the strategy is its)."""
    missing = importlib.util.find_spec("jax_privacy") is None
    why = "its BLT strategy and sensitivity come from jax-privacy, which is not installed: "
    return [*ftrl_refusals(asked), (missing, why + blt_noise.INSTALL)]


def ftrl_blt_stages(mechanism: CentralMechanism) -> dict[str, Stateful]:
    """The tree's stages and the strategy the run started with (``dp_blt_strategy``)."""
    assert isinstance(mechanism, ftrl_blt.BltMechanism)
    record = ftrl_blt.StrategyRecord(mechanism.strategy)
    return {**ftrl_stages(mechanism), ftrl_blt.STRATEGY_STAGE: record}


MECHANISMS: Registry[MechanismSpec] = Registry(
    "dp mechanism",
    {
        "gaussian": MechanismSpec(
            "gaussian",
            gaussian,
            gaussian_stages,
            "each client's update clipped, Gaussian noise on the sum, a fixed denominator "
            "(McMahan et al. 2018; dp/mechanism.py)",
        ),
        "ftrl-tree": MechanismSpec(
            "ftrl-tree",
            built(ftrl.FtrlMechanism),
            ftrl_stages,
            "DP-FTRL: the same clip and denominator, correlated tree-aggregation noise, "
            "accounted for the enforced participation pattern with no sampling (Kairouz et al. "
            "2021; dp/ftrl.py)",
            accounting=ftrl_accounting,
            refusals=ftrl_refusals,
            keys=FTRL_KEYS,
            sampled=False,
        ),
        "ftrl-blt": MechanismSpec(
            "ftrl-blt",
            built(ftrl_blt.BltMechanism),
            ftrl_blt_stages,
            "DP-FTRL with a buffered-linear-Toeplitz noise strategy optimised by jax-privacy "
            "for the rounds and the enforced pattern (McMahan et al. 2024; dp/ftrl_blt.py)",
            accounting=ftrl_blt_accounting,
            refusals=ftrl_blt_refusals,
            keys=FTRL_KEYS | {"dp.blt_buffers"},
            sampled=False,
        ),
    },
    MechanismSpec,
    lambda spec: spec.name,
)
"""Every central DP mechanism by name: the built-in ones, then plugins'."""
