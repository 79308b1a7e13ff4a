"""A node's private heat contribution, and the heat the server reads from their sum.

On a network (fedsub.privacy.heat_protocol) every node computes its own contribution from its
index sets S(k) and weight w_k (1 for heat = "clients", its sample count for "samples"):

- ``secagg``: per table the indicator of S(k) times w_k, then ``[w_k, 1]``: one uint32 vector
  summed by secure aggregation, so the server learns the exact heat, the population's total
  sample count and its number of clients, and nothing about one node;
- ``sketch``: per table the count-min sketch of w_k at S(k), then ``[w_k, 1]``, summed the same
  way; the server reads an over-estimate within ``eps * total`` w.p. ``1 - delta``;
- ``randomized-response``: per table the node's eps-LDP noisy indicator bits (drawn on the node
  with private randomness) and w_k in the clear; the server debiases their weighted sum.

The layout (tables in sorted name order, the two totals last) is fixed here, on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedsub.privacy import randomized_response as rr
from fedsub.privacy.heat_sources import HeatPrivacy
from fedsub.privacy.sketch import CountMinSketch
from fedsub.submodel.heat import HeatKind

SUMMED_SOURCES = ("secagg", "sketch")  # contributions added up by secure aggregation
PRIVATE_SOURCES = (*SUMMED_SOURCES, "randomized-response")


@dataclass(frozen=True)
class MeasuredHeat:
    """Per table the heat of every row as the private source revealed it (float64), with the
    population's totals the aggregation needs: the sum of sample counts, the number of
    clients, and the smallest client weight an estimate is clipped to (1 if unknown)."""

    source: str
    heat: dict[str, np.ndarray]
    total_samples: float
    num_clients: int
    lowest_weight: float = 1.0


def client_weight(kind: HeatKind, num_samples: int) -> int:
    return 1 if kind == "clients" else int(num_samples)


def _sketch(privacy: HeatPrivacy) -> CountMinSketch:
    return CountMinSketch.for_error(privacy.sketch_eps, privacy.sketch_delta, privacy.seed)


def summed_length(privacy: HeatPrivacy, table_rows: Mapping[str, int]) -> int:
    """Length of one node's secure-sum vector."""
    if privacy.source == "sketch":
        sketch = _sketch(privacy)
        return len(table_rows) * sketch.depth * sketch.width + 2
    return sum(table_rows.values()) + 2


def summed_vector(
    privacy: HeatPrivacy,
    kind: HeatKind,
    table_rows: Mapping[str, int],
    rows: Mapping[str, np.ndarray],
    num_samples: int,
) -> np.ndarray:
    """One node's uint32 contribution to the secure sum (``secagg`` or ``sketch``)."""
    w = client_weight(kind, num_samples)
    parts = []
    for table in sorted(table_rows):
        own = np.asarray(rows[table], dtype=np.int64)
        if privacy.source == "secagg":
            part = np.zeros(table_rows[table], dtype=np.uint32)
            part[own] = w
        elif privacy.source == "sketch":
            part = _sketch(privacy).sketch(own, np.full(len(own), w)).reshape(-1)
        else:
            raise ValueError(f"heat source {privacy.source!r} is not summed securely")
        parts.append(part.astype(np.uint32))
    parts.append(np.array([num_samples, 1], dtype=np.uint32))
    return np.concatenate(parts)


def heat_from_sum(
    privacy: HeatPrivacy, table_rows: Mapping[str, int], total: np.ndarray
) -> MeasuredHeat:
    """The heat the server reads from the sum of every node's ``summed_vector``."""
    total = np.asarray(total).astype(np.int64)
    if len(total) != summed_length(privacy, table_rows):
        raise ValueError(
            f"secure sum of {len(total)} values, expected {summed_length(privacy, table_rows)}"
        )
    heat, start = {}, 0
    for table in sorted(table_rows):
        if privacy.source == "sketch":
            sketch = _sketch(privacy)
            size = sketch.depth * sketch.width
            table_sketch = total[start : start + size].reshape(sketch.depth, sketch.width)
            heat[table] = sketch.estimate(table_sketch, np.arange(table_rows[table]))
        else:
            size = table_rows[table]
            heat[table] = total[start : start + size]
        heat[table] = heat[table].astype(np.float64)
        start += size
    return MeasuredHeat(privacy.source, heat, float(total[-2]), int(total[-1]))


def noisy_bits(
    privacy: HeatPrivacy,
    table_rows: Mapping[str, int],
    rows: Mapping[str, np.ndarray],
    rng: np.random.Generator | None = None,
) -> dict[str, np.ndarray]:
    """One node's randomized-response bits per table. ``rng`` defaults to fresh OS entropy:
    a node's noise must be unknown to the server (a seed it knows would undo it)."""
    rng = rng if rng is not None else np.random.default_rng()
    return {
        t: rr.report(np.asarray(rows[t], dtype=np.int64), n, privacy.rr_epsilon, rng)
        for t, n in sorted(table_rows.items())
    }


def heat_from_reports(
    privacy: HeatPrivacy,
    kind: HeatKind,
    table_rows: Mapping[str, int],
    reports: Sequence[tuple[Mapping[str, np.ndarray], int]],
) -> MeasuredHeat:
    """The unbiased heat estimate from every node's (bits per table, sample count): the same
    estimator as the in-process source (``randomized_response.estimate``)."""
    weights = np.array([client_weight(kind, n) for _, n in reports], dtype=np.float64)
    heat = {}
    for table, size in table_rows.items():
        weighted = np.zeros(size)
        for (bits, _), w in zip(reports, weights, strict=True):
            weighted += w * np.asarray(bits[table], dtype=np.float64)
        heat[table] = rr.estimate(weighted, float(weights.sum()), privacy.rr_epsilon)
    samples = [n for _, n in reports]
    lowest = float(min(samples)) if kind == "samples" else 1.0
    return MeasuredHeat(privacy.source, heat, float(sum(samples)), len(reports), lowest)
