"""DIN (Deep Interest Network) as the FedSubAvg authors deployed it for Amazon CTR.

Fields ``user`` (user table), ``item`` (the target) and ``history`` (clicked items, ragged;
both in the item table), embeddings of dimension 18 by default. Attention: an MLP on
``[q, k, q - k, q * k]`` (q the target, k each history item) -> 80 -> 40 -> 1 with sigmoid
activations, a softmax over each sample's history. Output MLP on
``[user, item, sum(history), item * sum(history), attention output]`` -> 200 (Dice) ->
80 (Dice) -> 2; the logit is the difference of the two outputs (a 2-way softmax is a sigmoid
of it). Dice normalises with the statistics of the batch it sees, as the authors' ``Dice.py``
does in training and evaluation alike: a client's local batch in training, and a test batch of
``eval_batch`` = 1,024 samples (their ``test_batch_size``) in evaluation, so a test sample's
score depends only on the fixed batch of 1,024 it falls in.

The history is packed, not padded (``PackedFeatures``): the attention MLP runs on the real
history items only, O(sum of the lengths) rather than O(B x the longest), with each client's
weights through ``packed.ClientBlocks`` (``packed.ClientGroups`` on the CPU in float32), and
the softmax and sums are per-sample segment operations (``pooling.attention_pool``,
``segment_sum.run_sums``). Its first layer is regrouped by linearity, ``[q, k, q - k, q * k]
@ W = [k, q * k] @ [W_k - W_d; W_p] + q @ (W_q + W_d)``: 36 inputs per history item instead
of 72, and the query's part once per sample. Every shape comes from the host (the number of
history rows), so a step reads nothing back from the device. In the batched engine the output
MLP's weights see one row per sample (``LowRankWeights``): under a scaling-only client rule
they stay the global weight plus each client's low-rank change over the round
(models/low_rank.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import ClassVar

import torch
import torch.nn.functional as F

from fedsub.models.base import Features, Ids, Task
from fedsub.models.cohort_ops import linear, single_client
from fedsub.models.packed import client_rows
from fedsub.models.pooling import attention_pool, sum_pool
from fedsub.numerics import segment_sum
from fedsub.submodel.params import Params

ATTENTION = (80, 40, 1)
HIDDEN = (200, 80, 2)
ROWS_PER_PASS = 16_384  # history rows the attention MLP scores at once for one client
DICE_EPS = 1e-9  # the authors' Dice.py epsilon
TEST_BATCH = 1_024  # the authors' test_batch_size


def dice(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Dice activation as the authors' ``Dice.py``: a data-dependent PReLU gated by the input
    normalised with its client's batch statistics (x is [K, B, units]):
    p = sigmoid((x - mean) / (sqrt(var + eps) + eps)), out = p x + (1 - p) alpha x."""
    centred = x - x.mean(1, keepdim=True)
    var = centred.pow(2).mean(1, keepdim=True)  # (torch.var is slow on CPU for this shape)
    gate = torch.sigmoid(centred / (torch.sqrt(var + DICE_EPS) + DICE_EPS))
    # gate * x + (1 - gate) * alpha * x, with the [K, 1, units] factor (1 - alpha) formed once
    return x * (alpha + gate * (1 - alpha))


@dataclass(frozen=True)
class DIN:
    # the history's rows, packed sample after sample (models/base.py: PackedFeatures)
    packed_features: ClassVar[frozenset[str]] = frozenset({"history"})
    # the output MLP's weights: one row per sample (models/low_rank.py)
    low_rank_weights: ClassVar[frozenset[str]] = frozenset(
        f"fc{i}.weight" for i in range(len(HIDDEN))
    )
    table_rows: dict[str, int]
    embedding_dim: int = 18
    init_std: float = 0.01
    task: Task = "binary"
    eval_batch: int = TEST_BATCH  # evaluation batches (Dice uses each batch's statistics)

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        d = self.embedding_dim

        def normal(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=generator, dtype=dtype).mul_(std)

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
        """Per sample: ``user``, ``item``, ``history_sum`` [n, d] and ``history_lengths`` [n];
        packed: ``history`` [T, d], the history rows sample after sample."""
        values, offsets = ids["history"]
        lengths = torch.diff(offsets)
        history = tables["item"].index_select(0, values)
        return {
            "user": sum_pool(tables["user"], *ids["user"]),
            "item": sum_pool(tables["item"], *ids["item"]),
            "history_sum": segment_sum.run_sums(history, lengths),
            "history_lengths": lengths,
            "history": history,
        }

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """One client: the cohort computation with a cohort of one."""
        return single_client(self.cohort_head, dense, features, packed=self.packed_features)

    def cohort_head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        """K clients at once: dense [K, ...], per-sample features [K, B, ...], the packed
        history [T, d] -> logits [K, B]."""
        item, pooled = features["item"], features["history_sum"]
        attended = self.attention(dense, item, features["history_lengths"], features["history"])
        x = torch.cat([features["user"], item, pooled, item * pooled, attended], dim=-1)
        for i in range(len(HIDDEN)):
            x = linear(x, dense[f"fc{i}.weight"], dense[f"fc{i}.bias"])
            if i < len(HIDDEN) - 1:
                x = dice(x, dense[f"fc{i}.alpha"].unsqueeze(1))
        return x[..., 1] - x[..., 0]

    def attention(
        self,
        dense: dict[str, torch.Tensor],
        item: torch.Tensor,
        lengths: torch.Tensor,
        history: torch.Tensor,
    ) -> torch.Tensor:
        """[K, B, d]: each sample's history averaged with the attention MLP's softmax
        weights (its target ``item`` [K, B, d] the query; ``lengths`` [K, B]; ``history``
        [T, d] packed)."""
        k, b, d = item.shape
        total = history.shape[0]
        if total == 0:  # no sample of the batch has a history: nothing to attend to, but
            # the attention weights stay in the graph (with zero gradients), as autograd is
            # asked for every parameter's gradient
            unused = sum(
                dense[f"att{i}.{p}"].sum()
                for i in range(len(ATTENTION))
                for p in ("weight", "bias")
            )
            return item.new_zeros(k, b, d) + 0 * unused
        samples = k * b
        flat_lengths = lengths.reshape(samples)
        sample = torch.repeat_interleave(
            torch.arange(samples, device=item.device), flat_lengths, output_size=total
        )
        blocks = client_rows(lengths.sum(1), history)
        queries = item.reshape(samples, d)
        weight = dense["att0.weight"]
        w_query, w_key, w_difference, w_product = weight.split(d, dim=1)
        per_row = torch.cat([w_key - w_difference, w_product], dim=1)
        # the query's part of the first layer is one per sample, added to each of its rows
        per_sample = linear(item, w_query + w_difference, dense["att0.bias"])
        per_sample = per_sample.reshape(samples, -1)
        # one client (evaluation, CentralSGD, the sequential backend) may bring a whole test
        # set's rows: scored a piece at a time, so the MLP's activations stay cache-sized
        # (a cohort's blocks are laid out over all its rows: one piece)
        piece = total if blocks.clients > 1 else ROWS_PER_PASS
        scores = []
        for start in range(0, total, piece):
            rows = blocks.to_slots(history[start : start + piece])
            owner = blocks.to_slots(sample[start : start + piece])
            query = queries.index_select(0, owner)
            x = blocks.linear(
                torch.cat([rows, query * rows], dim=-1),
                per_row,
                per_slot=per_sample.index_select(0, owner),
            )
            for i in range(1, len(ATTENTION)):
                x = blocks.linear(torch.sigmoid(x), dense[f"att{i}.weight"], dense[f"att{i}.bias"])
            scores.append(blocks.from_slots(x).squeeze(-1))
        scores_all = scores[0] if len(scores) == 1 else torch.cat(scores)
        return attention_pool(history, scores_all, flat_lengths, sample).reshape(k, b, d)

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs, labels)
