"""Multinomial logistic regression on dense features (seed 004's model): ``softmax(x W + b)``
with cross-entropy. No embedding tables: every client trains the whole (small) model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedsub.models.base import Features, Ids, Task
from fedsub.submodel.params import Params


@dataclass(frozen=True)
class SoftmaxRegression:
    dense_dim: int
    classes: int
    task: Task = "multiclass"

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        # w_0 = 0, as in Li et al.
        return Params(
            {},
            {
                "weight": torch.zeros(self.dense_dim, self.classes, dtype=dtype),
                "bias": torch.zeros(self.classes, dtype=dtype),
            },
        )

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features:
        return {}

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        if dense_inputs is None:
            raise ValueError("softmax regression needs dense features")
        return dense_inputs @ dense["weight"] + dense["bias"]

    def cohort_head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """``head`` for K clients at once: dense [K, ...], inputs [K, B, d] -> [K, B, classes]."""
        if dense_inputs is None:
            raise ValueError("softmax regression needs dense features")
        return torch.bmm(dense_inputs, dense["weight"]) + dense["bias"].unsqueeze(1)

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, labels.long())
