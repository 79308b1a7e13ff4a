"""Which clients take part in a round, and how many times each was drawn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedsub.numerics import seeding

SamplingKind = Literal["uniform", "proportional-with-replacement"]  # an algorithm's scheme's
Sampling = Literal["fixed", "poisson"]  # train.sampling


@dataclass(frozen=True)
class Cohort:
    """The round's distinct clients (sorted) and how often each was drawn (Scheme I may draw a
    client twice; it trains once and counts twice)."""

    clients: np.ndarray
    multiplicity: np.ndarray

    def __len__(self) -> int:
        return len(self.clients)


def uniform_cohort(seed: seeding.Seed, round_index: int, num_clients: int, k: int) -> np.ndarray:
    """K clients uniformly without replacement, sorted; the same for every algorithm."""
    generator = seeding.rng(seed, seeding.SAMPLING, round_index)
    return np.sort(generator.choice(num_clients, size=min(k, num_clients), replace=False))


def poisson_cohort(seed: seeding.Seed, round_index: int, num_clients: int, k: int) -> Cohort:
    """Each client joins independently with probability q = K / N (``train.sampling =
    "poisson"``, the sampling DP-FedAvg's accounting assumes); the cohort may be empty."""
    generator = seeding.rng(seed, seeding.SAMPLING, round_index, 2)
    clients = np.nonzero(generator.random(num_clients) < min(k, num_clients) / num_clients)[0]
    return Cohort(clients.astype(np.int64), np.ones(len(clients), dtype=np.int64))


def sample_cohort(
    kind: SamplingKind, seed: seeding.Seed, round_index: int, sample_counts: np.ndarray, k: int
) -> Cohort:
    """``uniform``: K distinct clients, equally likely. ``proportional-with-replacement``:
    K draws with replacement, client k drawn with probability n_k / n (Li et al., Scheme I)."""
    if kind == "uniform":
        clients = uniform_cohort(seed, round_index, len(sample_counts), k)
        return Cohort(clients, np.ones(len(clients), dtype=np.int64))
    if kind == "proportional-with-replacement":
        generator = seeding.rng(seed, seeding.SAMPLING, round_index, 1)
        p = sample_counts / sample_counts.sum()
        draws = generator.choice(len(sample_counts), size=k, replace=True, p=p)
        clients, multiplicity = np.unique(draws, return_counts=True)
        return Cohort(clients, multiplicity.astype(np.int64))
    raise ValueError(f"unknown sampling {kind!r}")


def draw_cohort(
    kind: SamplingKind,
    sampling: Sampling,
    k: int,
    counts: np.ndarray,
    seed: seeding.Seed,
    round_index: int,
    among: np.ndarray | None = None,
) -> Cohort:
    """Round ``round_index``'s cohort of ``k`` clients among the clients ``among`` (sorted
    positions into the sample ``counts``; None: all), keyed by ``seed`` and the round, so every
    runtime draws the same one: train.sampling's Poisson draw, or the algorithm's scheme's
    ``kind``; empty when nobody can take part."""
    pool = counts if among is None else counts[among]
    if len(pool) == 0:
        return Cohort(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    if sampling == "poisson":
        cohort = poisson_cohort(seed, round_index, len(pool), k)
    else:
        cohort = sample_cohort(kind, seed, round_index, pool, k)
    return cohort if among is None else Cohort(among[cohort.clients], cohort.multiplicity)
