"""Ragged id lists in CSR form as torch tensors, on any device: the round's view of ``Ragged``.

The same layout as ``fedsub.data.ragged.Ragged`` (``values`` [nnz], ``offsets`` [n + 1], int64),
built once per run from the numpy arrays (``from_numpy`` shares their memory on the CPU), so
the round gathers ids on the model's device: torch ops there, zero-copy numpy views on the
CPU (where they are faster; both kernels are tested against ``Ragged.take``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedsub import device as device_lib
from fedsub.data.ragged import Ragged


@dataclass(frozen=True)
class TorchRagged:
    values: torch.Tensor
    offsets: torch.Tensor

    @staticmethod
    def of(ragged: Ragged, device: torch.device) -> TorchRagged:
        return TorchRagged(
            torch.from_numpy(ragged.values).to(device), torch.from_numpy(ragged.offsets).to(device)
        )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def row(self, i: int) -> torch.Tensor:
        """List ``i``'s values (a view)."""
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def take(self, index: torch.Tensor) -> TorchRagged:
        """The lists at ``index`` (int64, any order, repeats allowed), as ``Ragged.take``."""
        return self.take_with_owners(index)[0]

    def take_with_owners(
        self, index: torch.Tensor, total: int | None = None
    ) -> tuple[TorchRagged, torch.Tensor]:
        """``take(index)`` and, for each of its values, the position in ``index`` it came
        from (what ``owners()`` of the result gives, computed once for both).

        ``total``: the number of values taken, when the caller knows it (from host arrays):
        the torch kernel then never reads the device (one host sync less on a GPU).
        On the CPU the gather runs in numpy on zero-copy views: a cohort's take is ~10 ops on
        ~10^4 ids, where torch's per-op cost makes it about 3x slower than numpy."""
        if device_lib.on_host(index):
            return self._numpy_take(index)
        return self._torch_take(index, total)

    def _numpy_take(self, index: torch.Tensor) -> tuple[TorchRagged, torch.Tensor]:
        taken, owners = self.numpy().take_with_owners(index.numpy())
        return TorchRagged.of(taken, index.device), torch.from_numpy(owners)

    def _torch_take(
        self, index: torch.Tensor, total: int | None = None
    ) -> tuple[TorchRagged, torch.Tensor]:
        starts = self.offsets.index_select(0, index)  # index_select: no advanced-indexing cost
        lengths = self.offsets.index_select(0, index + 1) - starts
        offsets = torch.zeros(len(index) + 1, dtype=torch.int64, device=index.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        if total is None:
            total = int(offsets[-1])  # a host read: callers on a GPU pass ``total``
        owners = torch.repeat_interleave(
            torch.arange(len(index), device=index.device), lengths, output_size=total
        )
        positions = (starts - offsets[:-1]).index_select(0, owners)
        positions += torch.arange(total, device=index.device)
        return TorchRagged(self.values.index_select(0, positions), offsets), owners

    def owners(self) -> torch.Tensor:
        """For every value, the list it belongs to: ``[0] * len_0 + [1] * len_1 + ...``."""
        lengths = self.lengths()
        return torch.repeat_interleave(
            torch.arange(len(lengths), device=lengths.device), lengths, output_size=len(self.values)
        )

    def numpy(self) -> Ragged:
        """Back to the numpy layout (for reporting and tests)."""
        return Ragged(self.values.cpu().numpy(), self.offsets.cpu().numpy())
