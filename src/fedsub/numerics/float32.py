"""float32 means float32 on a GPU: TensorFloat-32 off while fedsub trains.

PyTorch lets cuDNN's convolutions (and RNNs) round their float32 inputs to TensorFloat-32 (a
10-bit mantissa) by default on Ampere and later GPUs. A float32 run on such a GPU then differs
from the same run on the CPU by about 1e-4 relative (seen on an H200: a CNN's first convolution
after two rounds), far beyond float32's rounding, and the backend-equivalence promise
(``execution.device`` changes where a run computes, not what) breaks. So a run sets every
TF32 switch to IEEE float32 and restores the caller's settings afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _switches() -> list[tuple[Any, str, Any]]:
    """(object, attribute, IEEE value) of every TF32 switch this torch has: the per-operator
    ``fp32_precision`` of recent releases, else the older ``allow_tf32`` flags (the two APIs
    must not be mixed: torch refuses to read the old flag after the new one was set)."""
    cudnn, cuda = torch.backends.cudnn, torch.backends.cuda
    conv, rnn = getattr(cudnn, "conv", None), getattr(cudnn, "rnn", None)
    if hasattr(conv, "fp32_precision") and hasattr(rnn, "fp32_precision"):
        return [
            (conv, "fp32_precision", "ieee"),
            (rnn, "fp32_precision", "ieee"),
            (cuda.matmul, "fp32_precision", "ieee"),
        ]
    return [(cudnn, "allow_tf32", False), (cuda.matmul, "allow_tf32", False)]


@contextmanager
def ieee_float32() -> Iterator[None]:
    """Run a block with TensorFloat-32 off; the previous settings come back afterwards."""
    switches = _switches()
    before = [getattr(owner, name) for owner, name, _ in switches]
    for owner, name, value in switches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name, _), value in zip(switches, before, strict=True):
            setattr(owner, name, value)
