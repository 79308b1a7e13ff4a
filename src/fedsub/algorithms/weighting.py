"""How a round weights its members' deltas (``a_k``), each weighting one small piece.

With ``c_k`` the times member k was drawn, ``w_k`` its sample count and ``p_k = w_k / W``
(``W`` the sum of w over all N clients):

- ``samples``: ``c_k w_k / sum_round c w``      - ``uniform``: ``c_k / sum_round c``
- ``scheme2``: ``(N / K) p_k``                   - ``original``: ``p_k``

A piece says whether its weights sum to 1 (sub-model masking's slice average divides by
their sum, so it refuses those that do not) and how a member computes its own weight at
``privacy.level = "full"`` from public numbers (``SecureWeighting``), or None when a secure
sum cannot compute it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

Weighting = Literal["samples", "uniform", "scheme2", "original"]


class CohortMembers(Protocol):
    """What client weighting reads of a round's update: each member's sample count and how
    often it was drawn (a ``CohortUpdate`` or a width-sliced ``MaskedCohortUpdate``)."""

    @property
    def weights(self) -> torch.Tensor: ...

    @property
    def multiplicity(self) -> torch.Tensor: ...


class Totals(Protocol):
    """The population's totals a weighting may read (an ``Aggregation`` has them): W and N."""

    @property
    def population_weight(self) -> float: ...

    @property
    def num_clients(self) -> int: ...


@dataclass(frozen=True)
class SecureWeighting:
    """A member's aggregation weight a_k at ``full``, computed by the member itself from public
    numbers and its own sample count n_k, which never leaves it in the clear:
    ``a_k = units_k * scale`` with ``units_k = draws_k * (n_k if by_count else 1)``, an integer
    that goes into the secure sum's weight slot. When the weighting is a normalized mean
    (``samples``, ``uniform``) the server multiplies the decoded sums by
    ``correction(total units of the survivors)``, so the round's step is the survivors'
    weighted mean, as the plain aggregation's ``sum_k units_k delta_k / sum_k units_k``."""

    draws: tuple[int, ...]  # per member: its draws m_k (normalized weightings) or 1
    by_count: bool
    scale: float  # public: 1 / (expected cohort units) or the weighting's population factor
    normalized: bool
    model_average: bool = False  # Scheme II: the old model is rescaled by sum_k a_k

    def units(self, member: int, count: int) -> int:
        return self.draws[member] * (count if self.by_count else 1)

    def coefficient(self, units: int) -> float:
        """The factor a member multiplies its deltas by before encoding them."""
        return units * self.scale

    def correction(self, total_units: int) -> float:
        """The factor of the decoded sums: 1 / (scale * the survivors' units) when normalized."""
        if not self.normalized:
            return 1.0
        if total_units <= 0:
            raise ValueError("the secure sum's weight units add up to 0: no member's weight")
        return 1.0 / (self.scale * total_units)

    def model_scale(self, total_units: int) -> float | None:
        """Scheme II's factor f = sum_k a_k of the survivors (``model_average``), else None."""
        return self.scale * total_units if self.model_average else None


@dataclass(frozen=True)
class ClientWeighting:
    """One weighting: ``weights(cohort, totals)`` -> a_k (float64, one per member);
    ``secure(draws, totals)`` -> the same a_k as a ``SecureWeighting`` (None: a secure sum
    cannot compute it); ``sums_to_one``: its weights sum to 1 by construction;
    ``reads_totals``: it needs the population's totals (W, N)."""

    name: str
    weights: Callable[[CohortMembers, Totals], torch.Tensor]
    secure: Callable[[list[int], Totals], SecureWeighting] | None
    sums_to_one: bool
    reads_totals: bool = False


def _drawn(cohort: CohortMembers) -> torch.Tensor:
    return cohort.multiplicity.to(torch.float64)


def _population_share(cohort: CohortMembers, totals: Totals) -> torch.Tensor:
    return cohort.weights / totals.population_weight


def _per_cohort(cohort: CohortMembers, totals: Totals) -> torch.Tensor:
    # a 0-d float64 tensor: the division stays on the device (no host read)
    return totals.num_clients / cohort.multiplicity.sum().to(torch.float64)


def _secure_samples(draws: list[int], totals: Totals) -> SecureWeighting:
    """The scale keeps a member's coefficient near its plain a_k (1 / (draws * W / N)), so
    the fixed-point range (``privacy.secagg_clip``) bounds the same values as the plain one."""
    mean = totals.population_weight / max(totals.num_clients, 1)
    expected = sum(draws) * mean if mean > 0 else float(sum(draws))
    return SecureWeighting(tuple(draws), True, 1.0 / expected, True)


def _secure_population(per_cohort: bool) -> Callable[[list[int], Totals], SecureWeighting]:
    def secure(draws: list[int], totals: Totals) -> SecureWeighting:
        scale = 1.0 / totals.population_weight  # n_k / W (times N / draws)
        if per_cohort:
            scale *= totals.num_clients / sum(draws)
        return SecureWeighting((1,) * len(draws), True, scale, False)

    return secure


WEIGHTINGS: dict[str, ClientWeighting] = {
    "samples": ClientWeighting(
        "samples",
        lambda c, t: _drawn(c) * c.weights / (_drawn(c) * c.weights).sum(),
        _secure_samples,
        sums_to_one=True,
    ),
    "uniform": ClientWeighting(
        "uniform",
        lambda c, t: _drawn(c) / _drawn(c).sum(),
        lambda draws, t: SecureWeighting(tuple(draws), False, 1.0 / sum(draws), True),
        sums_to_one=True,
    ),
    "scheme2": ClientWeighting(
        "scheme2",
        lambda c, t: _population_share(c, t) * _per_cohort(c, t),
        _secure_population(per_cohort=True),
        sums_to_one=False,
        reads_totals=True,
    ),
    "original": ClientWeighting(
        "original",
        _population_share,
        _secure_population(per_cohort=False),
        sums_to_one=False,
        reads_totals=True,
    ),
}
