"""The participation pattern DP-FTRL is accounted for, and its enforcement at the cohort draw.

DP-FTRL (dp/ftrl.py) claims no sampling amplification: epsilon holds for *any* cohorts that
respect the pattern, each user taking part at most ``max_participations`` times (k) and at
least ``min_separation`` rounds apart (b: rounds r < r' of one user have r' - r >= b). The
cohort draw enforces it on every runtime ([dp]'s contribution gives the bound as its
``draw.filter``, engine/features/dp.py, which engine/server_round.py's ``begin`` asks; the
in-process engine and the Flower ServerApp both call it): a user inside its separation window
or past k participations is not eligible, and the cohort is drawn among the others. A
Flower client drawn while its node is offline counts as a participation (it could have
sent), so the bound holds whatever reached the server.

The state (each user's last round and count) is a checkpoint stage (``dp_participation``),
so a resumed run keeps enforcing the same pattern; O(N) users, never O(V) rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

STAGE = "dp_participation"  # the checkpoint stage
NEVER = -(2**40)  # the last round of a user who has not taken part


@dataclass(frozen=True)
class Pattern:
    """At most ``max_participations`` rounds per user, ``min_separation`` apart (1: any two
    distinct rounds)."""

    min_separation: int = 1
    max_participations: int = 0  # 0: as many as the separation allows

    def most(self, rounds: int) -> int:
        """The most participations a user can have in ``rounds`` rounds under the pattern."""
        fit = (rounds - 1) // max(self.min_separation, 1) + 1 if rounds > 0 else 0
        return min(fit, self.max_participations) if self.max_participations else fit

    def as_json(self) -> dict:
        return {
            "min_separation": self.min_separation,
            "max_participations": self.max_participations or None,
        }


class ParticipationBound:
    """The enforcement of a ``Pattern`` over ``num_clients`` users (module docstring)."""

    def __init__(self, pattern: Pattern, num_clients: int) -> None:
        self.pattern = pattern
        self.last = np.full(num_clients, NEVER, dtype=np.int64)
        self.count = np.zeros(num_clients, dtype=np.int64)
        self.refused = 0  # users refused at the last draw (for the round's record)

    def eligible(self, round_index: int, among: np.ndarray | None) -> np.ndarray:
        """The users of ``among`` (default: all) that may take part in round ``round_index``."""
        last = self.last if among is None else self.last[among]  # all: no copy
        ok = round_index - last >= max(self.pattern.min_separation, 1)
        if self.pattern.max_participations:
            ok &= (self.count if among is None else self.count[among]) < (
                self.pattern.max_participations
            )
        self.refused = len(ok) - int(np.count_nonzero(ok))
        return np.flatnonzero(ok) if among is None else among[ok]  # all: positions 0 .. N - 1

    def record(self, round_index: int, clients: np.ndarray) -> None:
        """The cohort of round ``round_index`` took part (called once per round, at the
        draw)."""
        if len(clients) and (self.last[clients] >= round_index).any():
            raise ValueError(f"round {round_index}'s participation was recorded already")
        self.last[clients] = round_index
        self.count[clients] += 1

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"last": torch.from_numpy(self.last.copy()), "count": torch.from_numpy(self.count)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if set(tensors) != {"last", "count"} or tensors["last"].shape != self.last.shape:
            raise ValueError(
                f"the participation bound holds 'last' and 'count' of {len(self.last)} users, "
                f"got {sorted(tensors)}"
            )
        self.last = tensors["last"].numpy().astype(np.int64).copy()
        self.count = tensors["count"].numpy().astype(np.int64).copy()
