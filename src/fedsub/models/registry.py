"""Model names usable as ``[model] name`` and how each is built for a dataset."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedsub.data.federated import FederatedDataset
from fedsub.models.base import Model
from fedsub.models.cnn import SmallCNN
from fedsub.models.din import DIN
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.models.lstm import LSTMClassifier
from fedsub.models.softmax_regression import SoftmaxRegression
from fedsub.models.sparse_lr import SparseLogisticRegression

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
        classes=int(max(ds.train.labels.max(), ds.test.labels.max(initial=0))) + 1
    ),
    "embedding-lr": lambda ds, opts: EmbeddingLogisticRegression(
        table_rows=dict(ds.table_rows),
        embedding_dim=opts["embedding_dim"],
        init_std=opts["init_std"] or 0.01,
        fields=tuple(ds.train.ids),
        field_tables=dict(ds.field_tables),
    ),
    "softmax-regression": lambda ds, opts: SoftmaxRegression(
        dense_dim=ds.train.dense_dim,
        classes=int(max(ds.train.labels.max(), ds.test.labels.max(initial=0))) + 1,
    ),
}


def model_names() -> list[str]:
    return sorted(_BUILDERS)


def build_model(name: str, dataset: FederatedDataset, options: dict[str, Any]) -> Model:
    return _BUILDERS[name](dataset, options)
