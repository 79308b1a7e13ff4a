"""A 2-layer LSTM text classifier (seed 001's Sent140 model): word embeddings (25) ->
LSTM(100) -> LSTM(100) -> the last real token's hidden state -> a logit.

The embedding rows of a client's vocabulary are its submodel. Written once for a cohort
(weights with a leading client axis, ``cohort_ops.linear``); padding past a tweet's length
leaves the state unchanged, so padding to a longer cohort-wide length changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from fedsub.models.base import Features, Ids, Task
from fedsub.models.cohort_ops import linear, single_client
from fedsub.models.pooling import padded
from fedsub.submodel.params import Params


@dataclass(frozen=True)
class LSTMClassifier:
    capturable: ClassVar[bool] = False  # pads to the longest sentence (train.compile)
    table_rows: dict[str, int]
    embedding_dim: int = 25
    hidden: int = 100
    layers: int = 2
    init_std: float = 0.1
    task: Task = "binary"

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        def uniform(*shape: int, bound: float) -> torch.Tensor:
            return (torch.rand(*shape, generator=generator, dtype=dtype) * 2 - 1) * bound

        ((table, rows),) = self.table_rows.items()
        tables = {
            table: torch.randn(rows, self.embedding_dim, generator=generator, dtype=dtype)
            * self.init_std
        }
        bound = self.hidden**-0.5
        dense = {}
        for layer in range(self.layers):
            width = self.embedding_dim if layer == 0 else self.hidden
            dense[f"lstm{layer}.input"] = uniform(width, 4 * self.hidden, bound=bound)
            dense[f"lstm{layer}.recurrent"] = uniform(self.hidden, 4 * self.hidden, bound=bound)
            dense[f"lstm{layer}.bias"] = torch.zeros(4 * self.hidden, dtype=dtype)
        dense["out.weight"] = uniform(self.hidden, 1, bound=bound)
        dense["out.bias"] = torch.zeros(1, dtype=dtype)
        return Params(tables, dense)

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features:
        (table,) = tables
        (field_ids,) = ids.values()
        words, mask = padded(tables[table], *field_ids)
        return {"words": words, "mask": mask}

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        return single_client(self.cohort_head, dense, features)

    def cohort_head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """dense [K, ...], words [K, B, L, e], mask [K, B, L] -> logits [K, B]."""
        x, mask = features["words"], features["mask"]
        k, b, steps = mask.shape
        for layer in range(self.layers):
            w_in, w_rec = dense[f"lstm{layer}.input"], dense[f"lstm{layer}.recurrent"]
            bias = dense[f"lstm{layer}.bias"]
            projected = linear(x, w_in, bias)  # [K, B, L, 4h] for all steps at once
            h = x.new_zeros((k, b, self.hidden))
            c = x.new_zeros((k, b, self.hidden))
            outputs = []
            for t in range(steps):
                gates = projected[:, :, t] + torch.bmm(h, w_rec)
                i, f, g, o = gates.chunk(4, dim=-1)
                c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h_new = torch.sigmoid(o) * torch.tanh(c_new)
                live = mask[:, :, t].unsqueeze(-1)
                c, h = torch.where(live, c_new, c), torch.where(live, h_new, h)
                outputs.append(h)
            x = torch.stack(outputs, dim=2)
        return linear(h, dense["out.weight"], dense["out.bias"]).squeeze(-1)

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs, labels)
