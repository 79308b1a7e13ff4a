"""The model protocol and the tensor batch every model consumes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from fedsub.data.federated import SampleSet
from fedsub.submodel.params import Params

Task = Literal["binary", "multiclass", "regression"]


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


Features = dict[str, torch.Tensor]
Ids = dict[str, tuple[torch.Tensor, torch.Tensor]]


class Model(Protocol):
    """A model fedsub can train federatedly, split at the embedding layer.

    ``embed`` reads table rows only through the ids it is given, so it runs unchanged on the
    global model (global ids), on one client's submodel (ids local to S(k)) and on a whole
    cohort's concatenated submodels (ids offset per client). ``head`` sees only dense
    parameters and per-sample features, so the batched engine can ``vmap`` it over a stack of
    clients' dense parameters. Every output has the samples on its leading axis.
    """

    task: Task
    # A model whose head cannot run for a whole cohort at once (neither ``cohort_head`` nor
    # vmap) sets ``batchable = False``; the engine then says so and runs it sequentially.
    # A model may also offer ``cohort_gradients`` (its gradients in closed form, see
    # SparseLogisticRegression), which the batched engine then uses instead of autograd.

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params: ...

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features: ...

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor: ...

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean over the batch of a per-sample loss (the batched engine relies on it)."""
        ...


def forward(model: Model, params: Params, batch: Batch) -> torch.Tensor:
    """The model's outputs for a batch whose ids index ``params.tables``."""
    return model.head(params.dense, model.embed(params.tables, batch.ids), batch.dense)
