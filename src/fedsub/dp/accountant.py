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
accountant has no sampled-without-replacement event).
"""

from __future__ import annotations

import functools
from typing import Literal

import dp_accounting
from dp_accounting import pld, rdp

from fedsub.dp import distributed as distributed_dp

Accountant = Literal["rdp", "pld"]
Sampling = Literal["fixed", "poisson"]

# PLD's discretization (dp-accounting's default 1e-4 is slow for thousands of rounds; 1e-3
# changes epsilon by well under 1% at the settings fedsub runs)
PLD_DISCRETIZATION = 1e-3


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
    if rounds == 0:
        return 0.0
    accountant = fresh_accountant(kind, sampling)
    accountant.compose(
        run_event(noise_multiplier, rounds, sampling, num_clients, clients_per_round, distributed)
    )
    return float(accountant.get_epsilon(delta))


def calibrate(
    target_epsilon: float,
    rounds: int,
    delta: float,
    kind: Accountant,
    sampling: Sampling,
    num_clients: int,
    clients_per_round: int,
    distributed: bool = False,
) -> float:
    """The smallest noise multiplier (to dp-accounting's tolerance) whose ``rounds`` rounds
    spend at most ``target_epsilon`` at ``delta`` (dp_accounting.calibrate_dp_mechanism)."""

    def composed(z: float) -> dp_accounting.DpEvent:
        return run_event(z, rounds, sampling, num_clients, clients_per_round, distributed)

    def search(use: Accountant, bracket: dp_accounting.BracketInterval) -> float:
        return float(
            dp_accounting.calibrate_dp_mechanism(
                lambda: fresh_accountant(use, sampling),
                composed,
                target_epsilon,
                delta,
                bracket,
                tol=1e-4,
            )
        )

    z_rdp = search("rdp", dp_accounting.LowerEndpointAndGuess(0.05, 1.0))
    if kind == "rdp":
        return z_rdp
    # PLD's epsilon is at most RDP's, so its multiplier is at most RDP's; a PLD at a tiny
    # multiplier is huge and slow, so the search stays near RDP's answer
    return search("pld", dp_accounting.ExplicitBracketInterval(z_rdp / 2, z_rdp))
