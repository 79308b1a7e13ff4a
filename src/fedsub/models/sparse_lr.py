"""Sparse logistic regression: the logit is the sum of the sample's feature weights plus a bias.

Every embedding table has dimension 1 (one weight per categorical value or crossed pair);
optional dense features get a weight vector. Loss: binary cross-entropy on the logit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fedsub import device as device_lib
from fedsub.models.base import Features, Ids, Task
from fedsub.models.pooling import sum_pool
from fedsub.models.sparse_lr_closed_form import numpy_gradients, torch_gradients
from fedsub.submodel.params import Params


@dataclass(frozen=True)
class SparseLogisticRegression:
    table_rows: dict[str, int]
    dense_dim: int = 0
    init_std: float = 0.0
    field_tables: dict[str, str] = field(default_factory=dict)  # field -> table, if not same
    task: Task = "binary"

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        tables = {
            t: torch.randn(rows, 1, generator=generator, dtype=dtype).mul_(self.init_std)
            for t, rows in self.table_rows.items()
        }
        dense = {"bias": torch.zeros(1, dtype=dtype)}
        if self.dense_dim:
            dense["dense_weight"] = torch.zeros(self.dense_dim, dtype=dtype)
        return Params(tables, dense)

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features:
        """Per sample and table, the sum of its feature weights: ``bags`` [n, tables]."""
        bags = [
            sum_pool(tables[self.field_tables.get(f, f)], values, offsets)
            for f, (values, offsets) in ids.items()
        ]
        return {"bags": torch.cat(bags, dim=1)}

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        logits = features["bags"].sum(-1) + dense["bias"]
        if self.dense_dim and dense_inputs is not None:
            logits = logits + dense_inputs @ dense["dense_weight"]
        return logits

    def cohort_head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """``head`` for K clients at once: dense [K, ...], features [K, B, ...] -> [K, B]."""
        logits = features["bags"].sum(-1) + dense["bias"]
        if self.dense_dim and dense_inputs is not None:
            logits = logits + torch.einsum("kbd,kd->kb", dense_inputs, dense["dense_weight"])
        return logits

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs, labels)

    def cohort_gradients(
        self,
        tables: dict[str, torch.Tensor],
        dense: dict[str, torch.Tensor],
        ids: dict[str, torch.Tensor],
        sample_of_id: dict[str, torch.Tensor],
        dense_inputs: torch.Tensor | None,
        labels: torch.Tensor,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The gradients of the K clients' batch-mean losses (labels [K, B]) in closed form;
        ``ids[field]`` are the K * B samples' row ids, one after another, and
        ``sample_of_id[field]`` says which sample each id belongs to.

        d loss / d logit = (sigmoid(logit) - y) / B, and a logit is a sum of weights, so a
        row's gradient is the sum of that residual over its occurrences (no graph to build:
        several times faster per step on CPU than autograd). See sparse_lr_closed_form.py:
        torch ops on any device, numpy views on the CPU (where torch's per-op cost would
        dominate at a cohort's size); tests check both against autograd."""
        kernel = numpy_gradients if device_lib.on_host(labels) else torch_gradients
        return kernel(
            self.field_tables,
            self.dense_dim,
            tables,
            dense,
            ids,
            sample_of_id,
            dense_inputs,
            labels,
        )
