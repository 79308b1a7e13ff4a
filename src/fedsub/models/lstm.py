"""A 2-layer LSTM text classifier (seed 001's Sent140 model): word embeddings (25) ->
LSTM(100) -> LSTM(100) -> the last real token's hidden state -> a logit.

The embedding rows of a client's vocabulary are its submodel. The head is written twice:
``head`` (one client, what the sequential backend runs) is the reference, the cell op by op
under autograd on sequences padded to the longest, padding leaving the state unchanged;
``cohort_head`` (K clients, the batched backend) runs the same function on packed sequences
with a hand-written backward (models/packed_lstm.py): each time step computes only the
sequences still running. tests/test_sent140_lstm.py checks the two agree, values and
gradients, in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from fedsub import device as device_lib
from fedsub.models.base import Features, Ids, Task
from fedsub.models.cohort_ops import linear, single_client
from fedsub.models.packed_lstm import PackedPlan, PackedRecurrence
from fedsub.models.pooling import padded
from fedsub.submodel.params import Params


@dataclass(frozen=True)
class LSTMClassifier:
    # the packing follows the tweets' lengths (execution.compile)
    capturable: ClassVar[bool] = False
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
            table: torch.randn(rows, self.embedding_dim, generator=generator, dtype=dtype).mul_(
                self.init_std
            )
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
        """words [n, L, e] (padded to the longest), mask [n, L], and the lengths [n] as a
        host tensor: the step's one device read (the packing is planned on the host)."""
        (table,) = tables
        ((values, offsets),) = ids.values()
        lengths = torch.diff(offsets).tolist()
        words, mask = padded(tables[table], values, offsets, max(lengths, default=0))
        return {"words": words, "mask": mask, "lengths": torch.tensor(lengths, dtype=torch.int64)}

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """One client, the reference form: padded, every op under autograd."""
        return single_client(self.padded_cohort_head, dense, features)

    def padded_cohort_head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """dense [K, ...], words [K, B, L, e], mask [K, B, L] -> logits [K, B]: every sequence
        runs all L steps, a masked step leaving the state unchanged."""
        x, mask = features["words"], features["mask"]
        k, b, steps = mask.shape
        h = x.new_zeros((k, b, self.hidden))
        for layer in range(self.layers):
            w_in, w_rec = dense[f"lstm{layer}.input"], dense[f"lstm{layer}.recurrent"]
            bias = dense[f"lstm{layer}.bias"]
            projected = linear(x, w_in, bias).unbind(2)  # [K, B, 4h] per step, computed at once
            h = x.new_zeros((k, b, self.hidden))
            c = x.new_zeros((k, b, self.hidden))
            outputs = []
            for t in range(steps):
                gates = projected[t] + torch.bmm(h, w_rec)
                i, f, g, o = gates.chunk(4, dim=-1)
                c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h_new = torch.sigmoid(o) * torch.tanh(c_new)
                live = mask[:, :, t].unsqueeze(-1)
                c, h = torch.where(live, c_new, c), torch.where(live, h_new, h)
                outputs.append(h)
            x = torch.stack(outputs, dim=2)
        return linear(h, dense["out.weight"], dense["out.bias"]).squeeze(-1)

    def cohort_head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """dense [K, ...], words [K, B, L, e], lengths [K, B] (host) -> logits [K, B], on
        packed sequences: each client's sequences sorted by length, time-major."""
        words = features["words"]
        k, b, longest, width = words.shape
        lengths = features["lengths"].numpy()  # a host tensor: no device read
        plan = PackedPlan.of(lengths)
        device = words.device
        client_start = np.arange(k, dtype=np.int64)[:, None] * b
        sorted_rows = device_lib.from_host((plan.order + client_start).reshape(-1), device)
        x = words.reshape(k * b, longest, width).index_select(0, sorted_rows)
        x = x.reshape(k, b, longest, width)[:, :, : plan.steps].transpose(1, 2)  # [K, T, B, e]
        hs = x.new_zeros((k, 1, b, self.hidden))
        for layer in range(self.layers):
            w_in, w_rec = dense[f"lstm{layer}.input"], dense[f"lstm{layer}.recurrent"]
            projected = linear(x, w_in, dense[f"lstm{layer}.bias"])  # [K, T, B, 4h]
            hs = PackedRecurrence.apply(projected, w_rec, plan)  # [K, T + 1, B, h]
            x = hs[:, 1:]
        # each sequence's state after its last step (hs[:, 0] = 0 for an empty one), in the
        # original order: client k's row j is its sorted row position[k, j]
        position = np.argsort(plan.order, axis=1)
        last = client_start * (plan.steps + 1) + lengths * b + position
        flat = hs.reshape(-1, self.hidden)
        h = flat.index_select(0, device_lib.from_host(last.reshape(-1), device))
        return linear(h.reshape(k, b, -1), dense["out.weight"], dense["out.bias"]).squeeze(-1)

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs, labels)
