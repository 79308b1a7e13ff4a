"""DIN (Deep Interest Network) as the FedSubAvg authors deployed it for Amazon CTR.

Fields ``user`` (user table), ``item`` (the target) and ``history`` (clicked items, ragged;
both in the item table), embeddings of dimension 18 by default. Attention: an MLP on
``[q, k, q - k, q * k]`` (q the target, k each history item) -> 80 -> 40 -> 1 with sigmoid
activations, padding masked before the softmax. Output MLP on
``[user, item, sum(history), item * sum(history), attention output]`` -> 200 (Dice) ->
80 (Dice) -> 2; the logit is the difference of the two outputs (a 2-way softmax is a sigmoid
of it). Dice normalises with the statistics of the batch it sees (a client's local batch;
an evaluation chunk at test time).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import ClassVar

import torch
import torch.nn.functional as F

from fedsub.models.base import Features, Ids, Task
from fedsub.models.cohort_ops import linear, single_client
from fedsub.models.pooling import padded, sum_pool
from fedsub.submodel.params import Params

ATTENTION = (80, 40, 1)
HIDDEN = (200, 80, 2)


def dice(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Dice activation: a data-dependent PReLU gated by the input normalised with its
    client's batch statistics (x is [K, B, units])."""
    centred = x - x.mean(1, keepdim=True)
    var = centred.pow(2).mean(1, keepdim=True)  # (torch.var is slow on CPU for this shape)
    gate = torch.sigmoid(centred / torch.sqrt(var + 1e-8))
    return gate * x + (1 - gate) * alpha * x


@dataclass(frozen=True)
class DIN:
    capturable: ClassVar[bool] = False  # pads to the longest history (train.compile)
    table_rows: dict[str, int]
    embedding_dim: int = 18
    init_std: float = 0.01
    task: Task = "binary"

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        d = self.embedding_dim

        def normal(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=generator, dtype=dtype) * std

        tables = {t: normal(rows, d, std=self.init_std) for t, rows in self.table_rows.items()}
        dense: dict[str, torch.Tensor] = {}
        widths = (4 * d, *ATTENTION)
        for i, (a, b) in enumerate(pairwise(widths)):
            dense[f"att{i}.weight"] = normal(a, b, std=(1 / a) ** 0.5)
            dense[f"att{i}.bias"] = torch.zeros(b, dtype=dtype)
        widths = (5 * d, *HIDDEN)
        for i, (a, b) in enumerate(pairwise(widths)):
            dense[f"fc{i}.weight"] = normal(a, b, std=(1 / a) ** 0.5)
            dense[f"fc{i}.bias"] = torch.zeros(b, dtype=dtype)
            if i < len(HIDDEN) - 1:
                dense[f"fc{i}.alpha"] = torch.zeros(b, dtype=dtype)
        return Params(tables, dense)

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features:
        history, mask = padded(tables["item"], *ids["history"])
        return {
            "user": sum_pool(tables["user"], *ids["user"]),
            "item": sum_pool(tables["item"], *ids["item"]),
            "history": history,
            "mask": mask,
        }

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """One client: the cohort computation with a cohort of one."""
        return single_client(self.cohort_head, dense, features)

    def cohort_head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """K clients at once: dense [K, ...], features [K, B, ...] -> logits [K, B]."""
        item, history, mask = features["item"], features["history"], features["mask"]
        query = item.unsqueeze(2).expand_as(history)
        x = torch.cat([query, history, query - history, query * history], dim=-1)
        for i in range(len(ATTENTION)):
            x = linear(x, dense[f"att{i}.weight"], dense[f"att{i}.bias"])
            if i < len(ATTENTION) - 1:
                x = torch.sigmoid(x)
        scores = x.squeeze(-1).masked_fill(~mask, -1e9)
        weights = torch.softmax(scores, dim=-1) * mask  # an empty history attends to nothing
        attended = (weights.unsqueeze(-1) * history).sum(2)
        pooled = (history * mask.unsqueeze(-1)).sum(2)
        x = torch.cat([features["user"], item, pooled, item * pooled, attended], dim=-1)
        for i in range(len(HIDDEN)):
            x = linear(x, dense[f"fc{i}.weight"], dense[f"fc{i}.bias"])
            if i < len(HIDDEN) - 1:
                x = dice(x, dense[f"fc{i}.alpha"].unsqueeze(1))
        return x[..., 1] - x[..., 0]

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs, labels)
