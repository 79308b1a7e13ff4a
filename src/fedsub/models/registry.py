"""Model names usable as ``[model] name``: each model is one ``ModelSpec`` entry.

A spec holds everything fedsub knows of a model: its name and one-line description, its
options (a frozen dataclass whose fields, with defaults and ``metadata`` ranges, are the
``[model]`` keys the config checks), its builder ``build(dataset, options)``, what it reads of
a dataset (``models/inputs.Reads``, checked before a run writes anything) and its class, from
which its optional capabilities are read (the Protocols of ``models/base.py``: cohort form,
slicing for masking, packed features, ...). A plugin package adds a model by giving a
``ModelSpec`` through the ``fedsub.plugins`` entry-point group (``fedsub/plugins.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedsub import plugins
from fedsub.data.federated import FederatedDataset
from fedsub.errors import ConfigError
from fedsub.models.base import (
    ClosedFormGradients,
    CohortHead,
    DeclaresBatchable,
    DeclaresCapturable,
    EvalBatch,
    LowRankWeights,
    Model,
    PackedFeatures,
    SliceableModel,
)
from fedsub.models.cnn import SmallCNN
from fedsub.models.din import DIN
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.models.inputs import Reads, check_reads
from fedsub.models.linear_regression import LinearRegression
from fedsub.models.lstm import LSTMClassifier
from fedsub.models.mlp import MLP
from fedsub.models.module_spec import TorchModuleOptions
from fedsub.models.module_spec import build as build_torch_module
from fedsub.models.resnet import PreActResNet18
from fedsub.models.softmax_regression import SoftmaxRegression
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.models.torch_module import TorchModuleModel

# The optional capabilities a model class may have (models/base.py), by the name listings use.
# A runtime-checkable Protocol checks that its members are attributes, which a class has
# when it defines the methods and the class-level values.
CAPABILITIES: dict[str, type] = {
    "cohort-head": CohortHead,
    "closed-form-gradients": ClosedFormGradients,
    "sliceable": SliceableModel,
    "packed-features": PackedFeatures,
    "low-rank-weights": LowRankWeights,
    "eval-batch": EvalBatch,
    "declares-batchable": DeclaresBatchable,
    "declares-capturable": DeclaresCapturable,
}


@dataclass(frozen=True)
class NoOptions:
    """A model without options."""


@dataclass(frozen=True)
class ModelSpec:
    """One model: ``build(dataset, options)`` returns an instance of ``model_class`` shaped for
    ``dataset``; ``options`` is the dataclass of its ``[model]`` keys."""

    name: str
    description: str
    build: Callable[[FederatedDataset, Any], Model]
    model_class: type
    reads: Reads = field(default_factory=Reads)
    options: type = NoOptions

    def capabilities(self) -> tuple[str, ...]:
        """The optional capabilities (``CAPABILITIES``' names) its class has."""
        return tuple(n for n, p in CAPABILITIES.items() if isinstance(self.model_class, p))

    @property
    def sliceable(self) -> bool:
        """Width-sliceable (``SliceableModel``): usable with ``masking.scheme``."""
        return isinstance(self.model_class, SliceableModel)

    def options_of(self, values: Mapping[str, Any] | Any) -> Any:
        """The options dataclass from an instance of it, from ``{"options": instance}`` (the
        parsed ``[model]`` section as experiment.model_of passes it), or from ``[model]`` keys
        (those that are not this model's options are ignored: they belong to other models)."""
        if isinstance(values, self.options):
            return values
        if not isinstance(values, Mapping):
            raise TypeError(f"model {self.name!r}: options must be {self.options.__name__}")
        if isinstance(values.get("options"), self.options):
            return values["options"]
        names = {f.name for f in dataclasses.fields(self.options)}
        return self.options(**{k: v for k, v in values.items() if k in names})


# --- options shared by several built-in models -----------------------------------------------
@dataclass(frozen=True)
class InitOptions:
    init_std: float = field(default=0.0, metadata={"min": 0.0})
    """Standard deviation of the initial weights, N(0, init_std^2); 0 = zeros."""


@dataclass(frozen=True)
class EmbeddingOptions:
    embedding_dim: int = field(default=16, metadata={"min": 1})
    """Dimension of each embedding row."""
    init_std: float = field(default=0.0, metadata={"min": 0.0})
    """Standard deviation of the initial embeddings; 0 = 0.01."""


@dataclass(frozen=True)
class WidthOptions:
    widths: list[int] = field(default_factory=list, metadata={"min": 1})
    """Hidden layer widths; [] = the model's default."""
    scaler: bool = True
    """Divide activations by the capacity while training sliced widths (HeteroFL's scaler)."""


def _classes(dataset: FederatedDataset) -> int:
    return int(max(dataset.train.labels.max(), dataset.test.labels.max(initial=0))) + 1


def _image(dataset: FederatedDataset) -> tuple[int, int]:
    """(channels, side) of the square images stored as dense pixels, channel-major: one
    channel when the pixels form a square (MNIST: 784 = 28^2), three when a third of them
    do (CIFAR: 3,072 = 3 x 32^2). No count is both, since 3 is not a square."""
    dim = dataset.train.dense_dim
    for channels in (1, 3):
        side = math.isqrt(dim // channels)
        if side > 0 and channels * side * side == dim:
            return channels, side
    raise ConfigError(
        f"model: {dataset.name} has {dim} dense features per sample, not the pixels of a "
        "square image (side^2 grey or 3 x side^2 colour values)"
    )


def _dense_inputs(dataset: FederatedDataset, model: str) -> int:
    """The dense features per sample, for models that read only those."""
    if dataset.train.dense_dim == 0:
        raise ConfigError(
            f"model.name = {model!r} reads dense features, but {dataset.name} has none "
            "(only ids); choose a model for ids, e.g. sparse-lr (`fedsub list models`)"
        )
    return dataset.train.dense_dim


_ITEM = (("user", "user"), ("item", "item"), ("history", "item"))

BUILT_IN: tuple[ModelSpec, ...] = (
    ModelSpec(
        "sparse-lr",
        "logistic regression on sparse ids and dense features",
        lambda ds, o: SparseLogisticRegression(
            table_rows=dict(ds.table_rows),
            dense_dim=ds.train.dense_dim,
            init_std=o.init_std,
            field_tables=dict(ds.field_tables),
        ),
        SparseLogisticRegression,
        Reads(min_fields=1),
        InitOptions,
    ),
    ModelSpec(
        "din",
        "Deep Interest Network (target item attends over the history)",
        lambda ds, o: DIN(
            table_rows=dict(ds.table_rows),
            embedding_dim=o.embedding_dim,
            init_std=o.init_std or 0.01,
        ),
        DIN,
        Reads(fields=_ITEM, dense="none"),
        EmbeddingOptions,
    ),
    ModelSpec(
        "lstm",
        "LSTM text classifier over token ids (Sent140)",
        lambda ds, o: LSTMClassifier(table_rows=dict(ds.table_rows)),
        LSTMClassifier,
        Reads(min_fields=1, max_fields=1, dense="none"),
    ),
    ModelSpec(
        "cnn",
        "small CNN for square grey or colour images",
        lambda ds, o: SmallCNN(
            classes=_classes(ds),
            in_channels=_image(ds)[0],
            side=_image(ds)[1],
            channels=tuple(o.widths or (16, 32)),
            scaler=o.scaler,
        ),
        SmallCNN,
        Reads(max_fields=0, dense="square-image", min_side=16, labels="classes"),
        WidthOptions,
    ),
    ModelSpec(
        "mlp",
        "multilayer perceptron on dense features",
        lambda ds, o: MLP(
            inputs=_dense_inputs(ds, "mlp"),
            classes=_classes(ds),
            hidden=tuple(o.widths or (200, 200)),
            scaler=o.scaler,
        ),
        MLP,
        Reads(max_fields=0, dense="required", labels="classes"),
        WidthOptions,
    ),
    ModelSpec(
        "resnet18",
        "pre-activation ResNet-18 for square grey or colour images",
        lambda ds, o: PreActResNet18(
            classes=_classes(ds),
            in_channels=_image(ds)[0],
            side=_image(ds)[1],
            widths=tuple(o.widths or (64, 128, 256, 512)),
            scaler=o.scaler,
        ),
        PreActResNet18,
        Reads(max_fields=0, dense="square-image", min_side=8, labels="classes"),
        WidthOptions,
    ),
    ModelSpec(
        "embedding-lr",
        "logistic regression on summed id embeddings",
        lambda ds, o: EmbeddingLogisticRegression(
            table_rows=dict(ds.table_rows),
            embedding_dim=o.embedding_dim,
            init_std=o.init_std or 0.01,
            fields=tuple(ds.train.ids),
            field_tables=dict(ds.field_tables),
        ),
        EmbeddingLogisticRegression,
        Reads(min_fields=1, dense="none"),
        EmbeddingOptions,
    ),
    ModelSpec(
        "softmax-regression",
        "multinomial logistic regression on dense features",
        lambda ds, o: SoftmaxRegression(
            dense_dim=_dense_inputs(ds, "softmax-regression"), classes=_classes(ds)
        ),
        SoftmaxRegression,
        Reads(max_fields=0, dense="required", labels="classes"),
    ),
    ModelSpec(
        "linear-regression",
        "least squares on dense features (seed 004's Theorem 4)",
        lambda ds, o: LinearRegression(dense_dim=_dense_inputs(ds, "linear-regression")),
        LinearRegression,
        Reads(max_fields=0, dense="required", labels="real"),
    ),
    ModelSpec(
        "torch-module",
        "your own torch.nn.Module, built by the factory model.module names",
        build_torch_module,
        TorchModuleModel,
        # what it reads is the module's choice: wrap refuses a field or table it leaves out
        Reads(dense="optional", labels="any"),
        TorchModuleOptions,
    ),
)

MODELS: plugins.Registry[ModelSpec] = plugins.Registry(
    "model", {spec.name: spec for spec in BUILT_IN}, ModelSpec, lambda spec: spec.name
)


def model_names() -> list[str]:
    return MODELS.names()


def model_spec(name: str) -> ModelSpec:
    """The spec of model ``name`` (built in or from a plugin); ConfigError naming the choices."""
    return MODELS.get_or_refuse(name)


def build_model(name: str, dataset: FederatedDataset, options: Mapping[str, Any] | Any) -> Model:
    spec = model_spec(name)
    return spec.build(dataset, spec.options_of(options))


def build_checked_model(
    name: str, dataset: FederatedDataset, options: Mapping[str, Any] | Any
) -> Model:
    """``build_model`` after checking that the model can read all of ``dataset`` (a run's
    model: ``check_reads`` refuses a mismatch before anything is written)."""
    check_reads(name, model_spec(name).reads, dataset)
    return build_model(name, dataset, options)
