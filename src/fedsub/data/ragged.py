"""Ragged id lists in CSR form: the layout of every sparse feature in fedsub.

One table's ids for a batch of samples, e.g. three samples with 2, 0 and 3 ids::

    sample     0        1     2
             ┌────┬────┐   ┌────┬────┬────┐
    values   │ 17 │ 4  │   │ 9  │ 17 │ 30 │        values  = [17, 4, 9, 17, 30]
             └────┴────┘   └────┴────┴────┘
    offsets  0         2   2              5        offsets = [0, 2, 2, 5]

Sample ``i`` owns ``values[offsets[i]:offsets[i + 1]]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Ragged:
    """Ragged int64 id lists: ``values`` [nnz] and ``offsets`` [n + 1], offsets[0] == 0."""

    values: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        if self.offsets.ndim != 1 or len(self.offsets) == 0 or self.offsets[0] != 0:
            raise ValueError("offsets must be a 1-d array starting at 0")
        if self.offsets[-1] != len(self.values):
            raise ValueError(
                f"offsets end at {self.offsets[-1]} but there are {len(self.values)} values"
            )

    @staticmethod
    def from_lists(lists: Sequence[Sequence[int] | np.ndarray]) -> Ragged:
        """Row i is ``lists[i]`` (lists of ints or integer arrays)."""
        lengths = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
        offsets = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        parts = [np.asarray(x, dtype=np.int64) for x in lists]
        values = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return Ragged(values, offsets)

    @staticmethod
    def from_fixed(ids: np.ndarray) -> Ragged:
        """Every sample has the same number of ids: ``ids`` is [n, width]."""
        n, width = ids.shape
        offsets = np.arange(0, (n + 1) * width, width, dtype=np.int64)
        return Ragged(np.ascontiguousarray(ids, dtype=np.int64).reshape(-1), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def take(self, index: np.ndarray) -> Ragged:
        """The samples at ``index`` (any order, repeats allowed), vectorised."""
        return self.take_with_owners(index)[0]

    def take_with_owners(self, index: np.ndarray) -> tuple[Ragged, np.ndarray]:
        """``take(index)`` and, for each of its values, the position in ``index`` it came from."""
        index = np.asarray(index, dtype=np.int64)
        starts = self.offsets[index]
        lengths = self.offsets[index + 1] - starts
        offsets = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        owners = np.repeat(np.arange(len(index)), lengths)
        positions = (starts - offsets[:-1])[owners] + np.arange(offsets[-1], dtype=np.int64)
        return Ragged(self.values[positions], offsets), owners

    def slice(self, start: int, stop: int) -> Ragged:
        """Samples ``start:stop`` without copying values."""
        base = self.offsets[start]
        return Ragged(self.values[base : self.offsets[stop]], self.offsets[start : stop + 1] - base)

    @staticmethod
    def concat(parts: list[Ragged]) -> Ragged:
        values = np.concatenate([p.values for p in parts]) if parts else np.zeros(0, np.int64)
        lengths = np.concatenate([p.lengths() for p in parts]) if parts else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Ragged(values, offsets)
