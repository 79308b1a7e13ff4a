"""Which clients take part in a round."""

from __future__ import annotations

import numpy as np

from fedsub.engine import seeding


def uniform_cohort(seed: int, round_index: int, num_clients: int, k: int) -> np.ndarray:
    """K clients uniformly without replacement, sorted; the same for every algorithm."""
    generator = seeding.rng(seed, seeding.SAMPLING, round_index)
    return np.sort(generator.choice(num_clients, size=min(k, num_clients), replace=False))
