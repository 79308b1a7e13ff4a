"""Client work: what every member of a cohort does in a round (the chain of transforms, its
learning rate, SCAFFOLD's corrections), shared by every backend, and the cohort layout of
per-member tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedsub.client.transforms import (
    STAGES,
    Chain,
    Clip,
    Momentum,
    Sgd,
    WeightDecay,
)
from fedsub.submodel.params import Params


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
    """A round's client work: the chain of transforms every member runs, each member's
    learning rate (float64) and SCAFFOLD's corrections ``c - c_i``."""

    chain: Chain
    lr: np.ndarray
    corrections: CohortTensors | None = None

    def select(self, members: list[int]) -> CohortWork:
        corrections = None if self.corrections is None else self.corrections.select(members)
        return CohortWork(self.chain, self.lr[members], corrections)


def round_chain(
    pieces: Sequence[Any], weight_decay: float = 0.0, clip_norm: float = 0.0, momentum: float = 0.0
) -> Chain:
    """The one place a round's chain is built: the algorithm's client pieces (e.g. ``Prox``,
    ``ScaffoldCorrection``, ``Adam``) and train.clip_norm / weight_decay / momentum, in the
    stage order of fedsub.client.transforms, ending with plain SGD unless a piece is a step.

    Raises ValueError naming the pieces when they cannot be combined."""
    chosen = list(pieces)
    if clip_norm:
        chosen.append(Clip(clip_norm))
    if weight_decay:
        chosen.append(WeightDecay(weight_decay))
    steps = [p.name for p in chosen if p.stage == "step"]
    if len(steps) > 1:
        raise ValueError(f"client pieces {', '.join(map(repr, steps))} are both a step rule")
    if momentum:
        if steps:
            raise ValueError(
                f"train.momentum = {momentum} is SGD's momentum; client piece {steps[0]!r} "
                "makes its own steps (set train.momentum = 0)"
            )
        chosen.append(Momentum(momentum))
    if not steps:
        chosen.append(Sgd())
    names = [p.name for p in chosen]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"client piece {repeated[0]!r} is named twice")
    return Chain(tuple(sorted(chosen, key=lambda p: STAGES.index(p.stage))))
