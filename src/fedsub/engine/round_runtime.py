"""What the round loop asks of a runtime: the one interface between engine/loop.py's loop
(the only round loop) and where a round's client work runs.

The loop (``loop.drive``) owns everything a round is on the server: sampling and the
client work's description (``ServerRound.begin``), screening, combining and the checked
server step (``ServerRound.server_step``), [dp]'s ledger, evaluation cadence and divergence,
checkpoints, resume and stops. A runtime answers, each round:

- ``available``: which clients can take part (None: every client); a runtime whose
  population changes between rounds (Flower's elastic membership) rebuilds the round's
  population-dependent pieces here (``ServerRound.repopulate``);
- ``run_cohort``: the cohort's local work, returning the cohort's update (or the secure sums
  that stand for it), or ``RoundFailed`` when too little of it came back (the model stays
  unchanged);
- ``close_round``: how the server step went (a runtime keeping per-round records writes them);
- ``evaluate``: the model's metrics after a round, or None when it has none to give then.

``history`` and ``restore_history`` carry the runtime's own per-round records through a
checkpoint; its stateful pieces go to ``build_server_round(..., stages=)``. Which pieces of fedsub a
runtime can run is declared apart (``algorithms/runtimes.py``): ``engine/runtime.py`` for the
in-process engine, ``flower/runtime.py`` for Flower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fedsub.engine.server_round import RoundPlan, ServerRound
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import Updates


@dataclass(frozen=True)
class RoundFailed:
    """Too little of the cohort's work came back (or nobody could take part): the round
    leaves the model unchanged, and says why."""

    reason: str


class RoundRuntime(Protocol):
    """Where a round's client work runs (the in-process backends, Flower's nodes)."""

    def available(self, round_index: int, rounds: ServerRound) -> np.ndarray | None:
        """The clients (sorted positions) that can take part in round ``round_index``."""
        ...

    def run_cohort(self, plan: RoundPlan, params: Params) -> Updates | RoundFailed:
        """The cohort's update for ``plan`` on the global model ``params``, or a
        ``RoundFailed``."""
        ...

    def close_round(self, round_index: int, updated: bool, diverged: str | None) -> None:
        """The round's server step is done: the model ``updated`` or not, or it diverged."""
        ...

    def evaluate(self, round_index: int, params: Params) -> dict[str, float] | None:
        """The metrics of ``params`` after round ``round_index`` (None: none now)."""
        ...

    def history(self) -> list[dict]:
        """The runtime's per-round records, kept in checkpoints (``{"record": ...}`` each)."""
        ...

    def restore_history(self, history: list[dict]) -> None:
        """Take the records back from a checkpoint's history (the loop's entries ignored)."""
        ...
