"""Least-squares linear regression on dense features, ``x . w``, loss ``(x . w - y)^2 / 2``
averaged over the batch. Seed 004's Theorem 4 counterexample (appendix C) is a distributed
ridge regression of this form (``li-quadratic``; the ridge term is ``train.weight_decay``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedsub.models.base import Features, Ids, Task
from fedsub.submodel.params import Params


@dataclass(frozen=True)
class LinearRegression:
    dense_dim: int
    task: Task = "regression"

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        # w_0 = 0, as in Li et al.
        return Params({}, {"weight": torch.zeros(self.dense_dim, dtype=dtype)})

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features:
        return {}

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        if dense_inputs is None:
            raise ValueError("linear regression needs dense features")
        return dense_inputs @ dense["weight"]

    def cohort_head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """``head`` for K clients at once: weight [K, d], inputs [K, B, d] -> [K, B]."""
        if dense_inputs is None:
            raise ValueError("linear regression needs dense features")
        return torch.bmm(dense_inputs, dense["weight"].unsqueeze(2)).squeeze(2)

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((outputs - labels) ** 2).mean()
