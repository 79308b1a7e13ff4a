"""[dp]'s central mechanisms as a registry (``MECHANISMS``, a ``plugins.Registry``), like every
other extension: ``dp.mechanism`` names one (``"none"`` aside: no [dp]).

A mechanism replaces the round's aggregation: given the cohort's updates and the round, it
returns the server's update (clipped, noised, divided by a public denominator). Its spec says
how it is built from what the run knows (``MechanismInputs``: the settings, the tables' row
counts, the clients' sample counts, whether the rule's heat is private, the download's p, the
run's random streams) and which of its state a checkpoint keeps (``stages``). Everything else
[dp] does for any mechanism (the ledger and its budget stop, the secret key of the cohort,
epsilon in every evaluation) is engine/features/dp.py's. A new mechanism is one module here,
its entry in ``MECHANISMS`` (or a plugin's entry point) and its test:
docs/develop/extending.md, "A DP mechanism".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fedsub.algorithms.aggregation import ServerUpdate
from fedsub.dp import ftrl, ftrl_blt
from fedsub.dp.mechanism import DpMechanism
from fedsub.dp.randomness import DpStreams
from fedsub.dp.settings import DpSettings
from fedsub.plugins import Registry
from fedsub.stateful import Stateful
from fedsub.submodel.transfer import CohortUpdate


class CentralMechanism(Protocol):
    """What the round asks of a central mechanism."""

    def combine(self, update: CohortUpdate, round_index: int) -> ServerUpdate:
        """The server's update of round ``round_index`` from the cohort's updates."""
        ...


@dataclass(frozen=True)
class MechanismInputs:
    """What a run knows when it builds its mechanism (all public, but ``streams``' key)."""

    settings: DpSettings
    table_rows: dict[str, int]
    counts: np.ndarray  # the clients' sample counts
    heat: bool  # FedSubAvg: the rows' heat is the mechanism's noisy histogram
    keep: float  # p: the private download's probability that a held row is sent
    streams: DpStreams


def no_stages(mechanism: CentralMechanism) -> dict[str, Stateful]:
    return {}


@dataclass(frozen=True)
class MechanismSpec:
    """A central mechanism: its name (``dp.mechanism``), how it is built, its checkpoint
    stages by name (state it carries across rounds), and one line for ``fedsub list``."""

    name: str
    build: Callable[[MechanismInputs], CentralMechanism]
    stages: Callable[[CentralMechanism], dict[str, Stateful]] = no_stages
    summary: str = ""


def gaussian(inputs: MechanismInputs) -> DpMechanism:
    return DpMechanism(
        inputs.settings,
        inputs.table_rows,
        inputs.counts,
        inputs.heat,
        inputs.keep,
        streams=inputs.streams,
    )


def gaussian_stages(mechanism: CentralMechanism) -> dict[str, Stateful]:
    """Adaptive clipping's C (``dp_clip``), when it adapts."""
    adaptive = isinstance(mechanism, DpMechanism) and mechanism.settings.adaptive is not None
    return {"dp_clip": mechanism} if adaptive else {}  # type: ignore[dict-item]


def ftrl_tree(inputs: MechanismInputs) -> ftrl.FtrlMechanism:
    return ftrl.FtrlMechanism(
        inputs.settings,
        inputs.table_rows,
        inputs.counts,
        inputs.heat,
        inputs.keep,
        streams=inputs.streams,
    )


def ftrl_stages(mechanism: CentralMechanism) -> dict[str, Stateful]:
    """The selected rows' last rounds (``dp_ftrl``), with rows = "private"."""
    sparse = isinstance(mechanism, ftrl.FtrlMechanism) and mechanism.settings.rows == "private"
    return {ftrl.STAGE: mechanism} if sparse else {}  # type: ignore[dict-item]


def ftrl_blt_stages(mechanism: CentralMechanism) -> dict[str, Stateful]:
    """The tree's stages and the strategy the run started with (``dp_blt_strategy``)."""
    assert isinstance(mechanism, ftrl_blt.BltMechanism)
    record = ftrl_blt.StrategyRecord(mechanism.strategy)
    return {**ftrl_stages(mechanism), ftrl_blt.STRATEGY_STAGE: record}


def ftrl_blt_build(inputs: MechanismInputs) -> ftrl_blt.BltMechanism:
    return ftrl_blt.BltMechanism(
        inputs.settings,
        inputs.table_rows,
        inputs.counts,
        inputs.heat,
        inputs.keep,
        streams=inputs.streams,
    )


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
            ftrl_tree,
            ftrl_stages,
            "DP-FTRL: the same clip and denominator, correlated tree-aggregation noise, "
            "accounted for the enforced participation pattern with no sampling (Kairouz et al. "
            "2021; dp/ftrl.py)",
        ),
        "ftrl-blt": MechanismSpec(
            "ftrl-blt",
            ftrl_blt_build,
            ftrl_blt_stages,
            "DP-FTRL with a buffered-linear-Toeplitz noise strategy optimised by jax-privacy "
            "for the rounds and the enforced pattern (McMahan et al. 2024; dp/ftrl_blt.py)",
        ),
    },
    MechanismSpec,
    lambda spec: spec.name,
)
"""Every central DP mechanism by name: the built-in ones, then plugins'."""
