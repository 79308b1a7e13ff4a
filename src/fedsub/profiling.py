"""Where a run's time goes: per-phase timings of its rounds (``fedsub run/compare --profile``).

Code deep in the engine marks its phases with ``timed("forward")`` etc. without being handed
a profiler: a run being profiled installs a ``RoundProfile`` for its duration (``profiling``);
otherwise ``timed`` returns one shared do-nothing context (a context-variable lookup), so an
unprofiled run pays nothing measurable and never synchronizes a GPU.

Phases nest: a phase's time excludes the phases timed inside it (its *self* time), so the
phases of a round add up to the round minus what no phase covers (``other``). On a GPU the
profile synchronizes the device at every phase boundary (``synchronize``), so the time of
the kernels a phase queued is counted in that phase, not in the next one that waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field

# The phases of a round, in the order a report lists them (others follow in first-seen order).
ORDER = (
    "cohort",
    "pull",
    "forward",
    "backward",
    "client rule",
    "local steps (captured)",
    "push",
    "aggregation",
    "server step",
    "evaluation",
    "checkpoint",
)
ROUND = "round"  # the whole round; its time minus the phases' is "other"


@dataclass
class RoundProfile:
    """Self seconds and calls per phase inside the rounds (``ROUND``), and apart the phases
    outside them (the evaluation before round 1)."""

    synchronize: Callable[[], None] | None = None  # e.g. torch.cuda.synchronize on a GPU
    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    outside: dict[str, float] = field(default_factory=dict)  # seconds of phases outside rounds
    _stack: list[list] = field(default_factory=list)  # [start, seconds in children, in a round]

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.synchronize is not None:
            self.synchronize()
        in_round = name == ROUND or (bool(self._stack) and self._stack[-1][2])
        start = time.perf_counter()
        self._stack.append([start, 0.0, in_round])
        try:
            yield
        finally:
            if self.synchronize is not None:
                self.synchronize()
            _, inner, _ = self._stack.pop()
            elapsed = time.perf_counter() - start
            if self._stack:
                self._stack[-1][1] += elapsed
            if in_round:
                self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - inner
                self.calls[name] = self.calls.get(name, 0) + 1
            else:
                self.outside[name] = self.outside.get(name, 0.0) + elapsed - inner

    def as_json(self) -> dict:
        """Per phase: seconds in all, calls, seconds per round and share of the rounds' time;
        ``other`` is the rounds' time no phase covers; ``outside_rounds`` the phases before or
        between the rounds (the evaluation of the initial model)."""
        rounds = self.calls.get(ROUND, 0)
        total = sum(self.seconds.values())  # the rounds' wall time: every self time in them
        names = [n for n in ORDER if n in self.seconds]
        names += [n for n in self.seconds if n not in ORDER and n != ROUND]
        phases = {n: self.seconds[n] for n in names}
        phases["other"] = self.seconds.get(ROUND, 0.0)
        return {
            "rounds": rounds,
            "seconds": total,
            "seconds_per_round": total / rounds if rounds else None,
            "phases": {
                n: {
                    "seconds": s,
                    "calls": self.calls.get(n, rounds),
                    "seconds_per_round": s / rounds if rounds else None,
                    "share": s / total if total else None,
                }
                for n, s in phases.items()
            },
            "outside_rounds": dict(self.outside),
        }


_ACTIVE: ContextVar[RoundProfile | None] = ContextVar("fedsub_profile", default=None)
_NOTHING = nullcontext()


def timed(name: str) -> AbstractContextManager[None]:
    """Time a phase in the profile being recorded, if any (else nothing happens)."""
    profile = _ACTIVE.get()
    return _NOTHING if profile is None else profile.phase(name)


@contextmanager
def profiling(profile: RoundProfile | None) -> Iterator[RoundProfile | None]:
    """Record ``timed`` phases into ``profile`` for the duration of the block (None: none)."""
    token = _ACTIVE.set(profile)
    try:
        yield profile
    finally:
        _ACTIVE.reset(token)


def table(profiles: dict[str, dict]) -> str:
    """A plain-text table of ``as_json`` records by algorithm: ms per round and share."""
    lines = []
    for name, record in profiles.items():
        per_round = record["seconds_per_round"]
        if per_round is None:
            continue
        lines.append(f"{name}: {record['rounds']} rounds, {per_round * 1e3:.1f} ms per round")
        for phase, entry in record["phases"].items():
            lines.append(
                f"  {phase:<24} {entry['seconds_per_round'] * 1e3:10.2f} ms"
                f"  {100 * entry['share']:5.1f}%  ({entry['calls']} calls)"
            )
    return "\n".join(lines) + ("\n" if lines else "")
