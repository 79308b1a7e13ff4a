"""Where a run's tensors live: ``execution.device`` ("cpu", "cuda", "cuda:N" or "auto").

A leaf module: the config validates the key with ``resolve_device`` and the engine places the
model, the server state and the training data on the resolved ``torch.device``.
"""

from __future__ import annotations

import re

import numpy as np
import torch

DEVICE_FORMS = ('"cpu"', '"cuda"', '"cuda:N"', '"auto"')
_CUDA = re.compile(r"cuda(:(\d+))?")


def resolve_device(name: str) -> torch.device:
    """The ``torch.device`` a ``execution.device`` value names; ``"auto"`` is the first GPU when
    one is available, else the CPU. Raises ValueError for an unknown form or a GPU this
    machine does not have, saying what is allowed."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    match = _CUDA.fullmatch(name)
    if match is None:
        raise ValueError(f"expected one of {', '.join(DEVICE_FORMS)}")
    if not torch.cuda.is_available():
        raise ValueError(
            'this machine has no CUDA GPU (or torch was built without CUDA); use "cpu" or "auto"'
        )
    ordinal = int(match.group(2) or 0)
    if ordinal >= torch.cuda.device_count():
        raise ValueError(
            f"this machine has {torch.cuda.device_count()} CUDA device(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    return torch.device("cuda", ordinal)


# Some round kernels have a numpy twin for CPU tensors (shuffle, ragged take, sparse LR's
# closed form, RowUnion), faster there because torch's per-op cost dominates small arrays.
# Tests set this to False to run the device-generic torch kernels on the CPU end to end.
CPU_FAST_PATHS = True


def on_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s round kernels take their CPU (numpy) fast path."""
    return CPU_FAST_PATHS and tensor.device.type == "cpu"


def from_host(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host numbers (a round's cohort ids, multiplicities, learning rates) as a tensor on
    ``device`` without a host sync: a plain copy from pageable memory waits for every kernel
    queued on the GPU, one from pinned memory with ``non_blocking`` does not (the caching
    host allocator keeps the buffer alive until the copy is done). Zero-copy on the CPU."""
    tensor = torch.from_numpy(values)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
