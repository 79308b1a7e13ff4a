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


CHUNK = 1 << 20  # uniforms drawn at a time when only some rows' bits are kept


def report(
    members: np.ndarray,
    universe: int,
    epsilon: float,
    rng: np.random.Generator,
    keep: range | None = None,
) -> np.ndarray:
    """One client's noisy indicator bits over rows 0..universe-1, or over the rows ``keep``
    only (a process's share of a row-sharded table): the same bits, the generator left where
    the whole report leaves it (its uniforms are drawn in chunks, of which only ``keep``'s
    are kept: numpy draws the same uniforms in chunks as at once)."""
    p = keep_probability(epsilon)
    rows = range(universe) if keep is None else keep
    truth = np.zeros(len(rows), dtype=bool)
    truth[members[(members >= rows.start) & (members < rows.stop)] - rows.start] = True
    if rows == range(universe):
        kept = rng.random(universe) < p
    else:
        kept = np.empty(len(rows), dtype=bool)
        for start in range(0, universe, CHUNK):
            chunk = rng.random(min(CHUNK, universe - start))
            low, high = max(rows.start, start), min(rows.stop, start + len(chunk))
            if low < high:
                kept[low - rows.start : high - rows.start] = chunk[low - start : high - start] < p
    return np.where(kept, truth, ~truth)


def estimate(weighted_reports: np.ndarray, total_weight: float, epsilon: float) -> np.ndarray:
    """Unbiased heat estimate from ``sum_k w_k * report_k``."""
    p = keep_probability(epsilon)
    return (weighted_reports - (1 - p) * total_weight) / (2 * p - 1)
