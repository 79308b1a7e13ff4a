"""The training schedule shared by every algorithm of a comparison, in records by concern as
the config's sections are (``runs/run_setup.py``'s ``schedule_of`` builds it), and what it makes
of round r: its learning rate (``lr_at``), its cohort (``draw_cohort``) and the cohort's work
(``round_work``), which engine/server_round.py's ``begin`` puts in a ``RoundPlan``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

import numpy as np

from fedsub.algorithms.registry import Algorithm
from fedsub.algorithms.sampling import Cohort, poisson_cohort, sample_cohort
from fedsub.client.work import CohortWork, round_chain
from fedsub.engine.execution import Execution
from fedsub.numerics.seeding import Seed

LrSchedule = Literal["constant", "inverse-round", "inverse-time", "exponential"]
Sampling = Literal["fixed", "poisson"]  # train.sampling
T = TypeVar("T")


@dataclass(frozen=True)
class ClientStep:
    """How a client's local step moves its parameters ([train]'s lr, lr_schedule, lr_decay,
    weight_decay, clip_norm, momentum): the base learning rate and its schedule over rounds
    (``lr_at``), and the transforms ``client/work.py``'s ``round_chain`` adds to the
    algorithm's client pieces (0: none)."""

    lr: float
    lr_schedule: LrSchedule = "constant"
    lr_decay: float = 0.999
    weight_decay: float = 0.0
    clip_norm: float = 0.0
    momentum: float = 0.0


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


def lr_at(base: float, step: ClientStep, round_index: int) -> float:
    """The client learning rate of round ``round_index`` (1-based), constant inside a round.

    ``inverse-round``: base / (1 + t) with t = round_index - 1 (seed 004);
    ``inverse-time``: base / (1 + lr_decay * t) (seed 004's appendix C.2 anneals
    (1/5) / (5 + t a) = (1/25) / (1 + t a / 5): base 0.04, lr_decay a / 5);
    ``exponential``: base * lr_decay^t (the FedSubAvg authors' x0.999 per round)."""
    t = round_index - 1
    if step.lr_schedule == "constant":
        return base
    if step.lr_schedule == "inverse-round":
        return base / (1 + t)
    if step.lr_schedule == "inverse-time":
        return base / (1 + step.lr_decay * t)
    if step.lr_schedule == "exponential":
        return base * step.lr_decay**t
    raise ValueError(f"unknown lr schedule {step.lr_schedule!r}")


@dataclass(frozen=True)
class RoundPlan:
    """What ``ServerRound.begin`` decided for one round: who trains, and how."""

    round: int
    cohort: Cohort
    work: CohortWork


def draw_cohort(
    algorithm: Algorithm,
    schedule: Schedule,
    counts: np.ndarray,
    seed: Seed,
    round_index: int,
    among: np.ndarray | None = None,
) -> Cohort:
    """Round ``round_index``'s cohort among the clients ``among`` (sorted positions into the
    sample ``counts``; None: all), keyed by ``seed`` and the round, so every runtime draws the
    same one: train.sampling's Poisson draw, or the algorithm's scheme's; empty when nobody can
    take part."""
    pool = counts if among is None else counts[among]
    if len(pool) == 0:
        return Cohort(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    k = schedule.clients_per_round
    if schedule.sampling == "poisson":
        cohort = poisson_cohort(seed, round_index, len(pool), k)
    else:
        cohort = sample_cohort(algorithm.scheme.sampling, seed, round_index, pool, k)
    return cohort if among is None else Cohort(among[cohort.clients], cohort.multiplicity)


def round_work(
    algorithm: Algorithm, schedule: Schedule, counts: np.ndarray, cohort: Cohort, round_index: int
) -> CohortWork:
    """The round's chain of client transforms (the algorithm's client pieces with
    train.clip_norm / weight_decay / momentum) and each member's learning rate (transformed
    Scheme II scales it by p_k N); SCAFFOLD's corrections are added by ``ServerRound.begin``."""
    lr_scale = np.ones(len(cohort))
    if algorithm.scheme.scale_lr_by_pn:
        lr_scale = counts[cohort.clients] / counts.sum() * len(counts)
    step = schedule.client_step
    base_lr = algorithm.lr if algorithm.lr is not None else step.lr
    chain = round_chain(algorithm.client, step.weight_decay, step.clip_norm, step.momentum)
    return CohortWork(chain, lr_scale * lr_at(base_lr, step, round_index))
