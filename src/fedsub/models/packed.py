"""Affine maps with per-client weights over packed rows (a cohort's ragged lists, unpadded).

A cohort's history rows come packed: client after client (then sample after sample), T rows
in all, client k holding T_k of them. An MLP applied to every row with client k's weights is
one matmul per client, or one batched matmul over the rows padded to the longest client
(``max T_k`` is several times the mean on CTR histories). ``ClientBlocks`` lays the rows out in
blocks of ``BLOCK`` rows instead, each block one client's (its last block part-filled), and
gathers each block's weights: one ``baddbmm`` costs O(T + K * BLOCK) rows, whatever the
spread of the T_k.

The layout is built on the device from the per-client row counts without reading them: the
number of blocks is the bound ``(T + K * (BLOCK - 1)) // BLOCK`` (T, a tensor's length, is
known on the host), and the blocks past the last client's are idle. On the CPU, where reading
the counts costs nothing (``device.on_host``), the number of blocks is exact. The slots the
rows do not fill hold a copy of row 0; their outputs are never read back (``from_slots``), so
they get zero gradients and change no number.

On the CPU in float32, ``ClientGroups`` takes the rows as they are instead (no slots, no
padding): each client's rows are one contiguous group and each layer is one
``torch._grouped_mm`` (a matmul per client, looped in C++): no gathered copy of the weights
per block, no slot gathers, and each client's weight gradient is one matmul over its rows
rather than a sum of per-block products (the same numbers up to float32 rounding: the sums
are ordered differently). ``client_rows`` picks the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from fedsub import device as device_lib

BLOCK = 16  # rows per block: the idle slots' share against the per-block weight gathers


@dataclass(frozen=True)
class ClientBlocks:
    """The block layout of T packed rows of ``clients`` clients. With one client the rows are
    used as they are (one plain matmul, no blocks)."""

    clients: int
    slot_row: torch.Tensor | None  # [S] the packed row each slot holds (unfilled slots: row 0)
    row_slot: torch.Tensor | None  # [T] the slot of each packed row
    block_owner: torch.Tensor | None  # [S // BLOCK] the client of each block

    @staticmethod
    def of(rows_per_client: torch.Tensor, total: int) -> ClientBlocks:
        """``rows_per_client`` [K] (int64, adding up to ``total``, not checked)."""
        k = len(rows_per_client)
        if k == 1:
            return ClientBlocks(1, None, None, None)
        device = rows_per_client.device
        per_client = torch.div(rows_per_client + BLOCK - 1, BLOCK, rounding_mode="floor")
        if device_lib.on_host(rows_per_client):  # a read costs nothing: no idle blocks
            blocks = int(per_client.sum())
        else:
            blocks = (total + k * (BLOCK - 1)) // BLOCK
        block_end = per_client.cumsum(0)
        first_slot = (block_end - per_client) * BLOCK  # of each client's first block
        first_row = rows_per_client.cumsum(0) - rows_per_client
        owner = torch.searchsorted(block_end, torch.arange(blocks, device=device), right=True)
        owner = owner.clamp(max=k - 1)  # the idle blocks past the end
        slot_owner = owner.unsqueeze(1).expand(blocks, BLOCK).reshape(-1)
        within = torch.arange(blocks * BLOCK, device=device) - first_slot.index_select(
            0, slot_owner
        )
        filled = within < rows_per_client.index_select(0, slot_owner)
        slot_row = torch.where(filled, first_row.index_select(0, slot_owner) + within, 0)
        row_owner = torch.repeat_interleave(
            torch.arange(k, device=device), rows_per_client, output_size=total
        )
        rank = torch.arange(total, device=device) - first_row.index_select(0, row_owner)
        row_slot = first_slot.index_select(0, row_owner) + rank
        return ClientBlocks(k, slot_row, row_slot, owner)

    def to_slots(self, rows: torch.Tensor) -> torch.Tensor:
        """Packed [T, ...] -> slots [S, ...]."""
        return rows if self.slot_row is None else rows.index_select(0, self.slot_row)

    def from_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots [S, ...] -> packed [T, ...] (the unfilled slots dropped)."""
        return slots if self.row_slot is None else slots.index_select(0, self.row_slot)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        per_slot: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Slots [S, in] -> [S, out], each slot by its client's ``weight`` [K, in, out] and
        ``bias`` [K, out]; ``per_slot`` [S, out] is added too (in the same multiply-add)."""
        if self.block_owner is None:
            added = bias[0] if bias is not None else None
            if per_slot is not None:
                added = per_slot if added is None else per_slot + added
            return x @ weight[0] if added is None else torch.addmm(added, x, weight[0])
        owner = self.block_owner
        blocks = x.reshape(len(owner), BLOCK, x.shape[-1])
        weights = weight.index_select(0, owner)
        added = None if bias is None else bias.index_select(0, owner).unsqueeze(1)
        if per_slot is not None:
            slots = per_slot.reshape(len(owner), BLOCK, -1)
            added = slots if added is None else slots + added
        out = torch.bmm(blocks, weights) if added is None else torch.baddbmm(added, blocks, weights)
        return out.reshape(-1, weight.shape[-1])


_GROUPED_MM = getattr(torch, "_grouped_mm", None)  # torch >= 2.8; its CPU kernel: float32


def client_rows(rows_per_client: torch.Tensor, rows: torch.Tensor) -> ClientBlocks | ClientGroups:
    """The layout of ``rows`` [T, ...] (packed client after client, ``rows_per_client`` [K]
    of them each): ``ClientGroups`` on the CPU in float32 when torch has a grouped matmul,
    else ``ClientBlocks`` (a GPU, float64, one client)."""
    total = rows.shape[0]
    if (
        _GROUPED_MM is not None
        and len(rows_per_client) > 1
        and rows.dtype == torch.float32
        and device_lib.on_host(rows)
        and not torch.compiler.is_compiling()
    ):
        return ClientGroups.of(rows_per_client, total)
    return ClientBlocks.of(rows_per_client, total)


@dataclass(frozen=True)
class ClientGroups:
    """T packed rows of ``clients`` clients used in place: client k's rows are the k-th
    contiguous group (``ends`` [K], int32, where each group ends). The slots are the rows."""

    clients: int
    ends: torch.Tensor  # [K] int32: the end of each client's rows (torch._grouped_mm's offs)
    row_owner: torch.Tensor  # [T] the client of each row

    @staticmethod
    def of(rows_per_client: torch.Tensor, total: int) -> ClientGroups:
        k = len(rows_per_client)
        owner = torch.repeat_interleave(
            torch.arange(k, device=rows_per_client.device), rows_per_client, output_size=total
        )
        return ClientGroups(k, rows_per_client.cumsum(0).to(torch.int32), owner)

    def to_slots(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def from_slots(self, slots: torch.Tensor) -> torch.Tensor:
        return slots

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        per_slot: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows [T, in] -> [T, out], each row by its client's ``weight`` [K, in, out] and
        ``bias`` [K, out]; ``per_slot`` [T, out] is added too."""
        fan_in, fan_out = weight.shape[1:]
        if _aligned(fan_in) and _aligned(fan_out):
            out = _GroupedLinear.apply(x.contiguous(), weight.contiguous(), self.ends)
        elif fan_out == 1:  # one output (the grouped kernel wants 16-byte rows): a dot per row
            rows_weight = weight.squeeze(2).index_select(0, self.row_owner)
            out = (x * rows_weight).sum(1, keepdim=True)
        else:  # other widths that are not 16-byte rows: a product per row
            rows_weight = weight.index_select(0, self.row_owner)
            out = torch.bmm(x.unsqueeze(1), rows_weight).squeeze(1)
        if bias is not None:
            out = out.add_(bias.index_select(0, self.row_owner))  # in place: a fresh output
        return out if per_slot is None else out.add_(per_slot)


def _aligned(features: int) -> bool:
    return features % 4 == 0  # float32 rows of 16 bytes


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` on one thread: its CPU kernel loops over the groups, one small
    matmul each, and with several intra-op threads each of them would open (and wait at) a
    parallel region of its own: slower than one thread on an idle machine, and seconds a call
    on a loaded one (measured: 0.6 s against 0.7 ms, 2 threads, load 10)."""
    assert _GROUPED_MM is not None
    threads = torch.get_num_threads()
    if threads == 1:
        return _GROUPED_MM(a, b, offs=ends)
    torch.set_num_threads(1)
    try:
        return _GROUPED_MM(a, b, offs=ends)
    finally:
        torch.set_num_threads(threads)


class _GroupedLinear(torch.autograd.Function):
    """``x @ weight[k]`` for each client k's rows (``ends``: where each client's rows end)."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        return _grouped_mm(x, weight, ends)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, weight, ends = inputs
        ctx.save_for_backward(x, weight, ends)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, ends = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = _grouped_mm(grad, weight.transpose(1, 2), ends)
        if ctx.needs_input_grad[1]:  # [K, in, out]: each client's rows, one matmul
            grad_weight = _grouped_mm(x.T, grad, ends)
        return grad_x, grad_weight, None
