"""A count-min sketch of per-row heat: linear, so clients' sketches add up (securely).

With ``width = ceil(e / eps)`` and ``depth = ceil(ln(1 / delta))``, every estimate satisfies
``true <= estimate <= true + eps * total`` with probability at least ``1 - delta`` (Cormode and
Muthukrishnan 2005), ``total`` being the sum of all counts. Hashes are pairwise independent
(``((a m + b) mod p) mod width``) from a public seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MERSENNE_61 = (1 << 61) - 1


@dataclass(frozen=True)
class CountMinSketch:
    width: int
    depth: int
    seed: int = 0

    @staticmethod
    def for_error(eps: float, delta: float, seed: int = 0) -> CountMinSketch:
        return CountMinSketch(math.ceil(math.e / eps), math.ceil(math.log(1 / delta)), seed)

    @property
    def eps(self) -> float:
        return math.e / self.width

    @property
    def delta(self) -> float:
        return math.exp(-self.depth)

    def _coefficients(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, 0xC0FFEE])
        a = rng.integers(1, MERSENNE_61, size=self.depth, dtype=np.int64)
        b = rng.integers(0, MERSENNE_61, size=self.depth, dtype=np.int64)
        return a, b

    def buckets(self, rows: np.ndarray) -> np.ndarray:
        """[depth, len(rows)] bucket of each row in each hash row (exact integer arithmetic)."""
        a, b = self._coefficients()
        m = np.asarray(rows, dtype=object)
        out = np.empty((self.depth, len(rows)), dtype=np.int64)
        for d in range(self.depth):
            out[d] = ((int(a[d]) * m + int(b[d])) % MERSENNE_61 % self.width).astype(np.int64)
        return out

    def sketch(self, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """One client's sketch [depth, width] of ``counts`` at ``rows``."""
        table = np.zeros((self.depth, self.width), dtype=np.int64)
        buckets = self.buckets(rows)
        for d in range(self.depth):
            np.add.at(table[d], buckets[d], counts)
        return table

    def estimate(self, table: np.ndarray, rows: np.ndarray) -> np.ndarray:
        buckets = self.buckets(rows)
        return np.min(np.stack([table[d, buckets[d]] for d in range(self.depth)]), axis=0)
