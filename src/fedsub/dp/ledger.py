"""The privacy ledger of a run: how many rounds' mechanisms have been composed. A checkpoint
stage (``Stateful``), so a resumed run continues the same epsilon curve: epsilon after r rounds
is a function of the settings and r only (dp/accountant.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fedsub.dp.settings import DpSettings


@dataclass
class Ledger:
    settings: DpSettings
    rounds: int = 0

    def compose_round(self) -> None:
        """Record one more round's mechanism (called when the round's noise is added)."""
        self.rounds += 1

    def epsilon(self) -> float:
        """Epsilon at the settings' delta of the rounds composed so far."""
        return self.settings.epsilon(self.rounds)

    def would_exceed(self) -> bool:
        """Whether one more round would spend more than the budget (none set: never)."""
        return self.rounds + 1 > self.affordable_rounds

    @functools.cached_property
    def affordable_rounds(self) -> int:
        """The most rounds (up to the configured ones) whose epsilon stays within the budget:
        found once by bisection (epsilon grows with the rounds; RDP's costs one round's RDP,
        cached, PLD's a composition), so the per-round check reads no accountant."""
        budget, rounds = self.settings.budget, self.settings.accounting.rounds
        if budget is None or self.settings.epsilon(rounds) <= budget:
            return rounds
        low, high = 0, rounds  # epsilon(low) <= budget < epsilon(high)
        while high - low > 1:
            middle = (low + high) // 2
            if self.settings.epsilon(middle) <= budget:
                low = middle
            else:
                high = middle
        return low

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"rounds": torch.tensor([self.rounds], dtype=torch.int64)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if set(tensors) != {"rounds"} or tensors["rounds"].shape != (1,):
            raise ValueError(f"a privacy ledger holds one 'rounds' count, got {sorted(tensors)}")
        self.rounds = int(tensors["rounds"][0])
