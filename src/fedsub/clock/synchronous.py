"""Synchronous rounds on the virtual clock: a ``RoundRuntime`` around the in-process one.

Round r starts at the clock's time ``now``. The cohort is drawn among the clients online then
(waiting, if nobody is, until someone comes online), ``ceil(K (1 + x))`` of them with
over-selection x. Member k would finish at ``now + t_k`` (clock/timing.py); it is dropped when

- it goes offline before then (its trace: a dropout mid-round),
- ``t_k`` exceeds the deadline (``clock.deadline`` > 0; a straggler), or
- with over-selection, K others finished before it (only the first K are kept).

The kept members' work runs as one batched cohort (the backend's usual job, for those members
only), and the round ends at the last kept member's finish time; when a deadline is set and a
member the server waits for was dropped (fewer kept than min(K, members drawn)), at the
deadline (the server cannot know sooner that nobody else will come). Over-selection that
still kept K ends when the K-th finished; a cohort drawn smaller than K (few online) that
kept everybody ends when its last member finished. A round that keeps nobody leaves the model
unchanged (``RoundFailed``).
The clock's time is saved in checkpoints (the ``clock`` stage), so a resumed run continues it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedsub.algorithms.sampling import Cohort
from fedsub.clock.profiles import INF, Profiles, Trace
from fedsub.clock.settings import SynchronousRounds
from fedsub.clock.timing import work_seconds
from fedsub.engine.round_runtime import RoundFailed, RoundRuntime
from fedsub.engine.server_round import RoundPlan, ServerRound
from fedsub.submodel.params import Params

VIRTUAL_TIME = "virtual_time"  # the metric metrics.jsonl records (seconds since round 0)


@dataclass
class ClockTime:
    """The virtual clock's time, a checkpointed stage (``Stateful``)."""

    now: float = 0.0

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"now": torch.tensor([self.now], dtype=torch.float64)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if set(tensors) != {"now"}:
            raise ValueError(f"the clock stage holds 'now', got {sorted(tensors)}")
        self.now = float(tensors["now"][0])


def first_online(trace: Trace, t: float, among: np.ndarray | None = None) -> float:
    """The earliest time >= t at which one of ``among`` (default: everybody) is online."""
    clients = range(len(trace.period)) if among is None else among.tolist()
    return min((trace.next_online(int(k), t) for k in clients), default=INF)


@dataclass(frozen=True)
class Kept:
    """Which members of a round's cohort are kept, and when the round ends."""

    members: list[int]
    ends: float
    dropped_offline: int
    dropped_late: int


def kept_members(
    start: float,
    seconds: np.ndarray,
    offline_at: np.ndarray,
    target: int,
    rules: SynchronousRounds,
) -> Kept:
    """The module docstring's rule, for members finishing at ``start + seconds`` and going
    offline at ``offline_at`` (inf: never); ``target``: K."""
    finish = start + seconds
    offline = offline_at < finish
    late = ~offline & (rules.deadline > 0) & (seconds > rules.deadline)
    alive = np.flatnonzero(~offline & ~late)
    order = alive[np.argsort(finish[alive], kind="stable")]
    kept = sorted(order[:target].tolist())
    short = len(kept) < min(target, len(seconds))  # someone the server waits for dropped
    if kept and not (rules.deadline > 0 and short):
        ends = float(finish[kept].max())
    elif rules.deadline > 0:
        ends = start + rules.deadline
    else:  # nobody kept, no deadline: the server learns of the last dropout
        ends = float(np.minimum(finish, offline_at).max()) if len(finish) else start
    return Kept(kept, ends, int(offline.sum()), int(late.sum()))


@dataclass
class SynchronousClock:
    """``inner`` (the in-process runtime) with rounds on the virtual clock."""

    inner: RoundRuntime
    profiles: Profiles
    trace: Trace
    exchanged: np.ndarray  # bytes each way per client
    samples: float  # samples a client trains per round
    rules: SynchronousRounds
    target: int  # K, the members a round keeps at most
    # masking: each member's share of the full model's work and bytes (``Masking.work_share``)
    share: Callable[[int, np.ndarray], np.ndarray] | None = None
    time: ClockTime = field(default_factory=ClockTime)
    dropped: list[int] = field(default_factory=lambda: [0, 0])  # offline, late (this process)

    def available(self, round_index: int, rounds: ServerRound) -> np.ndarray | None:
        among = self.inner.available(round_index, rounds)
        online = self.trace.online(self.time.now)
        if among is not None:
            online = online & np.isin(np.arange(len(online)), among)
        if not online.any():  # wait for the first client to come online
            self.time.now = first_online(self.trace, self.time.now, among)
            if not math.isfinite(self.time.now):
                raise RuntimeError("the availability trace has no client online ever again")
            online = self.trace.online(self.time.now)
            if among is not None:
                online = online & np.isin(np.arange(len(online)), among)
        return np.flatnonzero(online)

    def run_cohort(self, plan: RoundPlan, params: Params) -> Any:
        clients = plan.cohort.clients
        start = self.time.now
        seconds = work_seconds(self.profiles, self.exchanged, self.samples, clients)
        if self.share is not None:
            seconds = seconds * self.share(plan.round, clients)
        offline_at = np.array([self.trace.online_until(int(k), start) for k in clients])
        kept = kept_members(start, seconds, offline_at, self.target, self.rules)
        self.time.now = kept.ends
        self.dropped[0] += kept.dropped_offline
        self.dropped[1] += kept.dropped_late
        if not kept.members:
            return RoundFailed("no member finished in time (virtual clock)")
        members = kept.members
        cohort = Cohort(clients[members], plan.cohort.multiplicity[members])
        return self.inner.run_cohort(
            RoundPlan(plan.round, cohort, plan.work.select(members)), params
        )

    def close_round(self, round_index: int, updated: bool, diverged: str | None) -> None:
        self.inner.close_round(round_index, updated, diverged)

    def evaluate(self, round_index: int, params: Params) -> dict[str, float] | None:
        metrics = self.inner.evaluate(round_index, params)
        if metrics is not None:
            metrics[VIRTUAL_TIME] = self.time.now
        return metrics

    def history(self) -> list[dict]:
        return self.inner.history()

    def restore_history(self, history: list[dict]) -> None:
        self.inner.restore_history(history)
