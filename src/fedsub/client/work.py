"""Client work: what every member of a cohort does in a round (the chain of transforms, its
learning rate, SCAFFOLD's corrections), shared by every backend, and the cohort layout of
per-member tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

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

LrSchedule = Literal["constant", "inverse-round", "inverse-time", "exponential"]


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


@dataclass(frozen=True)
class ClientStep:
    """How a client's local step moves its parameters ([train]'s lr, lr_schedule, lr_decay,
    weight_decay, clip_norm, momentum): the base learning rate and its schedule over rounds
    (``lr_at``), and the transforms ``client/work.py``'s ``round_chain`` adds to the
    algorithm's client pieces (0: none)."""

    lr: float
    lr_schedule: LrSchedule = "constant"
    lr_decay: float = 0.999
    weight_decay: float = 0.0
    clip_norm: float = 0.0
    momentum: float = 0.0


def lr_at(base: float, step: ClientStep, round_index: int) -> float:
    """The client learning rate of round ``round_index`` (1-based), constant inside a round.

    ``inverse-round``: base / (1 + t) with t = round_index - 1 (seed 004);
    ``inverse-time``: base / (1 + lr_decay * t) (seed 004's appendix C.2 anneals
    (1/5) / (5 + t a) = (1/25) / (1 + t a / 5): base 0.04, lr_decay a / 5);
    ``exponential``: base * lr_decay^t (the FedSubAvg authors' x0.999 per round)."""
    t = round_index - 1
    if step.lr_schedule == "constant":
        return base
    if step.lr_schedule == "inverse-round":
        return base / (1 + t)
    if step.lr_schedule == "inverse-time":
        return base / (1 + step.lr_decay * t)
    if step.lr_schedule == "exponential":
        return base * step.lr_decay**t
    raise ValueError(f"unknown lr schedule {step.lr_schedule!r}")


def round_work(
    pieces: Sequence[Any],
    step: ClientStep,
    lr: float | None,
    counts: np.ndarray,
    clients: np.ndarray,
    round_index: int,
    scale_lr_by_pn: bool = False,
) -> CohortWork:
    """A round's work for the cohort ``clients`` (positions into the sample ``counts``): the
    chain of client transforms (the algorithm's client ``pieces`` with train.clip_norm /
    weight_decay / momentum) and each member's learning rate, the algorithm's ``lr`` (None:
    train.lr) at the round, scaled by p_k N under transformed Scheme II (``scale_lr_by_pn``);
    SCAFFOLD's corrections are added by ``ServerRound.begin``."""
    lr_scale = np.ones(len(clients))
    if scale_lr_by_pn:
        lr_scale = counts[clients] / counts.sum() * len(counts)
    rates = lr_scale * lr_at(step.lr if lr is None else lr, step, round_index)
    return CohortWork(round_chain(pieces, step.weight_decay, step.clip_norm, step.momentum), rates)
