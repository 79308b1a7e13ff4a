"""How and where a run executes: the ``[execution]`` section as the engine reads it.

None of these settings changes what a round computes (up to float rounding, and not at all
with ``deterministic``); they choose the dtype, the device, the backend, where the embedding
tables live and how the batched step is captured."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64}
TablePlacement = Literal["device", "host"]  # execution.table_placement (engine/placement.py)
TableSharding = Literal["none", "rows"]  # execution.table_sharding (fedsub/sharding)


@dataclass(frozen=True)
class Compile:
    """How ``torch.compile`` captures the step: its ``backend`` and ``mode`` (``execution.compile =
    "on"`` gives ``for_device``'s; tests use the cheap ``"eager"`` / ``"aot_eager"``)."""

    backend: str | Callable[..., Any] = "inductor"  # a torch.compile backend
    mode: str | None = None

    @staticmethod
    def for_device(device: torch.device) -> Compile:
        """Inductor; on CUDA with ``reduce-overhead`` (the step replayed as a CUDA graph)."""
        return Compile("inductor", "reduce-overhead" if device.type == "cuda" else None)


@dataclass(frozen=True)
class CudaGraphs:
    """``execution.compile = "cuda-graphs"``: the round's local steps captured with
    ``torch.cuda.graph``, no compiler (engine/cuda_graphs.py). ``capture`` replaces the capture
    (tests on the CPU pass ``cuda_graphs.capture_eagerly``); None: ``torch.cuda.graph``."""

    capture: Callable[..., Any] | None = None


@dataclass(frozen=True)
class Execution:
    """The ``[execution]`` section, resolved: torch types instead of names, this process's
    device (``runs/run_setup.py``'s ``schedule_of`` builds it)."""

    dtype: torch.dtype = torch.float32
    # where the model, the server state and the training data live (execution.device)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "batched"  # a name in engine/backends.py's registry
    # execution.deterministic: fixed-order scatter-adds (numerics/segment_sum.py): repeatable
    deterministic: bool = False
    # execution.table_placement: "host" keeps the tables in host memory (engine/placement.py)
    table_placement: TablePlacement = "device"
    # execution.table_sharding: "rows" spreads the tables' rows over torchrun's processes
    table_sharding: TableSharding = "none"
    # execution.compile: how the batched local steps are captured (None: eager ops): by
    # torch.compile, or as one CUDA graph per round (no compiler)
    compile: Compile | CudaGraphs | None = None
