"""Private download: what a client asks the server for, so the request hides its rows S(k).

Two designs, both keyed by a seeded generator so a run is reproducible:

- **Randomized response** (Niu et al., MobiCom 2020) over the candidate set, here the whole
  table (a candidate set chosen from the client's data would itself leak): every row the
  client has is requested with probability p, every other row with probability q < p. Any one
  row's membership is then hidden with local differential privacy
  ``epsilon = ln(p (1 - q) / (q (1 - p)))``. A real row left out of the request is *skipped*
  that round, as in Niu et al.'s design the client trains only with the real rows it
  downloaded: the row reads as zero in its local steps (the feature is absent from its
  samples) and it sends no update for it (``privacy/private_rounds.WithoutRows``; a Flower node
  does the same). Each row thus gets an update from a fraction p of its clients, and the
  server, which knows p, divides a row's sum by p to keep its expected update unchanged.
- **Size buckets**: the request is S(k) plus uniformly drawn decoy rows, padded to the
  smallest size class ``bucket * 2^i`` strictly above |S(k)| (capped at the table), so its
  size tells only the class. Every real row is requested and trained.

From the randomized requests the server can still estimate how many clients hold a row
without bias: ``(c - q N) / (p - q)`` for c requests among N clients (``estimate_holders``).
"""

from __future__ import annotations

import math

import numpy as np


def epsilon_of(p: float, q: float) -> float:
    """The local DP epsilon of requesting a held row w.p. p and any other row w.p. q."""
    if not 0 < q < p < 1:
        raise ValueError(f"need 0 < q < p < 1, got p = {p}, q = {q}")
    return math.log(p * (1 - q) / (q * (1 - p)))


def decoy_probability(epsilon: float, p: float) -> float:
    """The q that gives ``epsilon`` together with keep probability p:
    ``q / (1 - q) = e^-epsilon * p / (1 - p)``."""
    if not epsilon > 0 or not 0 < p < 1:
        raise ValueError(f"need epsilon > 0 and 0 < p < 1, got epsilon = {epsilon}, p = {p}")
    odds = p / (1 - p) * math.exp(-epsilon)
    return odds / (1 + odds)


def _outside(rows: np.ndarray, count: int, table_rows: int, rng: np.random.Generator):
    """``count`` distinct rows of 0..table_rows-1 not in ``rows`` (sorted unique), uniformly:
    positions in the complement are drawn, then mapped to row ids (O(count log |rows|))."""
    picks = rng.choice(table_rows - len(rows), size=count, replace=False)
    # the i-th row of the complement is i plus the number of held rows at or below it
    shifted = rows - np.arange(len(rows))
    return np.sort(picks + np.searchsorted(shifted, picks, side="right"))


def randomized_request(
    rows: np.ndarray, table_rows: int, p: float, q: float, rng: np.random.Generator
) -> np.ndarray:
    """The rows requested by randomized response: each of ``rows`` (sorted unique) w.p. p,
    each other row of the table w.p. q (their number is binomial, their choice uniform)."""
    rows = np.asarray(rows, dtype=np.int64)
    kept = rows[rng.random(len(rows)) < p]
    decoys = _outside(rows, int(rng.binomial(table_rows - len(rows), q)), table_rows, rng)
    return np.sort(np.concatenate([kept, decoys]))  # disjoint: decoys are outside ``rows``


def size_class(count: int, bucket: int, table_rows: int) -> int:
    """The smallest ``bucket * 2^i`` strictly above ``count`` (at most the table's size)."""
    size = bucket
    while size <= count:
        size *= 2
    return min(size, table_rows)


def bucketed_request(
    rows: np.ndarray, table_rows: int, bucket: int, rng: np.random.Generator
) -> np.ndarray:
    """``rows`` (sorted unique) and uniform decoys, padded to the size class of |rows|."""
    rows = np.asarray(rows, dtype=np.int64)
    padding = size_class(len(rows), bucket, table_rows) - len(rows)
    return np.sort(np.concatenate([rows, _outside(rows, padding, table_rows, rng)]))


def estimate_holders(requests: np.ndarray, clients: int, p: float, q: float) -> np.ndarray:
    """Unbiased estimate of how many of ``clients`` hold each row, from how many requested it
    by randomized response: E[c] = p n + q (N - n), so n = (c - q N) / (p - q)."""
    return (np.asarray(requests, dtype=np.float64) - q * clients) / (p - q)
