"""A model: logistic regression with one learned weight per id (its table rows are 1 wide)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fedsub.data.federated import FederatedDataset
from fedsub.models.base import Features, Ids, Task
from fedsub.models.inputs import Reads
from fedsub.models.pooling import sum_pool
from fedsub.models.registry import ModelSpec
from fedsub.submodel.params import Params


@dataclass(frozen=True)
class IdBiasOptions:
    # standard deviation of the initial id weights (0: zeros)
    init_std: float = field(default=0.0, metadata={"min": 0.0})


@dataclass(frozen=True)
class IdBiasLR:
    """logit = bias + the sum, over a sample's ids in every field, of each id's weight."""

    table_rows: dict[str, int]
    field_tables: dict[str, str]
    init_std: float = 0.0
    task: Task = "binary"

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        tables = {
            t: torch.randn(rows, 1, generator=generator, dtype=dtype) * self.init_std
            for t, rows in self.table_rows.items()
        }
        return Params(tables, {"bias": torch.zeros(1, dtype=dtype)})

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features:
        pooled = [
            sum_pool(tables[self.field_tables.get(f, f)], values, offsets)
            for f, (values, offsets) in ids.items()
        ]
        return {"score": torch.cat(pooled, dim=-1).sum(-1)}

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        return features["score"] + dense["bias"]

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs, labels)


def build(dataset: FederatedDataset, options: IdBiasOptions) -> IdBiasLR:
    return IdBiasLR(dict(dataset.table_rows), dict(dataset.field_tables), options.init_std)


SPEC = ModelSpec(
    name="id-bias-lr",
    description="logistic regression with one weight per id (example plugin)",
    build=build,
    model_class=IdBiasLR,
    reads=Reads(min_fields=1, dense="none"),
    options=IdBiasOptions,
)
