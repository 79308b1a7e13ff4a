"""The model protocol and the tensor batch every model consumes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from fedsub.data.federated import SampleSet
from fedsub.submodel.params import Params

Task = Literal["binary", "regression"]


@dataclass(frozen=True)
class Batch:
    """Torch view of a ``SampleSet``: per table (values, offsets) with offsets of length n + 1."""

    ids: dict[str, tuple[torch.Tensor, torch.Tensor]]
    labels: torch.Tensor
    dense: torch.Tensor | None

    @staticmethod
    def from_samples(samples: SampleSet, dtype: torch.dtype) -> Batch:
        return Batch(
            ids={
                t: (torch.from_numpy(r.values), torch.from_numpy(r.offsets))
                for t, r in samples.ids.items()
            },
            labels=torch.from_numpy(samples.labels).to(dtype),
            dense=None if samples.dense is None else torch.from_numpy(samples.dense).to(dtype),
        )


class Model(Protocol):
    """A model fedsub can train federatedly.

    ``forward`` must read table rows only through the batch's ids, so that it runs unchanged on
    the full global model (global ids) and on a client's submodel (ids local to S(k)).
    """

    task: Task

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params: ...

    def forward(self, params: Params, batch: Batch) -> torch.Tensor: ...

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean loss over the batch."""
        ...
