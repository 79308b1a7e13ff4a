"""The privacy accounting of a run: one ``dp_accounting`` event per round, composed.

A round is one Gaussian mechanism with noise multiplier z on a subsampled cohort (the row
selection's and the update's noise are one mechanism: dp/settings.py's split keeps
1/z^2 = 1/z_sel^2 + 1/z_grad^2):

- Poisson sampling (``train.sampling = "poisson"``, each client joins with q = K/N):
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``, add-or-remove-one neighbours (the sum's
  sensitivity is C);
- fixed-size cohorts (K of N without replacement, fedsub's default): ``SampledWithout
  ReplacementDpEvent(N, K, GaussianDpEvent(z / 2))`` with replace-one neighbours: replacing a
  client changes the sum by up to 2C, and dp-accounting's noise multiplier is the noise's
  standard deviation over the L2 sensitivity, so the event's multiplier is zC / 2C = z / 2.

- distributed DP over secure aggregation (``distributed``: dp/distributed.py): each round is
  ``ZCDpEvent(rho, xi)`` with rho = 2 / z^2 + s, xi = s, s a slack below 1e-1000 (the sum of the
  clients' discrete Gaussian shares, Kairouz et al. 2021, replace-one), composed *without*
  sampling amplification: dp-accounting amplifies only Gaussian events, and the sum is not one.

Only dp-accounting computes an epsilon here (RDP, or PLD for Poisson sampling: its PLD
accountant has no sampled-without-replacement event). RDP keeps one round's RDP per event, so
the epsilon of r rounds, of rounds drawn from different populations (``epsilon_over``: a
Flower round accounted at the rate it sampled at) and the calibration of a target cost little.
Multipliers above ``Z_MAX`` are accounted at ``Z_MAX`` (an upper bound; dp-accounting fails or
rounds to 0 far above), and a target no multiplier in [Z_MIN, Z_MAX] meets is refused.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp

from fedsub.dp import distributed as distributed_dp
from fedsub.errors import ConfigError

Accountant = Literal["rdp", "pld"]
Sampling = Literal["fixed", "poisson"]

# PLD's discretization (dp-accounting's default 1e-4 is slow for thousands of rounds; 1e-3
# changes epsilon by well under 1% at the settings fedsub runs)
PLD_DISCRETIZATION = 1e-3
# the noise multipliers the accountant computes at: above Z_MAX epsilon is reported at Z_MAX
# (an upper bound; dp-accounting fails or returns 0 there), a target epsilon that Z_MIN already
# meets is refused (no privacy to speak of)
Z_MIN, Z_MAX = 0.05, 1000.0
CALIBRATION_TOLERANCE = 1e-4


def round_event(
    noise_multiplier: float,
    sampling: Sampling,
    num_clients: int,
    clients_per_round: int,
    distributed: bool = False,
) -> dp_accounting.DpEvent:
    """One round's event (the module docstring says why each)."""
    if distributed:
        return distributed_dp.round_event(noise_multiplier, clients_per_round)
    if sampling == "poisson":
        q = clients_per_round / num_clients
        return dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(noise_multiplier)
        )
    return dp_accounting.SampledWithoutReplacementDpEvent(
        num_clients, clients_per_round, dp_accounting.GaussianDpEvent(noise_multiplier / 2)
    )


def run_event(
    noise_multiplier: float,
    rounds: int,
    sampling: Sampling,
    num_clients: int,
    clients_per_round: int,
    distributed: bool = False,
) -> dp_accounting.DpEvent:
    """``rounds`` rounds composed: what ``epsilon`` accounts and ``calibrate`` solves for."""
    event = round_event(noise_multiplier, sampling, num_clients, clients_per_round, distributed)
    return dp_accounting.SelfComposedDpEvent(event, rounds)


def neighbours(sampling: Sampling) -> dp_accounting.NeighboringRelation:
    """Add-or-remove-one for Poisson sampling, replace-one for fixed-size cohorts."""
    if sampling == "poisson":
        return dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    return dp_accounting.NeighboringRelation.REPLACE_ONE


def fresh_accountant(kind: Accountant, sampling: Sampling) -> dp_accounting.PrivacyAccountant:
    if kind == "pld":
        if sampling != "poisson":
            raise ValueError(
                "dp-accounting's PLD accountant has no sampled-without-replacement event; "
                'use accountant "rdp" or train.sampling "poisson"'
            )
        return pld.PLDAccountant(neighbours(sampling), PLD_DISCRETIZATION)
    return rdp.RdpAccountant(neighboring_relation=neighbours(sampling))


Rounds = tuple[tuple[int, int], ...]  # (population N_t, rounds at it), in order


ORDERS: tuple[float, ...] = tuple(float(o) for o in rdp.RdpAccountant().orders)


@functools.lru_cache(maxsize=1024)
def round_rdp(
    noise_multiplier: float,
    sampling: Sampling,
    num_clients: int,
    clients_per_round: int,
    distributed: bool = False,
    orders: tuple[float, ...] = ORDERS,
) -> np.ndarray:
    """One round's RDP at ``orders`` (dp-accounting's default ones unless a calibration looks
    at a few): computed once per round event, so that ``rounds`` rounds cost one
    multiplication (what ``RdpAccountant.compose(event, rounds)`` computes) instead of a new
    accountant. Each order's value is computed alone, so a subset's values are the full
    set's."""
    accountant = rdp.RdpAccountant(list(orders), neighbours(sampling))
    z = accounted_multiplier(noise_multiplier)
    accountant.compose(round_event(z, sampling, num_clients, clients_per_round, distributed))
    return accountant.rdp


def rdp_epsilon(
    noise_multiplier: float,
    populations: Rounds,
    delta: float,
    sampling: Sampling,
    clients_per_round: int,
    distributed: bool = False,
    orders: tuple[float, ...] = ORDERS,
) -> tuple[float, float]:
    """RDP's epsilon over ``populations`` (``epsilon_over``) and the order it is at."""
    total = np.zeros(len(orders))
    for n, count in populations:
        total = total + count * round_rdp(
            noise_multiplier, sampling, n, clients_per_round, distributed, orders
        )
    spent, order = rdp.compute_epsilon(np.asarray(orders), total, delta)
    return float(spent), float(order)


def accounted_multiplier(noise_multiplier: float) -> float:
    """The multiplier the accountant is asked about: z, or ``Z_MAX`` above it. dp-accounting's
    sampled-without-replacement RDP fails (math domain error) and its other events return 0
    with warnings for multipliers in the thousands; epsilon falls as z grows, so epsilon at
    ``Z_MAX`` is an upper bound on epsilon at any larger z (reported as such)."""
    return min(noise_multiplier, Z_MAX)


def epsilon_over(
    noise_multiplier: float,
    populations: Rounds,
    delta: float,
    kind: Accountant,
    sampling: Sampling,
    clients_per_round: int,
    distributed: bool = False,
) -> float:
    """Epsilon at ``delta`` after rounds whose cohorts were drawn from the populations
    ``populations`` lists ((N_t, number of rounds at N_t), each round its own event
    composed): a round that sampled K of the N_t clients then online is accounted at q_t =
    K / N_t (0 rounds: 0)."""
    populations = tuple((n, count) for n, count in populations if count > 0)
    if not populations:
        return 0.0
    if kind == "rdp":
        spent, _ = rdp_epsilon(
            noise_multiplier, populations, delta, sampling, clients_per_round, distributed
        )
        return spent
    accountant = fresh_accountant(kind, sampling)
    z = accounted_multiplier(noise_multiplier)
    try:
        for n, count in populations:
            accountant.compose(round_event(z, sampling, n, clients_per_round, distributed), count)
        return float(accountant.get_epsilon(delta))
    except (MemoryError, ValueError, OverflowError):
        # PLD's discretized loss distribution does not fit (multipliers far below 0.01, no
        # privacy to speak of): RDP's epsilon, a valid upper bound, instead of a raw error
        spent, _ = rdp_epsilon(
            noise_multiplier, populations, delta, sampling, clients_per_round, distributed
        )
        return spent


@functools.lru_cache(maxsize=4096)
def epsilon(
    noise_multiplier: float,
    rounds: int,
    delta: float,
    kind: Accountant,
    sampling: Sampling,
    num_clients: int,
    clients_per_round: int,
    distributed: bool = False,
) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds (0 before the first)."""
    return epsilon_over(
        noise_multiplier,
        ((num_clients, rounds),),
        delta,
        kind,
        sampling,
        clients_per_round,
        distributed,
    )


class CalibrationError(ConfigError):
    """A target epsilon no noise multiplier in [Z_MIN, Z_MAX] meets as asked: the message says
    what epsilon those bounds give."""


def calibrate(
    target_epsilon: float,
    rounds: int,
    delta: float,
    kind: Accountant,
    sampling: Sampling,
    num_clients: int,
    clients_per_round: int,
    distributed: bool = False,
    on_step: Callable[[], None] | None = None,
) -> float:
    """The smallest noise multiplier (to ``CALIBRATION_TOLERANCE``) whose ``rounds`` rounds
    spend at most ``target_epsilon`` at ``delta``, found as dp_accounting.
    calibrate_dp_mechanism finds it (a bracket, then Brent's method) but in a few seconds:
    RDP's search runs on the orders near the bracket's optimal ones (``_rdp_root``).
    ``on_step`` is called after each epsilon computed (progress). A target above epsilon at
    ``Z_MIN`` (any z would do: no meaningful privacy) or below epsilon at ``Z_MAX`` raises
    ``CalibrationError``."""
    population = ((num_clients, rounds),)

    def rdp_gap(z: float, orders: tuple[float, ...] = ORDERS) -> tuple[float, float]:
        spent, order = rdp_epsilon(
            z, population, delta, sampling, clients_per_round, distributed, orders
        )
        if on_step is not None:
            on_step()
        return _log_ratio(spent, target_epsilon), order

    low, high = _bracket(lambda z: rdp_gap(z)[0], target_epsilon, rounds)
    z_rdp = _rdp_root(rdp_gap, low, high)
    if kind == "rdp":
        return z_rdp

    def pld_gap(z: float) -> float:
        spent = epsilon(z, rounds, delta, "pld", sampling, num_clients, clients_per_round)
        if on_step is not None:
            on_step()
        return _log_ratio(spent, target_epsilon)

    # PLD's epsilon is at most RDP's, so its multiplier is at most RDP's; a PLD at a tiny
    # multiplier is huge and slow, so the search stays near RDP's answer
    low = max(z_rdp / 2, Z_MIN)
    if pld_gap(low) <= 0:
        return low
    return _brent(pld_gap, low, z_rdp)


def _rdp_root(
    gap: Callable[[float, tuple[float, ...]], tuple[float, float]], low: float, high: float
) -> float:
    """RDP's root in the bracket, searched on the orders within a factor 2 of those optimal
    at its ends (a round's RDP at the large orders costs most), then checked on all orders:
    where the optimal order at the root is among those searched, epsilon there is the same
    on both, so the root is the full search's; otherwise the search runs again on all."""
    order_low, order_high = gap(low, ORDERS)[1], gap(high, ORDERS)[1]
    window = tuple(o for o in ORDERS if order_low / 2 <= o <= 2 * order_high)
    root = _brent(lambda z: gap(z, window)[0], low, high)
    if gap(root, ORDERS)[1] in window:
        return root
    return _brent(lambda z: gap(z, ORDERS)[0], low, high)


def _log_ratio(spent: float, target: float) -> float:
    """log(epsilon / target): positive when epsilon exceeds the target, and nearly linear in
    log z, where the root search interpolates (epsilon 0 read as 1e-300)."""
    return math.log(max(spent, 1e-300) / target)


def _bracket(gap: Callable[[float], float], target: float, rounds: int) -> tuple[float, float]:
    """(low, high) with gap(low) > 0 >= gap(high) for the decreasing ``gap`` (a log ratio,
    ``_log_ratio``), from z = 1 by factors of 4 within [Z_MIN, Z_MAX]."""
    low, high = 1.0, 1.0
    if gap(1.0) > 0:
        while True:
            if high >= Z_MAX:
                raise CalibrationError(
                    f"dp.target_epsilon = {target:g} cannot be met over {rounds} rounds: even "
                    f"noise multiplier z = {Z_MAX:g} spends epsilon "
                    f"{target * math.exp(gap(Z_MAX)):.4g}; "
                    "raise the target, or run fewer rounds or smaller cohorts"
                )
            low, high = high, min(high * 4, Z_MAX)
            if gap(high) <= 0:
                return low, high
    while True:
        if low <= Z_MIN:
            raise CalibrationError(
                f"dp.target_epsilon = {target:g} is no privacy: noise multiplier z = "
                f"{Z_MIN:g} already spends only epsilon {target * math.exp(gap(Z_MIN)):.4g} over "
                f"{rounds} rounds; give a target below that, or dp.noise_multiplier"
            )
        high, low = low, max(low / 4, Z_MIN)
        if gap(low) > 0:
            return low, high


def _brent(gap: Callable[[float], float], low: float, high: float) -> float:
    """The smallest z in [low, high] (gap(low) > 0 >= gap(high), ``gap`` decreasing) with
    gap(z) <= 0, to ``CALIBRATION_TOLERANCE``: the Illinois variant of regula falsi, with a
    bisection whenever a step fails to halve the bracket, in log z (a few steps fewer than
    Brent's method, which dp_accounting.calibrate_dp_mechanism runs through scipy). The
    bracket's upper end is returned, so the multiplier never spends more than the target."""
    g_low, g_high = gap(low), gap(high)
    side = 0  # which end moved last: -1 low, 1 high (Illinois halves the other's value)
    while high - low > CALIBRATION_TOLERANCE:
        width = high - low  # interpolated in log z, where the log ratio is nearly linear
        x_low, x_high = math.log(low), math.log(high)
        z = math.exp(x_high - g_high * (x_high - x_low) / (g_high - g_low))
        z = min(max(z, low + CALIBRATION_TOLERANCE / 4), high - CALIBRATION_TOLERANCE / 4)
        g = gap(z)
        if g > 0:
            low, g_low = z, g
            g_high = g_high / 2 if side == -1 else g_high
            side = -1
        else:
            high, g_high = z, g
            g_low = g_low / 2 if side == 1 else g_low
            side = 1
        if high - low > width / 2 and high - low > CALIBRATION_TOLERANCE:
            middle = (low + high) / 2
            g = gap(middle)
            if g > 0:
                low, g_low = middle, g
            else:
                high, g_high = middle, g
    return high
