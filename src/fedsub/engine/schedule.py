"""The training schedule shared by every algorithm of a comparison, in records by concern as
the config's sections are (``runs/run_setup.py``'s ``schedule_of`` builds it), and what it makes
of round r: its cohort (algorithms/sampling.py's ``draw_cohort``) and the cohort's work
(client/work.py's ``round_work``, with each member's learning rate ``lr_at``), which
engine/server_round.py's ``begin`` puts in a ``RoundPlan``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TypeVar

from fedsub.algorithms.sampling import Cohort, Sampling
from fedsub.client.work import ClientStep, CohortWork, LrSchedule, lr_at
from fedsub.engine.execution import Execution

T = TypeVar("T")

__all__ = [
    "ClientStep",  # the client step rule, client/work.py's (kept importable from here)
    "LocalWork",
    "LrSchedule",
    "RoundPlan",
    "Sampling",
    "Schedule",
    "lr_at",
]


@dataclass(frozen=True)
class LocalWork:
    """Each member's work in a round ([train]'s local_steps, batch_size and its step rule):
    I local steps of B samples, each moved by ``client_step``."""

    local_steps: int  # I
    batch_size: int  # B
    client_step: ClientStep


@dataclass(frozen=True)
class Schedule:
    """A run's rounds, cohorts and each member's ``LocalWork`` ([train]), how the run executes
    ([execution]) and the settings of its cross-cutting features (``settings``: width-slice
    masking, privacy levels, [dp]), one record of each type, each read by its own feature's
    adapter (``setting``): the schedule names none of them."""

    rounds: int
    clients_per_round: int
    local: LocalWork
    seed: int
    eval_every: int = 1
    # train.sampling: "poisson" draws each client with probability K / N (algorithms/sampling.py)
    sampling: Sampling = "fixed"
    execution: Execution = field(default_factory=Execution)
    # the features' settings (runs/run_setup.py's ``schedule_of`` gives masking.Masking,
    # privacy.Privacy and dp.DpSettings); a feature without a record here is off
    settings: tuple[object, ...] = ()

    def setting(self, kind: type[T]) -> T | None:
        """The run's settings record of type ``kind`` (a feature's), or None: the feature is
        off."""
        return next((s for s in self.settings if isinstance(s, kind)), None)

    def with_setting(self, kind: type[T], record: T | None) -> Schedule:
        """This schedule with ``record`` as its settings of type ``kind`` (in the place of the
        one it replaces), or without any (None)."""
        kept = [r if not isinstance(r, kind) else record for r in self.settings]
        if record is not None and self.setting(kind) is None:
            kept.append(record)
        return replace(self, settings=tuple(r for r in kept if r is not None))

    @property
    def local_steps(self) -> int:
        """I (``local.local_steps``)."""
        return self.local.local_steps

    @property
    def batch_size(self) -> int:
        """B (``local.batch_size``)."""
        return self.local.batch_size

    @property
    def client_step(self) -> ClientStep:
        """The client step rule (``local.client_step``)."""
        return self.local.client_step


@dataclass(frozen=True)
class RoundPlan:
    """What ``ServerRound.begin`` decided for one round: who trains, and how."""

    round: int
    cohort: Cohort
    work: CohortWork
