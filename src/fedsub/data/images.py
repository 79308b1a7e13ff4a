"""``mnist`` and ``fashion-mnist``: IDX files (gzip or not) split over clients.

Files: ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte`` (each optionally ``.gz``) in ``data.path``, or in the cache
(``$FEDSUB_DATA/<name>/``); Fashion-MNIST is also found where Debian's
``dataset-fashion-mnist`` installs it. Pixels become 784 dense features in [0, 1]; the
test set is pooled.

``partition`` (see fedsub.data.partition): ``iid``, ``dirichlet``, ``shards``, ``k-labels``,
``power-law``, and seed 004's two MNIST splits, which keep a subset of the samples by design:
``li-balanced`` (every client ``labels_per_client`` distinct digits drawn at random, an equal
shard of each, ``samples_per_client`` in all: 100 x 542 = 54,200, as the authors'
``generate_equal.py``) and ``li-unbalanced`` (the FedProx generator Li et al. build on: the
official train and test files pooled, client ``u`` holds digits ``u`` and ``u+1 (mod 10)``,
5 samples per digit and the rest of each digit in LogNormal(0, ``power_law_sigma``)
proportions, then each device's samples split 90/10 into train and test; the test set is the
devices' test parts). Every other partition splits the training file and keeps the official
test file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedsub.data import partition as partitioners
from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.fetch import DEBIAN_FASHION, cache_dir
from fedsub.data.idx import read_idx
from fedsub.errors import DataError

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
PARTITIONS = (*partitioners.GENERIC, "li-balanced", "li-unbalanced")


@dataclass(frozen=True)
class ImageOptions:
    partition: str = field(default="li-balanced", metadata={"choices": lambda: list(PARTITIONS)})
    """How the images are split over clients: `iid`, `dirichlet` (dirichlet_alpha), `shards`,
    `k-labels` (labels_per_client), `power-law` (power_law_sigma); MNIST-style data also seed 004's
    `li-balanced` and `li-unbalanced`."""
    num_clients: int = field(default=100, metadata={"min": 1})
    """Clients."""
    labels_per_client: int = field(default=2, metadata={"min": 1})
    """`k-labels` and `li-balanced`: distinct labels per client."""
    dirichlet_alpha: float = field(default=0.5, metadata={"min_exclusive": 0.0})
    """`dirichlet`: the concentration of each client's label proportions (small: few labels per
    client)."""
    power_law_sigma: float = field(default=2.0, metadata={"min": 0.0})
    """`power-law` and `li-unbalanced`: the lognormal spread of client sizes."""
    samples_per_client: int = field(default=542, metadata={"min": 1})
    """`li-balanced`: samples per client (542 = 2 x 271, seed 004's Table 2)."""


def locate(name: str, path: str | None) -> dict[str, Path]:
    """The IDX file of each ``FILES`` key, from the first candidate folder holding all four."""
    candidates = [Path(path)] if path else [cache_dir() / name]
    if name == "fashion-mnist" and not path:
        candidates.append(DEBIAN_FASHION)
    for folder in candidates:
        found = {key: _file(folder, stem) for key, stem in FILES.items()}
        files = {key: file for key, file in found.items() if file is not None}
        if len(files) == len(FILES):
            return files
    where = ", ".join(str(c) for c in candidates)
    hint = " (or `apt-get install dataset-fashion-mnist`)" if name == "fashion-mnist" else ""
    raise DataError(
        f"{name}: no IDX files in {where}; set data.path to a folder with "
        f"{', '.join(FILES.values())} (optionally .gz){hint}"
    )


def _file(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.exists():
            return candidate
    return None


LI_TEST_FRACTION = 0.1  # li-unbalanced: each device's share kept for the test set


def _split(labels: np.ndarray, options: ImageOptions, rng: np.random.Generator):
    o = options
    if o.partition in partitioners.GENERIC:
        return partitioners.by_name(
            o.partition,
            labels,
            o.num_clients,
            rng,
            labels_per_client=o.labels_per_client,
            dirichlet_alpha=o.dirichlet_alpha,
            power_law_sigma=o.power_law_sigma,
        )
    if o.partition == "li-unbalanced":
        return partitioners.li_unbalanced(
            labels, o.num_clients, o.labels_per_client, o.power_law_sigma, rng
        )
    if o.samples_per_client % o.labels_per_client:
        raise DataError(
            f"li-balanced: samples_per_client = {o.samples_per_client} must be a multiple of "
            f"labels_per_client = {o.labels_per_client} (an equal shard of each label)"
        )
    per_label = o.samples_per_client // o.labels_per_client
    return partitioners.li_balanced(labels, o.num_clients, o.labels_per_client, per_label, rng)


def load(name: str, options: ImageOptions, path: str | None, seed: int) -> FederatedDataset:
    files = locate(name, path)
    folder = files["train_images"].parent
    arrays = {key: read_idx(file) for key, file in files.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(
                f"{folder}: {split} images {images.shape} and labels {labels.shape} do not "
                "match (expected [n, rows, cols] and [n])"
            )

    def samples(images: np.ndarray, labels: np.ndarray) -> SampleSet:
        flat = images.reshape(len(images), -1).astype(np.float32) / 255.0
        return SampleSet({}, labels.astype(np.float32), flat)

    train_images, train_labels = arrays["train_images"], arrays["train_labels"]
    test_images, test_labels = arrays["test_images"], arrays["test_labels"]
    rng = np.random.default_rng([seed, 0x1D8])
    if options.partition == "li-unbalanced":  # devices split the pooled files 90/10
        train_images = np.concatenate([train_images, test_images])
        train_labels = np.concatenate([train_labels, test_labels])
        parts = _split(train_labels.astype(np.int64), options, rng)
        parts, test_parts = partitioners.split_each(parts, LI_TEST_FRACTION, rng)
        held_out = np.concatenate(test_parts)
        test_images, test_labels = train_images[held_out], train_labels[held_out]
    else:
        parts = _split(train_labels.astype(np.int64), options, rng)
    clients = [samples(train_images[p], train_labels[p]) for p in parts]
    test = samples(test_images, test_labels)
    return FederatedDataset.from_clients(name, {}, clients, test)
