"""Dataset names usable as ``[data] name``: each has an options dataclass and a loader."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedsub.data import synthetic_li, synthetic_sparse
from fedsub.data.federated import FederatedDataset


@dataclass(frozen=True)
class DatasetSpec:
    options: type
    load: Callable[[Any, str | None, int], FederatedDataset]
    description: str


DATASETS: dict[str, DatasetSpec] = {
    "synthetic-sparse": DatasetSpec(
        synthetic_sparse.SyntheticSparseOptions,
        lambda options, path, seed: synthetic_sparse.generate(options, seed),
        "embedded recommender-like clicks (users x Zipf items, crossed features)",
    ),
    "synthetic-li": DatasetSpec(
        synthetic_li.SyntheticLiOptions,
        lambda options, path, seed: synthetic_li.generate(options, seed),
        "synthetic(alpha, beta) of Li et al. / Sahu et al.: 100 devices, 60 features, 10 classes",
    ),
}


def dataset_names() -> list[str]:
    return sorted(DATASETS)


def load_dataset(name: str, options: Any, path: str | None, seed: int) -> FederatedDataset:
    return DATASETS[name].load(options, path, seed)
