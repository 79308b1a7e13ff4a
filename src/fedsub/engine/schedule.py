"""The training schedule shared by every algorithm of a comparison."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from fedsub.dp.settings import DpSettings
from fedsub.masking.schemes import Masking
from fedsub.privacy.levels import Privacy

DTYPES = {"float32": torch.float32, "float64": torch.float64}
LrSchedule = Literal["constant", "inverse-round", "inverse-time", "exponential"]
TablePlacement = Literal["device", "host"]  # execution.table_placement (engine/placement.py)
TableSharding = Literal["none", "rows"]  # execution.table_sharding (fedsub/sharding)
Sampling = Literal["fixed", "poisson"]  # train.sampling


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
class Schedule:
    rounds: int
    clients_per_round: int
    local_steps: int
    batch_size: int
    lr: float
    seed: int
    dtype: torch.dtype = torch.float32
    # where the model, the server state and the training data live (execution.device)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    eval_every: int = 1
    backend: str = "batched"  # a name in engine/backends.py's registry
    lr_schedule: LrSchedule = "constant"
    lr_decay: float = 0.999
    weight_decay: float = 0.0
    clip_norm: float = 0.0
    momentum: float = 0.0
    masking: Masking | None = None  # width-sliced sub-model training (seed 003)
    privacy: Privacy | None = None  # privacy.level (engine/private_rounds.py); None: none
    # execution.deterministic: fixed-order scatter-adds (numerics/segment_sum.py): repeatable
    deterministic: bool = False
    # execution.table_placement: "host" keeps the tables in host memory (engine/placement.py)
    table_placement: TablePlacement = "device"
    # execution.table_sharding: "rows" spreads the tables' rows over torchrun's processes
    table_sharding: TableSharding = "none"
    # execution.compile: how torch.compile captures the batched local step (None: eager ops)
    compile: Compile | None = None
    # train.sampling: "poisson" draws each client with probability K / N (algorithms/sampling.py)
    sampling: Sampling = "fixed"
    # [dp]: user-level differential privacy (fedsub/dp); None: mechanism "none"
    dp: DpSettings | None = None


def lr_at(base: float, schedule: Schedule, round_index: int) -> float:
    """The client learning rate of round ``round_index`` (1-based), constant inside a round.

    ``inverse-round``: base / (1 + t) with t = round_index - 1 (seed 004);
    ``inverse-time``: base / (1 + lr_decay * t) (seed 004's appendix C.2 anneals
    (1/5) / (5 + t a) = (1/25) / (1 + t a / 5): base 0.04, lr_decay a / 5);
    ``exponential``: base * lr_decay^t (the FedSubAvg authors' x0.999 per round)."""
    t = round_index - 1
    if schedule.lr_schedule == "constant":
        return base
    if schedule.lr_schedule == "inverse-round":
        return base / (1 + t)
    if schedule.lr_schedule == "inverse-time":
        return base / (1 + schedule.lr_decay * t)
    if schedule.lr_schedule == "exponential":
        return base * schedule.lr_decay**t
    raise ValueError(f"unknown lr schedule {schedule.lr_schedule!r}")
