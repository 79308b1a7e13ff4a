"""A canary audit of [dp]'s one round, as a privacy reviewer runs it (Jagielski et al. 2020,
Nasr et al. 2021): an empirical lower bound on epsilon from many one-round trials of fedsub's
own mechanism (``DpMechanism.combine``, the cohort drawn by ``poisson_cohort``), which must stay
below the epsilon fedsub reports, and which catches the two designs the issue found planted:
noise drawn from the published seed, and a cohort drawn from it.

The trials are vectorised: a table of 2T rows of one value; client k (one of N = 2T) touches
only row k, with the clipped update C (a canary, k < T) or 0 (k >= T: the same client without
its canary, since the denominator is fixed). Each row is then one independent trial of the
Gaussian mechanism on one user's presence (rows = "all": independent noise on every row), so
a round gives T trials of each world. The attacker guesses "canary in" when the released row
(times the public denominator D) passes a threshold t fixed beforehand (a few, Bonferroni);
Clopper-Pearson bounds on its false-positive and false-negative rates give
eps_lb = log((1 - delta - FNR_ub) / FPR_ub), which DP forbids above the true epsilon (Kairouz
et al.'s hypothesis-testing bound), up to the bounds' confidence 1 - ALPHA.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedsub.algorithms.sampling import poisson_cohort
from fedsub.dp.mechanism import DpMechanism, gaussian, round_generator
from fedsub.dp.randomness import DpStreams
from fedsub.dp.settings import Accounting, DpSettings, NoiseKey
from fedsub.numerics.seeding import Seed
from fedsub.submodel.transfer import CohortUpdate

PUBLIC_SEED = 0  # train.seed: the run folder's config.toml publishes it
DELTA = 1e-6
ALPHA = 1e-3  # the audit's false alarm: the bounds hold together with probability >= 1 - ALPHA
THRESHOLDS = (0.5, 1.0, 2.0, 3.0, 4.0)  # t / C, fixed before looking at the trials


def settings_of(z: float, clients: int, expected: int, randomness: str) -> DpSettings:
    accounting = Accounting(DELTA, "pld", "poisson", clients, expected, rounds=1)
    return DpSettings(
        clip=1.0,
        noise_multiplier=z,
        accounting=accounting,
        rows="all",
        key=NoiseKey(randomness, PUBLIC_SEED),  # type: ignore[arg-type]  (a Randomness literal)
    )


def canary_update(members: np.ndarray, canaries: int) -> CohortUpdate:
    """Member k's update: row k of table "t", value C = 1 if k is a canary (k < T) else 0."""
    clients = torch.from_numpy(members.astype(np.int64))
    values = (clients < canaries).to(torch.float64).unsqueeze(1)
    count = len(members)
    return CohortUpdate(
        clients=clients,
        weights=torch.ones(count, dtype=torch.float64),
        multiplicity=torch.ones(count, dtype=torch.int64),
        rows={"t": clients},
        row_owner={"t": torch.arange(count)},
        table_deltas={"t": values},
        dense_deltas={},
    )


def released(mechanism: DpMechanism, cohort_key: Seed, round_index: int, canaries: int):
    """One round as fedsub runs it: the Poisson cohort drawn with ``cohort_key``, each row of
    the released update times the public D."""
    settings = mechanism.settings
    n, k = settings.accounting.num_clients, settings.accounting.clients_per_round
    members = poisson_cohort(cohort_key, round_index, n, k).clients
    update = mechanism.combine(canary_update(members, canaries), round_index)
    return update.tables["t"].values[:, 0].numpy() * mechanism.denominator


def redrawn_noise(settings: DpSettings, round_index: int) -> np.ndarray:
    """The attack: the round's noise redrawn from the published seed, as fedsub draws it."""
    n = settings.accounting.num_clients
    std = settings.update_multiplier * settings.clip
    return gaussian((n, 1), std, round_generator(PUBLIC_SEED, round_index))[:, 0].numpy()


def epsilon_lower_bound(guess_in: np.ndarray, guess_out: np.ndarray) -> float:
    """The best of the thresholds' bounds: ``guess_in[i, j]``: threshold i guessed "in" on
    canary trial j (a true positive), ``guess_out[i, j]``: on a trial without the canary (a
    false positive); Clopper-Pearson at ALPHA / (2 * thresholds) each side."""
    a = ALPHA / (2 * len(guess_in))
    best = 0.0
    for hits, false in zip(guess_in, guess_out, strict=True):
        n_in, n_out = len(hits), len(false)
        misses, fp = int((~hits).sum()), int(false.sum())
        fnr_ub = 1.0 if misses == n_in else stats.beta.ppf(1 - a, misses + 1, n_in - misses)
        fpr_ub = 1.0 if fp == n_out else stats.beta.ppf(1 - a, fp + 1, n_out - fp)
        if 1 - DELTA - fnr_ub > 0:
            best = max(best, math.log((1 - DELTA - fnr_ub) / fpr_ub))
    return best


def audit(
    z: float,
    q: float,
    canaries: int,
    rounds: int,
    randomness: str,
    cohort_from_seed: bool = False,
    subtract: bool = False,
    known_cohort: bool = False,
) -> tuple[float, float]:
    """(eps_lb, the epsilon fedsub reports) over ``rounds`` rounds of T = ``canaries`` trials
    of each world. ``cohort_from_seed``: plant a cohort drawn from the public seed;
    ``subtract``: the attacker subtracts the noise redrawn from the seed; ``known_cohort``: the
    attacker redraws the cohort from the seed and guesses "in" only for its members."""
    n = 2 * canaries
    settings = settings_of(z, n, round(q * n), randomness)
    mechanism = DpMechanism(settings, {"t": n}, np.ones(n), streams=DpStreams(randomness, 0))
    assert mechanism.streams is not None
    key = PUBLIC_SEED if cohort_from_seed else mechanism.streams.key
    thresholds = np.array(THRESHOLDS)[:, None] * settings.clip
    guess_in, guess_out = [], []
    for r in range(1, rounds + 1):
        scores = released(mechanism, key, r, canaries)
        if subtract:
            scores = scores - redrawn_noise(settings, r)
        guess = scores[None, :] > thresholds
        if known_cohort:
            drawn = poisson_cohort(PUBLIC_SEED, r, n, settings.accounting.clients_per_round)
            member = np.zeros(n, dtype=bool)
            member[drawn.clients] = True
            guess &= member[None, :]
        guess_in.append(guess[:, :canaries])
        guess_out.append(guess[:, canaries:])
    lower = epsilon_lower_bound(np.concatenate(guess_in, 1), np.concatenate(guess_out, 1))
    return lower, settings.epsilon(1)


# -- the noise: every client in the round (q = 1), one Gaussian mechanism ---------------------


def test_the_noise_audit_stays_below_the_reported_epsilon_and_the_attack_gains_nothing():
    for subtract in (False, True):  # the attack: subtract the noise redrawn from the seed
        lower, reported = audit(1.0, 1.0, 20_000, 2, "secret", subtract=subtract)
        assert lower <= reported, (subtract, lower, reported)
    assert reported == pytest.approx(4.89, abs=0.05)  # PLD: z = 1, delta = 1e-6


def test_the_noise_audit_catches_noise_drawn_from_the_published_seed():
    lower, reported = audit(1.0, 1.0, 20_000, 2, "seeded", subtract=True)
    assert lower > reported + 2  # the noise cancels: every trial told apart
    plain, _ = audit(1.0, 1.0, 20_000, 2, "seeded")  # not subtracted: nothing to see
    assert plain <= reported


# -- the cohort: Poisson q = 0.01, the amplification by sampling ------------------------------


def test_the_cohort_audit_stays_below_the_amplified_epsilon():
    for known in (False, True):  # the attack: the cohort redrawn from the seed
        lower, reported = audit(1.0, 0.01, 200_000, 2, "secret", known_cohort=known)
        assert lower <= reported, (known, lower, reported)
    assert reported == pytest.approx(0.364, abs=0.01)


def test_the_cohort_audit_catches_a_cohort_drawn_from_the_published_seed():
    # noise kept secret, the cohort public: the attacker tests only the sampled canaries,
    # which is the Gaussian mechanism without amplification
    lower, reported = audit(1.0, 0.01, 200_000, 2, "secret", True, known_cohort=True)
    assert lower > 2 * reported
