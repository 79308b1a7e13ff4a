"""The training schedule shared by every algorithm of a comparison."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64}
Backend = Literal["batched", "sequential"]


@dataclass(frozen=True)
class Schedule:
    rounds: int
    clients_per_round: int
    local_steps: int
    batch_size: int
    lr: float
    seed: int
    dtype: torch.dtype = torch.float32
    eval_every: int = 1
    backend: Backend = "batched"
