"""How a client turns its loss gradient into an SGD step; shared by both backends.

At every local step, with ``x0`` the pulled model::

    g = grad(batch-mean loss) + mu * (x - x0)            FedProx (mu = 0: plain SGD)
    g = g * min(1, clip_norm / (||g|| + 1e-6))           per client, when clip_norm > 0
    g = g + weight_decay * x                              as torch.optim.SGD(weight_decay)
    g = g + correction                                    SCAFFOLD's c - c_i
    b = momentum * b + g  (b = 0 at the round's start)    as torch.optim.SGD(momentum)
    x = x - lr_k * b                                      lr_k = round lr * member's lr scale
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedsub.submodel.params import Params

CLIP_EPS = 1e-6


@dataclass(frozen=True)
class LocalRule:
    lr: float
    mu: float = 0.0
    weight_decay: float = 0.0
    clip_norm: float = 0.0
    momentum: float = 0.0


@dataclass(frozen=True)
class CohortTensors:
    """One tensor set per cohort member, in the cohort layout: per table the members' rows
    concatenated (member j owns ``row_offsets[t][j]:row_offsets[t][j + 1]``); dense [K, ...]."""

    row_offsets: dict[str, np.ndarray]
    tables: dict[str, torch.Tensor]
    dense: dict[str, torch.Tensor]

    def member(self, j: int) -> Params:
        return Params(
            {
                t: v[int(self.row_offsets[t][j]) : int(self.row_offsets[t][j + 1])]
                for t, v in self.tables.items()
            },
            {n: v[j] for n, v in self.dense.items()},
        )

    def select(self, members: list[int]) -> CohortTensors:
        """The same tensors for a subset of the members (in the given order)."""
        offsets, tables = {}, {}
        for t, values in self.tables.items():
            spans = [
                (int(self.row_offsets[t][j]), int(self.row_offsets[t][j + 1])) for j in members
            ]
            offsets[t] = np.cumsum([0] + [b - a for a, b in spans])
            tables[t] = torch.cat([values[a:b] for a, b in spans]) if spans else values[:0]
        dense = {n: v[members] for n, v in self.dense.items()}
        return CohortTensors(offsets, tables, dense)


@dataclass(frozen=True)
class CohortWork:
    """A round's client work: the rule, each member's lr scale, SCAFFOLD's corrections."""

    rule: LocalRule
    lr_scale: np.ndarray
    corrections: CohortTensors | None = None

    def select(self, members: list[int]) -> CohortWork:
        corrections = None if self.corrections is None else self.corrections.select(members)
        return CohortWork(self.rule, self.lr_scale[members], corrections)


def clip_scale(squared_norm: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s factor, for one norm or a vector of per-client norms."""
    return (clip_norm / (squared_norm.sqrt() + CLIP_EPS)).clamp(max=1.0)


def descend(
    rule: LocalRule,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    lrs: Sequence[float | torch.Tensor],
    corrections: list[torch.Tensor] | None = None,
    buffers: list[torch.Tensor] | None = None,
) -> None:
    """The rest of a local step once the proximal term and clipping are in ``grads``: weight
    decay, SCAFFOLD's correction, momentum (``buffers``, updated in place) and
    ``x -= lr * step``; one ``lr`` per parameter tensor (a tensor broadcasts per member)."""
    if rule.weight_decay:
        grads = [g + rule.weight_decay * x for g, x in zip(grads, params, strict=True)]
    if corrections is not None:
        grads = [g + c for g, c in zip(grads, corrections, strict=True)]
    if buffers is not None:
        for b, g in zip(buffers, grads, strict=True):
            b.mul_(rule.momentum).add_(g)
        grads = buffers
    for x, g, lr in zip(params, grads, lrs, strict=True):
        x.sub_(lr * g)
