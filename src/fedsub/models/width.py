"""Width slicing: a sub-model keeps some channels of every layer (seed 003, HeteroFL, FedRolex).

A width-sliceable model names its *channel groups* (a layer's output channels, and every
tensor that must follow them: the layer's bias, a normalization's scale, the next layer's
input channels, a residual stream's every block) and, for each dense parameter, which group
each axis belongs to (``None``: the axis is kept whole, e.g. kernel size or the classes).

A ``ChannelSlice`` picks sorted channel indices per group. Extraction and merging go by those
indices (one ``index_put_`` / advanced-indexing gather per tensor), so a client's sub-model
costs O(its size), never a copy of the full model. A ``CoordinateMask`` is seed 003's
Algorithm 1 instead: every coordinate kept with probability p, the shapes unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Axes = tuple[str | None, ...]


@dataclass(frozen=True)
class Slicing:
    """Channel groups (name -> channel count C) and each dense parameter's axes' groups."""

    groups: dict[str, int]
    axes: dict[str, Axes]

    def kept(self, capacity: float) -> dict[str, int]:
        """L = ceil(C * capacity) channels per group (at least one)."""
        return {g: max(1, math.ceil(c * capacity - 1e-9)) for g, c in self.groups.items()}


@dataclass(frozen=True)
class ChannelSlice:
    """A sub-model by channel indices: ``channels[group]`` sorted, 1-D int64."""

    slicing: Slicing
    channels: dict[str, torch.Tensor]
    capacity: float

    def key(self) -> tuple:
        """Equal keys mean equal sub-models (clients with the same key train the same slice);
        read on the host, where ``plan`` draws the slices."""
        return (self.capacity, *(tuple(c.tolist()) for c in self.channels.values()))

    def to(self, device: torch.device) -> ChannelSlice:
        """The same slice with its channel indices on ``device`` (where the model lives)."""
        moved = {g: c.to(device) for g, c in self.channels.items()}
        return ChannelSlice(self.slicing, moved, self.capacity)

    def _grid(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Index tensors on ``tensor``'s device, one per axis, broadcasting to the
        sub-tensor's shape."""
        shape, device = tensor.shape, tensor.device
        axes = self.slicing.axes[name]
        if len(axes) != len(shape):
            raise ValueError(f"{name}: slicing names {len(axes)} axes, the tensor has {len(shape)}")
        grid = []
        for position, (group, size) in enumerate(zip(axes, shape, strict=True)):
            if group is None:
                index = torch.arange(size, device=device)
            else:
                index = self.channels[group].to(device)  # a no-op once the slice is ``to`` it
            view = [1] * len(shape)
            view[position] = len(index)
            grid.append(index.reshape(view))
        return tuple(grid)

    def extract(self, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The sub-model's tensors (new tensors of the narrowed shapes)."""
        return {n: p[self._grid(n, p)] for n, p in dense.items()}

    def place(self, dense: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
        """Write a sub-model's tensors back into the full tensors, in place."""
        for n, p in dense.items():
            p.index_put_(self._grid(n, p), values[n].to(p.dtype))

    def add(self, dense: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
        """``full[slice] += values`` for every tensor, in place."""
        for n, p in dense.items():
            p.index_put_(self._grid(n, p), values[n].to(p.dtype), accumulate=True)

    def add_constant(self, dense: dict[str, torch.Tensor], value: float | torch.Tensor) -> None:
        """``full[slice] += value``: counts how often (or how much weight) trained each entry
        (``value`` a number or a 0-d tensor, so a GPU run need not read it on the host)."""
        for n, p in dense.items():
            grid = self._grid(n, p)
            constant = torch.as_tensor(value, dtype=p.dtype, device=p.device)
            p.index_put_(grid, constant, accumulate=True)


@dataclass(frozen=True)
class CoordinateMask:
    """Seed 003 Algorithm 1: the client trains ``mask * x`` (each coordinate kept with
    probability p); its update counts only where the mask is 1."""

    masks: dict[str, torch.Tensor]  # 0/1, the full shapes
    capacity: float

    def key(self) -> tuple:
        return (id(self),)  # every client's mask is its own

    def to(self, device: torch.device) -> CoordinateMask:
        return CoordinateMask({n: m.to(device) for n, m in self.masks.items()}, self.capacity)

    def extract(self, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: p.clone() for n, p in dense.items()}

    def add(self, dense: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
        for n, p in dense.items():
            p.add_(values[n].to(p.dtype) * self.masks[n].to(p.dtype))

    def add_constant(self, dense: dict[str, torch.Tensor], value: float | torch.Tensor) -> None:
        for n, p in dense.items():
            p.add_(self.masks[n].to(p.dtype) * torch.as_tensor(value, dtype=p.dtype))


SubmodelSlice = ChannelSlice | CoordinateMask


def full_slice(slicing: Slicing) -> ChannelSlice:
    return ChannelSlice(slicing, {g: torch.arange(c) for g, c in slicing.groups.items()}, 1.0)


def check_slicing(slicing: Slicing, dense: dict[str, torch.Tensor]) -> None:
    """Every parameter is described, and each sliced axis has its group's channel count."""
    missing = set(dense) ^ set(slicing.axes)
    if missing:
        raise ValueError(f"slicing and parameters disagree on {sorted(missing)}")
    for name, p in dense.items():
        for group, size in zip(slicing.axes[name], p.shape, strict=True):
            if group is not None and slicing.groups[group] != size:
                raise ValueError(
                    f"{name}: an axis of group {group!r} has {size} entries, "
                    f"the group has {slicing.groups[group]} channels"
                )
