"""Client capacities: the fraction beta of every layer's width a client can train.

``fixed``: each client gets one level for the whole run, the levels dealt in the configured
proportions (rounded; a seeded permutation decides who gets which). ``memory``: dealt the same
way, but by the clients' memory ([clock]'s device profiles, fedsub/clock): the clients with the
most memory get the largest levels (ties broken by client order). ``per-round``: every
client draws a level afresh each round with those probabilities. Both are keyed by the run's
seed only, so every masking scheme of a comparison sees the same capacities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedsub.numerics import seeding

Assignment = Literal["fixed", "per-round", "memory"]
CAPACITY = 6  # seeding purpose


@dataclass(frozen=True)
class Capacities:
    levels: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125, 0.0625)
    proportions: tuple[float, ...] = ()  # empty: equal shares
    assignment: Assignment = "fixed"
    memory: tuple[float, ...] = ()  # ``memory``: each client's memory (bytes), client order

    def probabilities(self) -> np.ndarray:
        shares = np.asarray(self.proportions or [1.0] * len(self.levels), dtype=np.float64)
        return shares / shares.sum()

    def fixed_levels(self, seed: int, num_clients: int) -> np.ndarray:
        """Every client's capacity for a whole run (``fixed``)."""
        counts = np.floor(self.probabilities() * num_clients).astype(np.int64)
        remainder = num_clients - counts.sum()
        order = np.argsort(-(self.probabilities() * num_clients - counts), kind="stable")
        counts[order[:remainder]] += 1  # largest remainders first
        dealt = np.repeat(np.asarray(self.levels, dtype=np.float64), counts)
        if self.assignment == "memory":
            if len(self.memory) != num_clients:
                raise ValueError(
                    f"capacity assignment 'memory' needs {num_clients} clients' memory, "
                    f"got {len(self.memory)}"
                )
            levels = np.empty(num_clients)
            most_first = np.argsort(-np.asarray(self.memory), kind="stable")
            levels[most_first] = np.sort(dealt)[::-1]
            return levels
        return dealt[seeding.rng(seed, CAPACITY).permutation(num_clients)]

    def of(self, seed: int, round_index: int, clients: np.ndarray, num_clients: int) -> np.ndarray:
        """The capacity of each of ``clients`` in round ``round_index``."""
        if self.assignment in ("fixed", "memory"):
            return self.fixed_levels(seed, num_clients)[clients]
        if self.assignment == "per-round":
            p, levels = self.probabilities(), np.asarray(self.levels, dtype=np.float64)
            return np.array(
                [
                    levels[seeding.rng(seed, CAPACITY, round_index, int(k)).choice(len(p), p=p)]
                    for k in clients
                ]
            )
        raise ValueError(f"unknown capacity assignment {self.assignment!r}")
