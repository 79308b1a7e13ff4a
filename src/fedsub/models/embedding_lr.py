"""Logistic regression on pooled embeddings: per table, the sum of the sample's embedding rows
(dimension d), concatenated and fed to a linear head. The smallest model with wide embedding
rows: the shape of the FedSubAvg papers' embedding layers without the MLP."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fedsub.models.base import Features, Ids, Task
from fedsub.models.pooling import sum_pool
from fedsub.submodel.params import Params


@dataclass(frozen=True)
class EmbeddingLogisticRegression:
    table_rows: dict[str, int]
    embedding_dim: int = 16
    init_std: float = 0.01
    fields: tuple[str, ...] = ()  # the sample fields, each pooled separately (default: tables)
    field_tables: dict[str, str] = field(default_factory=dict)  # field -> table, if not same
    task: Task = "binary"

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        tables = {
            t: torch.randn(rows, self.embedding_dim, generator=generator, dtype=dtype).mul_(
                self.init_std
            )
            for t, rows in self.table_rows.items()
        }
        width = self.embedding_dim * len(self.fields or self.table_rows)
        head = torch.randn(width, generator=generator, dtype=dtype) * self.init_std
        return Params(tables, {"weight": head, "bias": torch.zeros(1, dtype=dtype)})

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features:
        bags = [
            sum_pool(tables[self.field_tables.get(f, f)], values, offsets)
            for f, (values, offsets) in ids.items()
        ]
        return {"pooled": torch.cat(bags, dim=-1)}

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        return features["pooled"] @ dense["weight"] + dense["bias"]

    def cohort_head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """``head`` for K clients at once: dense [K, ...], features [K, B, ...] -> [K, B]."""
        return torch.einsum("kbw,kw->kb", features["pooled"], dense["weight"]) + dense["bias"]

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs, labels)
