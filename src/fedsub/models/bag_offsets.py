"""Both of torch's ``nn.EmbeddingBag`` offset conventions, on fedsub's one ``offsets``.

fedsub hands a module's forward each field as ``(values, offsets)`` with ``n + 1`` offsets
(CSR: bag i is ``values[offsets[i]:offsets[i + 1]]``), what a bag built with
``include_last_offset=True`` reads. A bag built with torch's default (``False``) reads the
``n`` bag starts, and given ``n + 1`` it returns ``n + 1`` bags. So a PyTorch user's first
model, ``bag(values, offsets)`` on a default bag, works as written: a hook on each default
bag passes it the first ``n`` of fedsub's offsets when it is given them whole (recognised
as those very tensors, so offsets the module computed itself are passed unchanged).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


class BatchOffsets:
    """fedsub's whole offsets of the batch now running (one tensor per field), for the hooks
    to recognise. Copies of a module share it (``__deepcopy__``)."""

    def __init__(self) -> None:
        self.current: tuple[torch.Tensor, ...] = ()

    def __deepcopy__(self, memo: dict) -> BatchOffsets:
        return self

    def hold(self, offsets: Iterable[torch.Tensor]) -> None:
        self.current = tuple(offsets)

    def is_whole(self, offsets: object) -> bool:
        return isinstance(offsets, torch.Tensor) and any(
            offsets is whole or same_view(offsets, whole) for whole in self.current
        )


class _StartsOnly:
    """A forward pre-hook of a default ``nn.EmbeddingBag``: fedsub's whole offsets become
    the bags' starts (``offsets[:-1]``)."""

    def __init__(self, batch: BatchOffsets) -> None:
        self.batch = batch

    def __call__(self, _m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if len(args) >= 2 and self.batch.is_whole(args[1]):
            return (args[0], args[1][:-1], *args[2:]), kwargs
        if self.batch.is_whole(kwargs.get("offsets")):
            return args, {**kwargs, "offsets": kwargs["offsets"][:-1]}
        return None


def adapt_default_bags(module: nn.Module, paths: Iterable[str], batch: BatchOffsets) -> None:
    """Hook every table module of ``module`` (``paths``) that is an ``nn.EmbeddingBag`` with
    ``include_last_offset=False`` so that fedsub's whole offsets reach it as bag starts.
    Call it on fedsub's own copies only: the user's module is never changed."""
    for path in paths:
        bag = module.get_submodule(path)
        if isinstance(bag, nn.EmbeddingBag) and not bag.include_last_offset:
            bag.register_forward_pre_hook(_StartsOnly(batch), with_kwargs=True)


def same_view(a: Any, b: torch.Tensor) -> bool:
    """``a`` is a tensor viewing exactly ``b``'s elements (same memory, start and shape)."""
    return (
        isinstance(a, torch.Tensor)
        and a.numel() > 0
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )
