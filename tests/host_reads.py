"""Counting a round's host synchronisations on the CPU, where none of them costs anything.

On a GPU, reading a device tensor's value on the host (``.item()``, ``.tolist()``,
``bool(t)``, ``float(t)``, ``int(t)``, ``.numpy()``, ``.cpu()``) waits for every queued kernel,
and so does an op whose output *shape* depends on the values (``torch.unique``,
``nonzero``, boolean masks, ``repeat_interleave`` without ``output_size``). ``HostReads`` is a
``TorchFunctionMode`` that counts both kinds of call, so a CPU test can prove how often a
round would stop a GPU (the torch kernels, ``fedsub.device.CPU_FAST_PATHS = False``).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that hand a value to Python.
READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__float__: "float",
    torch.Tensor.__int__: "int",
    torch.Tensor.__index__: "index",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.cpu: "cpu",
}
# Ops whose output size depends on the values (the device must finish to allocate it).
VALUE_SHAPED = {
    torch.unique: "unique",
    torch._unique2: "unique",
    torch.unique_consecutive: "unique_consecutive",
    torch.nonzero: "nonzero",
    torch.Tensor.nonzero: "nonzero",
    torch.masked_select: "masked_select",
    torch.Tensor.masked_select: "masked_select",
}


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads: ...``; ``reads.counts`` by kind, ``reads.total``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = READS.get(func) or VALUE_SHAPED.get(func)
        if kind is None and func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
                kind = "repeat_interleave without output_size"
        if kind is None and func is torch.Tensor.__getitem__:
            index = args[1] if len(args) > 1 else None
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                kind = "boolean mask"
        if kind is not None:
            self.counts[kind] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
