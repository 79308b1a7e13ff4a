"""Randomized response on a client's index set: local differential privacy for heat counts.

For every row m of the table a client reports one bit: 1 with probability p if m is in its
set, with probability 1 - p if not, ``p = e^eps / (1 + e^eps)``. Each bit is eps-LDP (a
client's membership of any one row is hidden with ratio ``p / (1 - p) = e^eps``). From the
reports the server estimates, without bias::

    n_m ~ (sum_k w_k r_km - (1 - p) sum_k w_k) / (2p - 1)

(``w_k = 1`` for client counts, the sample counts for the weighted heat).
"""

from __future__ import annotations

import math

import numpy as np


def keep_probability(epsilon: float) -> float:
    return math.exp(epsilon) / (1 + math.exp(epsilon))


def epsilon_of(p: float) -> float:
    """The LDP epsilon of reporting a bit truthfully with probability p."""
    return math.log(p / (1 - p))


def report(members: np.ndarray, universe: int, epsilon: float, rng: np.random.Generator):
    """One client's noisy indicator bits over rows 0..universe-1."""
    p = keep_probability(epsilon)
    truth = np.zeros(universe, dtype=bool)
    truth[members] = True
    keep = rng.random(universe) < p
    return np.where(keep, truth, ~truth)


def estimate(weighted_reports: np.ndarray, total_weight: float, epsilon: float) -> np.ndarray:
    """Unbiased heat estimate from ``sum_k w_k * report_k``."""
    p = keep_probability(epsilon)
    return (weighted_reports - (1 - p) * total_weight) / (2 * p - 1)
