"""Epsilon of DP-FTRL's tree aggregation for the participation pattern that runs, no sampling.

The whole run releases, for every row, the noisy value of every complete node of the tree
over the rounds (dp/tree_noise.py; Honaker's estimates are post-processing of them). One user
who takes part in the rounds P (a set allowed by the ``Pattern``, dp/participation.py) with
contributions x_p, ||x_p|| <= C, moves node n by sum_{p in n} x_p; the L2 sensitivity of the
whole release is C times

    sens(P)^2 = max over the x_p of sum_n ||sum_{p in n ∩ P} x_p||^2 / C^2
              = sum_n |n ∩ P|^2

(the tree's matrix is non-negative, so aligned contributions are the worst case: Choquette-Choo
et al. 2023, "Multi-epoch matrix factorization mechanisms for private machine learning",
ICML, the sensitivity of a non-negative strategy), maximised here *exactly* over every P the
pattern allows (``tree_sensitivity``: a dynamic program over the tree, checked against an
enumeration of the patterns in tests/test_dp_ftrl.py). With one participation it is the
tree's depth, the sensitivity dp-accounting's ``SingleEpochTreeAggregationDpEvent`` charges
(Kairouz et al. 2021, appendix D); the tests check the two epsilons agree.

The neighbouring relation is zero-out (a user's contributions replaced by zeros: the
relation of Kairouz et al. and Choquette-Choo et al.; a fixed denominator keeps the
sensitivity C per participation). With ``rows = "private"`` each participation also adds to
one round's selection histogram (independent noise of multiplier z_sel), so the run is one
Gaussian mechanism of effective multiplier

    1 / z_eff^2 = k_max / z_sel^2 + sens^2 / z_tree^2,

k_max the most participations the pattern allows (or, with fedsub's dp.selection_refresh,
the fewer released selection histograms a user can add to: ``selections``), and epsilon is
dp-accounting's for ``GaussianDpEvent(z_eff)`` (RDP or PLD). Only dp-accounting computes an
epsilon here.
"""

from __future__ import annotations

import functools
import math

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp

from fedsub.dp.participation import Pattern

NEG = -np.inf


def _leaf(complete: bool, k: int, far: int) -> np.ndarray:
    """A leaf's table: value[c, f, l] of c participations, the first f rounds after the
    node's start and the last l rounds before its end (both capped at ``far``)."""
    table = np.full((k + 1, far + 1, far + 1), NEG)
    table[0, far, far] = 0.0
    if complete and k >= 1:
        table[1, 0, 0] = 1.0
    return table


def _merge(left: np.ndarray, right: np.ndarray, width: int, far: int) -> np.ndarray:
    """Two sibling subtrees (``width`` leaves each) joined: the best value for each count and
    boundary offsets, keeping the last participation of the left and the first of the right
    at least min_separation apart (l + f >= far, far = min_separation - 1)."""
    k = left.shape[0] - 1
    out = np.full_like(left, NEG)
    out[0, far, far] = 0.0
    # one side empty: an offset carried across the empty half, offset -> min(offset + width,
    # far); the offsets reaching far meet there (the maximum over them: exact, in any order)
    if k >= 1:
        kept = max(far - width, 0)  # the offsets below far - width keep their own grown offset
        if kept:
            out[1:, width:far, :] = right[1:, :kept, :]
            out[1:, :, width:far] = np.maximum(out[1:, :, width:far], left[1:, :, :kept])
        out[1:, far, :] = np.maximum(out[1:, far, :], right[1:, kept:, :].max(axis=1))
        out[1:, :, far] = np.maximum(out[1:, :, far], left[1:, :, kept:].max(axis=2))
    # suffix maxima of the left's last offset: best[c, f, x] = max over l >= x of left[c, f, l]
    best = np.maximum.accumulate(left[:, :, ::-1], axis=2)[:, :, ::-1]
    needed = np.maximum(far - np.arange(far + 1), 0)  # the least l for the right's first f2
    for c1 in range(1, k):
        for c2 in range(1, k - c1 + 1):
            _join(out[c1 + c2], best[c1][:, needed], right[c2])
    return out


DENSE_JOIN = 8  # _join: tables of at most this many offsets joined whole (fewer numpy calls)


def _join(out: np.ndarray, first: np.ndarray, right: np.ndarray) -> None:
    """out[f1, l2] = max(out[f1, l2], max over f2 of first[f1, f2] + right[f2, l2]), in place:
    the left's best with c1 participations (``first[f1, f2]``: its last one far enough before
    the right's first at f2) joined to the right's with c2. Only the offsets where both sides
    have a finite value take part (a term with a side at -inf is -inf, which no maximum
    takes: the same numbers, and most joins have none)."""
    if first.shape[0] <= DENSE_JOIN:  # small tables (a short separation): all at once
        np.maximum(out, (first[:, :, None] + right[None]).max(axis=1), out=out)
        return
    rows = np.flatnonzero(first.max(axis=1) > NEG)
    if not len(rows):
        return
    middle = np.flatnonzero((first[rows].max(axis=0) > NEG) & (right.max(axis=1) > NEG))
    if not len(middle):
        return
    columns = np.flatnonzero(right[middle].max(axis=0) > NEG)
    # candidate[f1, f2, l2] = first[f1, f2] + right[f2, l2], over the finite offsets
    candidate = first[np.ix_(rows, middle)][:, :, None] + right[np.ix_(middle, columns)][None]
    block = np.ix_(rows, columns)
    out[block] = np.maximum(out[block], candidate.max(axis=1))


_ALIKE: dict[tuple[int, int], dict[tuple[int, bool], np.ndarray]] = {}  # by (k, far)


@functools.lru_cache(maxsize=256)
def tree_sensitivity(rounds: int, pattern: Pattern) -> float:
    """sens = sqrt(max over the pattern's participations P of sum over the complete nodes n
    of the tree over ``rounds`` rounds of |n ∩ P|^2) (module docstring), in units of C: a
    dynamic program over the tree whose nodes inside (or after) the rounds are all alike at
    a level, so it merges O(levels) tables."""
    if rounds <= 0:
        return 0.0
    k = pattern.most(rounds)
    far = max(pattern.min_separation, 1) - 1
    squares = (np.arange(k + 1) ** 2).astype(float)[:, None, None]
    # a node wholly inside (or after) the rounds has the table of every such node of its level,
    # whatever the rounds: kept across calls (a run asks for every round's epsilon)
    if len(_ALIKE) > 64:  # a process going through many patterns: start over
        _ALIKE.clear()
    alike = _ALIKE.setdefault((k, far), {})

    def table(level: int, index: int) -> np.ndarray:
        start, end = index << level, (index + 1) << level
        inside = end <= rounds
        if (inside or start >= rounds) and (level, inside) in alike:
            return alike[(level, inside)]
        if level == 0:
            value = _leaf(inside, k, far)
        else:
            width = 1 << (level - 1)
            value = _merge(table(level - 1, 2 * index), table(level - 1, 2 * index + 1), width, far)
            if inside:
                value = value + squares
        if inside or start >= rounds:
            alike[(level, inside)] = value
        return value

    height = (rounds - 1).bit_length()
    return math.sqrt(float(table(height, 0).max()))


def effective_multiplier(
    update_multiplier: float,
    selection_multiplier: float | None,
    rounds: int,
    pattern: Pattern,
    sensitivity: float | None = None,
    selections: int | None = None,
) -> float:
    """z_eff of the whole run (module docstring): the tree's node noise z_tree =
    ``update_multiplier`` over the sensitivity (the tree's, or ``sensitivity`` when given:
    the BLT strategy's), and the row selection's (``rows = "private"``:
    ``selection_multiplier``) over k_max participations (or ``selections`` released
    histograms a user adds to, when given: dp.selection_refresh's count)."""
    sens = tree_sensitivity(rounds, pattern) if sensitivity is None else sensitivity
    inverse = (sens / update_multiplier) ** 2
    if selection_multiplier is not None:
        count = pattern.most(rounds) if selections is None else selections
        inverse += count / selection_multiplier**2
    return math.inf if inverse == 0 else 1.0 / math.sqrt(inverse)


@functools.lru_cache(maxsize=4096)
def gaussian_epsilon(multiplier: float, delta: float, accountant: str) -> float:
    """Epsilon at ``delta`` of one Gaussian mechanism of noise multiplier ``multiplier``
    (zero-out neighbours: add-or-remove), from dp-accounting. Kept per arguments: a run asks
    every round, and the multiplier changes only when the pattern's sensitivity or count does
    (15 distinct values in the embedded default's 150 rounds), while dp-accounting's RDP
    takes about 0.25 ms a call, a tenth of a plain round."""
    if math.isinf(multiplier):
        return 0.0
    event = dp_accounting.GaussianDpEvent(multiplier)
    if accountant == "pld":
        relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        accounted: dp_accounting.PrivacyAccountant = pld.PLDAccountant(relation)
    else:
        accounted = rdp.RdpAccountant()
    return float(accounted.compose(event).get_epsilon(delta))


def calibrate_gaussian(target_epsilon: float, delta: float, accountant: str) -> float:
    """The least Gaussian multiplier spending ``target_epsilon`` at ``delta``
    (dp_accounting.calibrate_dp_mechanism)."""
    kind = accountant

    def make(multiplier: float) -> dp_accounting.DpEvent:
        return dp_accounting.GaussianDpEvent(multiplier)

    def fresh() -> dp_accounting.PrivacyAccountant:
        if kind == "pld":
            return pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        return rdp.RdpAccountant()

    return float(
        dp_accounting.calibrate_dp_mechanism(
            fresh,
            make,
            target_epsilon,
            delta,
            dp_accounting.ExplicitBracketInterval(1e-3, 1e4),
            tol=1e-6,
        )
    )
