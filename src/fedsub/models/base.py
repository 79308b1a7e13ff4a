"""The model protocol and the tensor batch every model consumes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, TypeGuard, TypeVar, runtime_checkable

import numpy as np
import torch

from fedsub.data.federated import SampleSet
from fedsub.submodel.params import Params

if TYPE_CHECKING:  # width.py's types, for annotations only
    from fedsub.models.width import Slicing

Task = Literal["binary", "multiclass", "regression"]


@dataclass(frozen=True)
class Batch:
    """Torch view of a ``SampleSet``: per table (values, offsets) with offsets of length n + 1."""

    ids: dict[str, tuple[torch.Tensor, torch.Tensor]]
    labels: torch.Tensor
    dense: torch.Tensor | None

    @staticmethod
    def from_samples(
        samples: SampleSet, dtype: torch.dtype, device: torch.device | None = None
    ) -> Batch:
        def tensor(array: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
            return torch.from_numpy(array).to(device, dtype)

        return Batch(
            ids={t: (tensor(r.values), tensor(r.offsets)) for t, r in samples.ids.items()},
            labels=tensor(samples.labels, dtype),
            dense=None if samples.dense is None else tensor(samples.dense, dtype),
        )


Features = dict[str, torch.Tensor]
Ids = dict[str, tuple[torch.Tensor, torch.Tensor]]


@runtime_checkable  # fedsub.train tells a fedsub Model from other objects
class Model(Protocol):
    """A model fedsub can train federatedly, split at the embedding layer.

    ``embed`` reads table rows only through the ids it is given, so it runs unchanged on the
    global model (global ids), on one client's submodel (ids local to S(k)) and on a whole
    cohort's concatenated submodels (ids offset per client). ``head`` sees only dense
    parameters and per-sample features, so the batched engine can ``vmap`` it over a stack of
    clients' dense parameters. Every output has the samples on its leading axis.
    """

    @property
    def task(self) -> Task:
        """Read-only, so a frozen dataclass's ``task`` field satisfies it."""
        ...

    # Optional capabilities are the protocols below (``CohortHead``, ``ClosedFormGradients``,
    # ``DeclaresBatchable``, ``EvalBatch``; width slicing is ``SliceableModel``): the engine
    # asks ``isinstance(model, Capability)``, never for attribute names.

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params: ...

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features: ...

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor: ...

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean over the batch of a per-sample loss (the batched engine relies on it)."""
        ...


# Optional capabilities. Each is checked with ``isinstance`` (``runtime_checkable`` only checks
# that the members exist; tests/test_model_capabilities.py checks that they also work).
# Convention for heads: ``head`` is always the single-client head (dense parameters without a
# client axis); ``cohort_head`` is the same function for K clients at once and must equal
# ``vmap(head)``. A model that writes its head once for the cohort defines ``head`` as
# ``cohort_ops.single_client(self.cohort_head, ...)``.


@runtime_checkable
class CohortHead(Protocol):
    """A head written for a whole cohort (dense [K, ...], features [K, B, ...] -> [K, B, ...]),
    which the batched engine runs instead of ``vmap(model.head)``."""

    def cohort_head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor: ...


@runtime_checkable
class ClosedFormGradients(Protocol):
    """Gradients of the K clients' batch-mean losses in closed form, which the batched engine
    uses instead of autograd (see ``SparseLogisticRegression.cohort_gradients``)."""

    def cohort_gradients(
        self,
        tables: dict[str, torch.Tensor],
        dense: dict[str, torch.Tensor],
        ids: dict[str, torch.Tensor],
        sample_of_id: dict[str, torch.Tensor],
        dense_inputs: torch.Tensor | None,
        labels: torch.Tensor,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]: ...


@runtime_checkable
class DeclaresBatchable(Protocol):
    """A model that says whether its head can run for a whole cohort at once (neither a
    ``cohort_head`` nor vmap works when ``batchable`` is False); see ``is_batchable``."""

    batchable: bool


@runtime_checkable
class DeclaresCapturable(Protocol):
    """A model that says whether its local step can be captured as one program of fixed
    shapes (``execution.compile``, engine/captured_step.py): False when a shape depends on the
    values (DIN and LSTM pad to the longest sequence of a batch, read on the host)."""

    capturable: bool


@runtime_checkable
class PackedFeatures(Protocol):
    """A model some of whose features are ragged lists' rows packed one after another (all the
    samples' rows, [T, ...], no padding: DIN's history) instead of one entry per sample. The
    engine passes those as they are (no client axis: the rows come client after client, then
    sample after sample) and the head finds each row's sample from per-sample lengths among
    the other features. ``packed_features`` names them."""

    packed_features: frozenset[str]


@runtime_checkable
class LowRankWeights(Protocol):
    """A model with dense weights of linear layers that see one row per sample (DIN's output
    MLP): the batched engine may keep them as the global weight plus each client's low-rank
    change (models/low_rank.py), when its head applies them with ``cohort_ops.linear``.
    ``low_rank_weights`` names them ([in, out] each)."""

    low_rank_weights: frozenset[str]


_CAPABILITIES: dict[tuple[type, type], bool] = {}
CapabilityT = TypeVar("CapabilityT")


def has_capability(model: object, capability: type[CapabilityT]) -> TypeGuard[CapabilityT]:
    """``isinstance(model, capability)`` for one of the capability protocols above, remembered
    per model class: a capability is a property of the class (its methods and declared
    fields), and Python 3.11 recomputes a protocol's member list on every ``isinstance``
    (~15 us), which the batched engine would pay several times a round."""
    key = (type(model), capability)
    known = _CAPABILITIES.get(key)
    if known is None:
        known = _CAPABILITIES[key] = isinstance(model, capability)
    return known


def packed_names(model: Model) -> frozenset[str]:
    """The names of ``model``'s packed features (none unless it is ``PackedFeatures``)."""
    return model.packed_features if has_capability(model, PackedFeatures) else frozenset()


def cohort_features(features: Features, k: int, packed: frozenset[str]) -> Features:
    """A cohort's features as a cohort head takes them: per-sample ones [K * B, ...] ->
    [K, B, ...]; the ``packed`` ones (``packed_names(model)``) as they are."""
    return {n: f if n in packed else f.reshape(k, -1, *f.shape[1:]) for n, f in features.items()}


@runtime_checkable
class EvalBatch(Protocol):
    """A model that evaluates in batches of ``eval_batch`` samples (memory, or BatchNorm's
    per-batch statistics) instead of the evaluator's default chunk."""

    eval_batch: int


@runtime_checkable
class SliceableModel(Protocol):
    """A dense model whose layers can be narrowed (sub-model masking): ``slicing`` says how,
    ``at_capacity`` gives the narrowed model a client of capacity beta trains (with the scaler
    dividing by beta)."""

    @property
    def slicing(self) -> Slicing: ...

    def at_capacity(self, capacity: float) -> Model: ...


def is_batchable(model: Model) -> bool:
    """Whether the batched engine can run ``model``: yes unless it declares otherwise."""
    return not isinstance(model, DeclaresBatchable) or model.batchable


def forward(model: Model, params: Params, batch: Batch) -> torch.Tensor:
    """The model's outputs for a batch whose ids index ``params.tables``."""
    return model.head(params.dense, model.embed(params.tables, batch.ids), batch.dense)
