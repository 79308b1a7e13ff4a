"""Model names usable as ``[model] name`` and how each is built for a dataset."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fedsub.data.federated import FederatedDataset
from fedsub.errors import ConfigError
from fedsub.models.base import Model
from fedsub.models.cnn import SmallCNN
from fedsub.models.din import DIN
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.models.inputs import Reads, check_reads
from fedsub.models.linear_regression import LinearRegression
from fedsub.models.lstm import LSTMClassifier
from fedsub.models.mlp import MLP
from fedsub.models.resnet import PreActResNet18
from fedsub.models.softmax_regression import SoftmaxRegression
from fedsub.models.sparse_lr import SparseLogisticRegression


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


_BUILDERS: dict[str, Callable[[FederatedDataset, dict[str, Any]], Model]] = {
    "sparse-lr": lambda ds, opts: SparseLogisticRegression(
        table_rows=dict(ds.table_rows),
        dense_dim=ds.train.dense_dim,
        init_std=opts["init_std"],
        field_tables=dict(ds.field_tables),
    ),
    "din": lambda ds, opts: DIN(
        table_rows=dict(ds.table_rows),
        embedding_dim=opts["embedding_dim"],
        init_std=opts["init_std"] or 0.01,
    ),
    "lstm": lambda ds, opts: LSTMClassifier(table_rows=dict(ds.table_rows)),
    "cnn": lambda ds, opts: SmallCNN(
        classes=_classes(ds),
        in_channels=_image(ds)[0],
        side=_image(ds)[1],
        channels=tuple(opts.get("widths") or (16, 32)),
        scaler=opts.get("scaler", True),
    ),
    "mlp": lambda ds, opts: MLP(
        inputs=_dense_inputs(ds, "mlp"),
        classes=_classes(ds),
        hidden=tuple(opts.get("widths") or (200, 200)),
        scaler=opts.get("scaler", True),
    ),
    "resnet18": lambda ds, opts: PreActResNet18(
        classes=_classes(ds),
        in_channels=_image(ds)[0],
        side=_image(ds)[1],
        widths=tuple(opts.get("widths") or (64, 128, 256, 512)),
        scaler=opts.get("scaler", True),
    ),
    "embedding-lr": lambda ds, opts: EmbeddingLogisticRegression(
        table_rows=dict(ds.table_rows),
        embedding_dim=opts["embedding_dim"],
        init_std=opts["init_std"] or 0.01,
        fields=tuple(ds.train.ids),
        field_tables=dict(ds.field_tables),
    ),
    "softmax-regression": lambda ds, opts: SoftmaxRegression(
        dense_dim=_dense_inputs(ds, "softmax-regression"),
        classes=_classes(ds),
    ),
    "linear-regression": lambda ds, opts: LinearRegression(
        dense_dim=_dense_inputs(ds, "linear-regression"),
    ),
}
SLICEABLE = ("cnn", "mlp", "resnet18")  # width-sliceable: usable with train.masking

# What each model is and which [model] keys its builder above reads (`fedsub list models`).
MODEL_INFO: dict[str, tuple[str, tuple[str, ...]]] = {
    "sparse-lr": ("logistic regression on sparse ids and dense features", ("init_std",)),
    "din": (
        "Deep Interest Network (target item attends over the history)",
        ("embedding_dim", "init_std"),
    ),
    "lstm": ("LSTM text classifier over token ids (Sent140)", ()),
    "cnn": ("small CNN for square grey or colour images", ("widths", "scaler")),
    "mlp": ("multilayer perceptron on dense features", ("widths", "scaler")),
    "resnet18": ("pre-activation ResNet-18 for square grey or colour images", ("widths", "scaler")),
    "embedding-lr": ("logistic regression on summed id embeddings", ("embedding_dim", "init_std")),
    "softmax-regression": ("multinomial logistic regression on dense features", ()),
    "linear-regression": ("least squares on dense features (seed 004's Theorem 4)", ()),
}


# What each model reads of a dataset (models/inputs.py), checked before a run writes anything.
_ITEM = (("user", "user"), ("item", "item"), ("history", "item"))
READS: dict[str, Reads] = {
    "sparse-lr": Reads(min_fields=1),
    "din": Reads(fields=_ITEM, dense="none"),
    "lstm": Reads(min_fields=1, max_fields=1, dense="none"),
    "cnn": Reads(max_fields=0, dense="square-image", min_side=16, labels="classes"),
    "mlp": Reads(max_fields=0, dense="required", labels="classes"),
    "resnet18": Reads(max_fields=0, dense="square-image", min_side=8, labels="classes"),
    "embedding-lr": Reads(min_fields=1, dense="none"),
    "softmax-regression": Reads(max_fields=0, dense="required", labels="classes"),
    "linear-regression": Reads(max_fields=0, dense="required", labels="real"),
}


def model_names() -> list[str]:
    return sorted(_BUILDERS)


def build_model(name: str, dataset: FederatedDataset, options: dict[str, Any]) -> Model:
    return _BUILDERS[name](dataset, options)


def build_checked_model(name: str, dataset: FederatedDataset, options: dict[str, Any]) -> Model:
    """``build_model`` after checking that the model can read all of ``dataset`` (a run's
    model: ``check_reads`` refuses a mismatch before anything is written)."""
    check_reads(name, READS[name], dataset)
    return build_model(name, dataset, options)
