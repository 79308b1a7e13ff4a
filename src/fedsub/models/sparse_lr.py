"""Sparse logistic regression: the logit is the sum of the sample's feature weights plus a bias.

Every embedding table has dimension 1 (one weight per categorical value or crossed pair);
optional dense features get a weight vector. Loss: binary cross-entropy on the logit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedsub.models.base import Batch, Task
from fedsub.submodel.params import Params


@dataclass(frozen=True)
class SparseLogisticRegression:
    table_rows: dict[str, int]
    dense_dim: int = 0
    init_std: float = 0.0
    task: Task = "binary"

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        tables = {
            t: torch.randn(rows, 1, generator=generator, dtype=dtype) * self.init_std
            for t, rows in self.table_rows.items()
        }
        dense = {"bias": torch.zeros(1, dtype=dtype)}
        if self.dense_dim:
            dense["dense_weight"] = torch.zeros(self.dense_dim, dtype=dtype)
        return Params(tables, dense)

    def forward(self, params: Params, batch: Batch) -> torch.Tensor:
        logits = params.dense["bias"].expand(len(batch.labels))
        for table, (values, offsets) in batch.ids.items():
            bag = F.embedding_bag(
                values, params.tables[table], offsets, mode="sum", include_last_offset=True
            )
            logits = logits + bag[:, 0]
        if self.dense_dim and batch.dense is not None:
            logits = logits + batch.dense @ params.dense["dense_weight"]
        return logits

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs, labels)
