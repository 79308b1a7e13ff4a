"""Which member of a cohort owns which entries of a list of parameter tensors.

Client transforms are written once and run on one client (the sequential reference, Flower's
ClientApp) and on a whole cohort at once (the batched backend). What differs is only how a
per-member quantity is reduced (a gradient norm for clipping) or spread back onto the
tensors (a learning rate); a layout answers both:

- ``OneClient``: the tensors are one client's; a per-member value is one scalar.
- ``CohortLayout``: the cohort layout of the batched backend, table rows of all K members
  concatenated with a row -> member ``owner`` index, dense tensors stacked [K, ...] (or a
  weight's gradient as its low-rank factors: models/low_rank.py).

``OneClient`` keeps the order of floating-point operations the sequential reference always
used; ``CohortLayout`` reduces each tensor in one read (``vector_norm``), which agrees with it
up to rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from fedsub.device import from_host
from fedsub.models.low_rank import LowRankGradient
from fedsub.numerics import segment_sum

LearningRate = float | torch.Tensor  # a scalar for one client, per-member broadcast for a cohort


class Layout(Protocol):
    @property
    def members(self) -> int: ...

    def squared_norms(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Each member's squared L2 norm over all of its entries."""
        ...

    def spread(self, values: torch.Tensor, position: int, like: torch.Tensor) -> torch.Tensor:
        """Per-member ``values`` (as ``squared_norms`` returns them) broadcast onto the tensor
        at ``position`` of the parameter list (``like``)."""
        ...

    def spread_all(
        self, values: LearningRate, tensors: Sequence[torch.Tensor]
    ) -> list[LearningRate]:
        """``spread`` onto every tensor of the list (a float stays a float)."""
        ...

    def per_member(self, values: np.ndarray, like: torch.Tensor) -> LearningRate:
        """A per-member float64 vector (e.g. learning rates) as the layout's per-member value:
        a float for one client, a [K] tensor of ``like``'s dtype and device for a cohort."""
        ...

    def per_tensor(self, values: np.ndarray, tensors: Sequence[torch.Tensor]) -> list[LearningRate]:
        """A per-member float64 vector (e.g. learning rates) as one factor per tensor."""
        ...


@dataclass(frozen=True)
class OneClient:
    """The tensors of one client."""

    @property
    def members(self) -> int:
        return 1

    def squared_norms(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        # left to right from the first square, as the built-in sum() over the tensors adds
        return functools.reduce(torch.add, (t.pow(2).sum() for t in tensors))

    def spread(self, values: torch.Tensor, position: int, like: torch.Tensor) -> torch.Tensor:
        return values

    def spread_all(
        self, values: LearningRate, tensors: Sequence[torch.Tensor]
    ) -> list[LearningRate]:
        return [values] * len(tensors)

    def per_member(self, values: np.ndarray, like: torch.Tensor) -> LearningRate:
        return float(values[0])

    def per_tensor(self, values: np.ndarray, tensors: Sequence[torch.Tensor]) -> list[LearningRate]:
        return [float(values[0])] * len(tensors)


@dataclass(frozen=True)
class CohortLayout:
    """K members in the batched backend's layout: ``owners[i]`` maps the rows of table tensor i
    to their member; ``None`` marks a dense tensor stacked on a leading member axis."""

    owners: tuple[torch.Tensor | None, ...]
    size: int

    @property
    def members(self) -> int:
        return self.size

    def squared_norms(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        # the dense tensors' per-member norms are stacked and squared once: a cohort step's
        # client rule is otherwise a few small ops per tensor, and DIN has 14 of them
        squared = torch.zeros(self.size, dtype=tensors[0].dtype, device=tensors[0].device)
        norms = []
        for t, owner in zip(tensors, self.owners, strict=True):
            if isinstance(t, LowRankGradient):  # a dense weight's gradient as its factors
                squared += t.squared_norms()
            elif owner is not None:
                per_row = torch.linalg.vector_norm(t.reshape(len(t), -1), dim=1).square()
                segment_sum.index_add_(squared, owner, per_row)
            else:  # one read of the tensor (pow(2).sum() writes and reads a squared copy)
                norms.append(torch.linalg.vector_norm(t.reshape(len(t), -1), dim=1))
        if norms:
            squared += torch.stack(norms).square().sum(0)
        return squared

    def spread(self, values: torch.Tensor, position: int, like: torch.Tensor) -> torch.Tensor:
        owner = self.owners[position]
        if owner is not None:
            values = values.index_select(0, owner)
        return values.reshape(-1, *([1] * (like.dim() - 1)))

    def spread_all(
        self, values: LearningRate, tensors: Sequence[torch.Tensor]
    ) -> list[LearningRate]:
        if not isinstance(values, torch.Tensor):
            return [values] * len(tensors)
        by_dim: dict[int, torch.Tensor] = {}  # a dense tensor's factor depends on its dim only
        spread: list[LearningRate] = []
        for i, t in enumerate(tensors):
            if self.owners[i] is not None:
                spread.append(self.spread(values, i, t))
                continue
            if t.dim() not in by_dim:
                by_dim[t.dim()] = self.spread(values, i, t)
            spread.append(by_dim[t.dim()])
        return spread

    def per_member(self, values: np.ndarray, like: torch.Tensor) -> LearningRate:
        return from_host(values, like.device).to(like.dtype)

    def per_tensor(self, values: np.ndarray, tensors: Sequence[torch.Tensor]) -> list[LearningRate]:
        return self.spread_all(self.per_member(values, tensors[0]), tensors)
