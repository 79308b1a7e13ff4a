"""Dataset names usable as ``[data] name``: each is one ``DatasetSpec`` (an options dataclass,
whose fields are further ``[data]`` keys, and a loader). A plugin package adds one by giving a
``DatasetSpec`` with its ``name`` through the ``fedsub.plugins`` entry-point group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedsub import plugins
from fedsub.data import (
    amazon,
    cifar,
    feature_spec,
    images,
    li_quadratic,
    movielens,
    sent140,
    synthetic_li,
    synthetic_sparse,
    table,
)
from fedsub.data.federated import FederatedDataset


@dataclass(frozen=True)
class DatasetSpec:
    """``load(options, path, seed)``: the federated dataset; ``options``: the dataclass of
    its ``[data]`` keys; ``name``: needed when a plugin gives it (built-ins are named below)."""

    options: type
    load: Callable[[Any, str | None, int], FederatedDataset]
    description: str
    name: str = ""
    reads_path: bool = True  # False: generated data; a data.path given to it is refused


_BUILT_IN: dict[str, DatasetSpec] = {
    "synthetic-sparse": DatasetSpec(
        synthetic_sparse.SyntheticSparseOptions,
        lambda options, path, seed: synthetic_sparse.generate(options, seed),
        "embedded recommender-like clicks (users x Zipf items, crossed features)",
        reads_path=False,
    ),
    "movielens-100k": DatasetSpec(
        movielens.MovieLensOptions,
        lambda options, path, seed: movielens.load("movielens-100k", options, path, seed),
        "GroupLens MovieLens 100K: rating >= 4 from gender, age, movie and their crosses",
    ),
    "movielens-1m": DatasetSpec(
        movielens.MovieLensOptions,
        lambda options, path, seed: movielens.load("movielens-1m", options, path, seed),
        "GroupLens MovieLens 1M: rating >= 4 from gender, age, movie and their crosses",
    ),
    "mnist": DatasetSpec(
        images.ImageOptions,
        lambda options, path, seed: images.load("mnist", options, path, seed),
        "MNIST digits from IDX files, split over clients (seed 004's splits by default)",
    ),
    "fashion-mnist": DatasetSpec(
        images.ImageOptions,
        lambda options, path, seed: images.load("fashion-mnist", options, path, seed),
        "Fashion-MNIST from IDX files (Debian's dataset-fashion-mnist found automatically)",
    ),
    "cifar10": DatasetSpec(
        cifar.CifarOptions,
        lambda options, path, seed: cifar.load("cifar10", options, path, seed),
        "CIFAR-10 from the official python archive, split over clients (seed 003)",
    ),
    "cifar100": DatasetSpec(
        cifar.CifarOptions,
        lambda options, path, seed: cifar.load("cifar100", options, path, seed),
        "CIFAR-100 (fine or coarse labels) from the official python archive (seed 003)",
    ),
    "amazon-fedsubavg": DatasetSpec(
        amazon.AmazonFilesOptions,
        amazon.load_fedsubavg_files,
        "the FedSubAvg authors' per-user Amazon files (label, user, item, history)",
    ),
    "amazon-electronics": DatasetSpec(
        amazon.AmazonRatingsOptions,
        amazon.load_ratings_csv,
        "Amazon Electronics ratings CSV: click = 5 stars, history of earlier clicks",
    ),
    "sent140": DatasetSpec(
        sent140.Sent140Options,
        lambda options, path, seed: sent140.load(options, path, seed),
        "Sentiment140 tweets (official CSV or LEAF JSON), clients = users with > 40 tweets",
    ),
    "table": DatasetSpec(
        table.TableOptions,
        lambda options, path, seed: table.load(options, path, seed),
        "your own CSV / Parquet: one row per sample, client and label columns",
    ),
    "nodes": DatasetSpec(
        feature_spec.NodesOptions,
        lambda options, path, seed: feature_spec.load_nodes(options),
        "a Flower deployment's node-local files read with its feature spec (one client each)",
        reads_path=False,
    ),
    "synthetic-li": DatasetSpec(
        synthetic_li.SyntheticLiOptions,
        lambda options, path, seed: synthetic_li.generate(options, seed),
        "synthetic(alpha, beta) of Li et al. / Sahu et al.: 100 devices, 60 features, 10 classes",
        reads_path=False,
    ),
    "li-quadratic": DatasetSpec(
        li_quadratic.LiQuadraticOptions,
        lambda options, path, seed: li_quadratic.generate(options, seed),
        "seed 004's Theorem 4 counterexample: N devices' blocks of a ridge regression",
        reads_path=False,
    ),
}


DATASETS: plugins.Registry[DatasetSpec] = plugins.Registry(
    "dataset", _BUILT_IN, DatasetSpec, lambda spec: spec.name
)


def dataset_names() -> list[str]:
    return DATASETS.names()


def load_dataset(name: str, options: Any, path: str | None, seed: int) -> FederatedDataset:
    return DATASETS.get_or_refuse(name).load(options, path, seed)
