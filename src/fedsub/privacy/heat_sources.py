"""Where FedSubAvg's heat comes from: ``privacy.heat_source``.

- ``exact``: the index sets in the clear (the server sees every S(k)).
- ``secagg``: each client submits its indicator vector (or w_k at its rows) through secure
  aggregation, in groups of ``group_size`` clients (Bonawitz et al. costs O(group^2) per
  group); the server learns each group's sum and the exact heat, nothing about one client.
- ``sketch``: each client's count-min sketch, summed by secure aggregation; the server gets
  an over-estimate within ``eps * total`` with probability ``1 - delta``.
- ``randomized-response``: eps-LDP noisy indicator bits per row; an unbiased estimate. In
  process the clients' coins are keyed by the run's secret (``HeatPrivacy.coins``,
  privacy/randomness.py ``HeatCoins``), or by ``train.seed`` with ``privacy.randomness =
  "seeded"`` (then the estimate decodes back into the exact counts: NOT private).

The sketch's hash functions are drawn from ``train.seed`` on purpose: the server needs them to
read the summed sketch, and a client's sketch stays hidden by secure aggregation (whose masks
are OS entropy, privacy/secagg.py), not by the hashes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fedsub.data.federated import Population
from fedsub.numerics import seeding
from fedsub.privacy import randomized_response as rr
from fedsub.privacy.randomness import HEAT_NOT_PRIVATE, HeatCoins
from fedsub.privacy.secagg import secure_sum
from fedsub.privacy.sketch import CountMinSketch
from fedsub.progress import phase
from fedsub.submodel import heat as heat_lib
from fedsub.submodel.index import SubmodelIndex

SOURCES = ("exact", "secagg", "sketch", "randomized-response")
RR_PURPOSE = 0x5151  # the randomized-response heat's stream (seeding.rng's purpose)


@dataclass(frozen=True)
class HeatPrivacy:
    source: str = "exact"
    group_size: int = 50
    sketch_eps: float = 0.001
    sketch_delta: float = 0.01
    rr_epsilon: float = 2.0
    seed: int = 0
    # randomized response's coins in process: the run's secret (None: keyed by ``seed``, the
    # public train.seed: what ``privacy.randomness = "seeded"`` keeps)
    coins: HeatCoins | None = field(default=None, compare=False)

    def estimate(
        self,
        dataset: Population,
        index: SubmodelIndex,
        kind: heat_lib.HeatKind,
        keep: Mapping[str, range] | None = None,
    ) -> dict[str, np.ndarray]:
        """The heat of every row as this source reveals it (``estimate_heat``)."""
        return estimate_heat(dataset, index, kind, self, keep)

    @property
    def rr_key(self) -> seeding.Seed:
        """What randomized response's coins are keyed by: the run's secret, or the seed."""
        return self.seed if self.coins is None else self.coins.key


def _client_values(dataset: Population, kind: heat_lib.HeatKind) -> np.ndarray:
    counts = dataset.sample_counts()
    return np.ones_like(counts) if kind == "clients" else counts


def grouped_secure_sum(
    vectors: list[np.ndarray], group_size: int, what: str = "vectors"
) -> np.ndarray:
    """Sum of uint32 vectors by secure aggregation in groups (threshold floor(n/2) + 1).
    A group costs O(group^2) key agreements, so progress is reported per client summed."""
    total = np.zeros(len(vectors[0]), dtype=np.uint32)
    label = f"secagg {what} (groups of {group_size})"
    with phase(label, total=len(vectors)) as advance:
        for start in range(0, len(vectors), group_size):
            group = dict(enumerate(vectors[start : start + group_size]))
            group_sum, _ = secure_sum(group, threshold=len(group) // 2 + 1)
            total = total + group_sum
            advance(len(group))
    return total


def estimate_heat(
    dataset: Population,
    index: SubmodelIndex,
    kind: heat_lib.HeatKind,
    privacy: HeatPrivacy,
    keep: Mapping[str, range] | None = None,
) -> dict[str, np.ndarray]:
    """Per table, the heat of every row (float64) as the chosen source reveals it; with
    ``keep``, of the rows ``keep[table]`` only (a process's share of a row-sharded table: the
    same values as the whole heat's, without an array as long as the table)."""
    values = _client_values(dataset, kind)
    result = {}
    with phase(f"heat counts ({privacy.source})", total=len(dataset.table_rows)) as advance:
        for table, num_rows in dataset.table_rows.items():
            rows = range(num_rows) if keep is None else keep[table]
            result[table] = _table_heat(dataset, index, kind, privacy, values, table, rows)
            advance(1)
    return result


def _table_heat(
    dataset: Population,
    index: SubmodelIndex,
    kind: heat_lib.HeatKind,
    privacy: HeatPrivacy,
    values: np.ndarray,
    table: str,
    keep: range,
) -> np.ndarray:
    """The heat of the rows ``keep`` of one table, as the chosen source reveals it."""
    rows, num_rows = index.rows[table], dataset.table_rows[table]
    members = [rows.values[rows.offsets[k] : rows.offsets[k + 1]] for k in range(len(values))]
    if privacy.source == "exact":
        return heat_lib.heat(rows, num_rows, dataset.sample_counts(), kind, keep)
    elif privacy.source == "secagg":  # sums of the rows kept: the kept rows of the sums
        vectors = []
        for own, w in zip(members, values, strict=True):
            vector = np.zeros(len(keep), dtype=np.uint32)
            vector[own[(own >= keep.start) & (own < keep.stop)] - keep.start] = w
            vectors.append(vector)
        what = table
        return grouped_secure_sum(vectors, privacy.group_size, what).astype(np.float64)
    elif privacy.source == "sketch":  # a sketch is as wide as eps says, whatever the rows
        sketch = CountMinSketch.for_error(privacy.sketch_eps, privacy.sketch_delta, privacy.seed)
        sketches = [
            sketch.sketch(own, np.full(len(own), w)).astype(np.uint32).reshape(-1)
            for own, w in zip(members, values, strict=True)
        ]
        what = f"{table} sketches"
        summed = grouped_secure_sum(sketches, privacy.group_size, what).astype(np.int64)
        table_sketch = summed.reshape(sketch.depth, sketch.width)
        kept = np.arange(keep.start, keep.stop)
        return sketch.estimate(table_sketch, kept).astype(np.float64)
    elif privacy.source == "randomized-response":
        rng = seeding.rng(privacy.rr_key, RR_PURPOSE)  # seeded: default_rng([seed, 0x5151])
        weighted = np.zeros(len(keep))
        for own, w in zip(members, values, strict=True):
            weighted += w * rr.report(own, num_rows, privacy.rr_epsilon, rng, keep)
        return rr.estimate(weighted, float(values.sum()), privacy.rr_epsilon)
    else:
        raise ValueError(f"unknown heat source {privacy.source!r}; choose from {SOURCES}")


def describe(
    dataset: Population, index: SubmodelIndex, kind: heat_lib.HeatKind, privacy: HeatPrivacy
) -> dict:
    """What the chosen source guarantees, for the run's record (``heat_source.json``)."""
    values = _client_values(dataset, kind)
    info: dict = {"source": privacy.source, "heat": kind}
    if privacy.source == "secagg":
        info.update(
            group_size=privacy.group_size,
            threshold="floor(group / 2) + 1",
            modulus="2^32",
            exact=True,
        )
    elif privacy.source == "sketch":
        sketch = CountMinSketch.for_error(privacy.sketch_eps, privacy.sketch_delta, privacy.seed)
        info.update(width=sketch.width, depth=sketch.depth, eps=sketch.eps, delta=sketch.delta)
        info["error_bound"] = {
            table: sketch.eps * float((index.rows[table].lengths() * values).sum())
            for table in dataset.table_rows
        }
        info["error_bound_meaning"] = "estimate - true <= bound, per row, w.p. >= 1 - delta"
    elif privacy.source == "randomized-response":
        p = rr.keep_probability(privacy.rr_epsilon)
        info.update(epsilon=privacy.rr_epsilon, keep_probability=p)
        info["estimate_std"] = float(np.sqrt(p * (1 - p) * (values**2).sum()) / (2 * p - 1))
        info.update(coins_record(privacy.coins))
    return info


def coins_record(coins: HeatCoins | None) -> dict:
    """Where randomized response's coins came from, for ``heat_source.json`` (after the run
    settled them: a resumed old checkpoint continues seeded)."""
    if coins is None:
        return {}
    info: dict = {"randomness": coins.randomness}
    if coins.randomness == "seeded":
        info["not_private"] = HEAT_NOT_PRIVATE
    return info
