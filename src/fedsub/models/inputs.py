"""What a model reads of a dataset's samples, and the check that the dataset has it.

Each registered model declares its ``Reads`` (models/registry.py): which id fields (named, or
how many of any name), whether dense features (and whether they are the pixels of a square
image), and which labels (0/1, or class indices). ``check_reads`` compares that with a loaded
dataset before any output is written, and refuses, naming what the model needs and what the
dataset has, both a model that cannot read the data and one that would silently ignore part
of it (a dataset's id fields or dense features the model has no place for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedsub.data.federated import FederatedDataset
from fedsub.errors import ConfigError

Dense = Literal["none", "optional", "required", "square-image"]
Labels = Literal["binary", "classes", "real", "any"]
IMAGE_CHANNELS = (1, 3)  # grey or colour (RGB), channel-major: models/registry.py's _image


@dataclass(frozen=True)
class Reads:
    """A model's inputs. ``fields``: the id fields it needs, each with the embedding table it
    reads (empty: fields of any names); ``min_fields`` / ``max_fields``: how many id fields it
    reads (``max_fields`` None: any, 0: none); ``dense``: its dense features; ``min_side``:
    the smallest image side it takes; ``labels``: 0/1 (a binary classifier), class indices
    0..C-1, real values, or any (a user's module, whose outputs decide)."""

    fields: tuple[tuple[str, str], ...] = ()  # (field, table)
    min_fields: int = 0
    max_fields: int | None = None
    dense: Dense = "optional"
    min_side: int = 1
    labels: Labels = "binary"

    def describe(self) -> str:
        """E.g. "id fields user (table user), item (table item), history (table item), no
        dense features, labels 0/1"."""
        if self.fields:
            ids = "id fields " + ", ".join(f"{f} (table {t})" for f, t in self.fields)
        elif self.max_fields == 0:
            ids = "no ids"
        elif self.max_fields == 1 and self.min_fields == 1:
            ids = "one id field (read as a sequence)"
        else:
            ids = "ids of any fields" if self.min_fields == 0 else "ids of at least one field"
        dense = {
            "none": "no dense features",
            "optional": "dense features if any",
            "required": "dense features",
            "square-image": (
                f"dense features that are a square grey or colour image (side >= {self.min_side})"
            ),
        }[self.dense]
        labels = {
            "binary": "labels 0/1",
            "classes": "class labels 0, 1, ...",
            "real": "real-valued labels",
            "any": "any labels (its outputs and loss say which task)",
        }[self.labels]
        return f"{ids}, {dense}, {labels}"


def has(dataset: FederatedDataset) -> str:
    """What ``dataset`` offers a model, in the words of ``Reads.describe``."""
    fields = list(dataset.train.ids)
    if fields:
        shown = [
            f"{f} (table {_table(dataset, f)}, {dataset.table_rows[_table(dataset, f)]} rows)"
            for f in fields
        ]
        ids = f"id fields {', '.join(shown)}"
    else:
        ids = "no ids"
    dim = dataset.train.dense_dim
    dense = f"{dim} dense features" if dim else "no dense features"
    return f"{ids}, {dense}, {_labels_text(dataset)}"


def _table(dataset: FederatedDataset, field: str) -> str:
    return dataset.field_tables.get(field, field)


def _labels(dataset: FederatedDataset) -> np.ndarray:
    return np.unique(np.concatenate([dataset.train.labels, dataset.test.labels]))


def _labels_text(dataset: FederatedDataset) -> str:
    values = _labels(dataset)
    shown = ", ".join(f"{v:g}" for v in values[:6]) + (", ..." if len(values) > 6 else "")
    return f"labels {shown}"


def check_reads(name: str, reads: Reads, dataset: FederatedDataset) -> None:
    """Refuse (``ConfigError``) model ``name`` on ``dataset`` when it cannot read it, or would
    ignore part of it."""
    problem = _problem(reads, dataset)
    if problem is not None:
        raise ConfigError(
            f"model.name = {name!r} cannot read {dataset.name}: {problem}. The model reads "
            f"{reads.describe()}; the dataset has {has(dataset)} (`fedsub list models` shows "
            "which model reads what)"
        )


def _problem(reads: Reads, dataset: FederatedDataset) -> str | None:
    fields = list(dataset.train.ids)
    dim = dataset.train.dense_dim
    if not fields and not dim:
        return "the dataset has neither ids nor dense features: nothing to learn from"
    for field, table in reads.fields:
        if field not in fields:
            return f"it needs id field {field!r}"
        if _table(dataset, field) != table:
            return f"its field {field!r} reads table {table!r}, not {_table(dataset, field)!r}"
    named = [f for f, _ in reads.fields]
    extra = [f for f in fields if (reads.fields and f not in named) or reads.max_fields == 0]
    if extra:
        return f"it would ignore the id field {extra[0]!r}"
    if len(fields) < reads.min_fields:
        return "it needs ids, and the dataset has none"
    if reads.max_fields is not None and len(fields) > reads.max_fields:
        return f"it reads {reads.max_fields} id field(s), the dataset has {len(fields)}"
    if reads.dense == "none" and dim:
        return f"it would ignore the {dim} dense features"
    if reads.dense in ("required", "square-image") and not dim:
        return "it needs dense features, and the dataset has none"
    if reads.dense == "square-image" and not any(
        c * side * side == dim and side >= reads.min_side
        for c in IMAGE_CHANNELS
        for side in [math.isqrt(dim // c)]
    ):
        return (
            f"its {dim} dense features are not a square image of side >= {reads.min_side} "
            "(side^2 grey or 3 x side^2 colour values)"
        )
    values = _labels(dataset)
    if reads.labels == "binary" and not np.all(np.isin(values, (0.0, 1.0))):
        return "it is a binary classifier (labels 0/1)"
    whole = bool(np.all(values == np.round(values))) and bool(np.all(values >= 0))
    if reads.labels == "classes" and not whole:
        return "it needs class labels 0, 1, ... (whole numbers)"
    return None
