"""Which process owns which rows of a table: contiguous ranges, in rank order.

Process r of P owns rows ``[start_r, stop_r)`` of a table of n rows, the ranges of
``Processes.share(n)``: sizes differ by at most one, the first ``n mod P`` processes take one
row more. A row's owner and its position in the owner's shard are then arithmetic (a sorted
search among P boundaries), and the concatenation of the shards in rank order is the table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedsub.distributed import Processes


@dataclass(frozen=True)
class RowPartition:
    """A table of ``rows`` rows cut into ``world_size`` contiguous ranges."""

    rows: int
    world_size: int

    def range_of(self, rank: int) -> range:
        """The rows process ``rank`` owns."""
        return Processes(rank, self.world_size).share(self.rows)

    def starts(self) -> torch.Tensor:
        """The first row of every process's range, in rank order (int64)."""
        return torch.tensor([self.range_of(r).start for r in range(self.world_size)])

    def owners(self, rows: torch.Tensor) -> torch.Tensor:
        """The owning rank of each of ``rows`` (global ids)."""
        starts = self.starts().to(rows.device)
        # an empty range starts where the next one does: right=True skips it
        return torch.searchsorted(starts, rows, right=True) - 1

    def local(self, rows: torch.Tensor, rank: int) -> torch.Tensor:
        """``rows`` (owned by ``rank``) as positions in its shard."""
        return rows - self.range_of(rank).start
