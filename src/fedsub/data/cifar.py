"""``cifar10`` and ``cifar100``: the official python-pickle archives, split over clients.

The archive (``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz`` from
https://www.cs.toronto.edu/~kriz/cifar.html) is read where ``data.path`` points (the archive,
a folder holding it, or the folder it extracts to) or from the cache (``fedsub data fetch
cifar10``). Its members are Python 2 pickles of dicts (``data``: uint8 [n, 3072], the red,
green and blue 32 x 32 planes of each image; ``labels``, or ``fine_labels`` and
``coarse_labels`` for CIFAR-100). They are unpickled with ``encoding="bytes"`` by an
unpickler that builds nothing but numpy arrays and dtypes; anything else in a member is
refused, naming the member. Pixels become 3,072 dense features in [0, 1] (channel-major);
the test batch is the test set. ``partition``: the labeled partitioners of
fedsub.data.partition (``iid``, ``dirichlet``, ``shards``, ``k-labels``, ``power-law``).
"""

from __future__ import annotations

import io
import pickle
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedsub.data import partition as partitioners
from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.fetch import cache_dir
from fedsub.errors import DataError

SIDE, CHANNELS = 32, 3
PIXELS = SIDE * SIDE * CHANNELS


@dataclass(frozen=True)
class Archive:
    filename: str
    folder: str  # the folder the archive's members live in
    train: tuple[str, ...]
    test: tuple[str, ...]
    classes: dict[str, int]  # label key -> number of classes


ARCHIVES = {
    "cifar10": Archive(
        "cifar-10-python.tar.gz",
        "cifar-10-batches-py",
        tuple(f"data_batch_{i}" for i in range(1, 6)),
        ("test_batch",),
        {"labels": 10},
    ),
    "cifar100": Archive(
        "cifar-100-python.tar.gz",
        "cifar-100-python",
        ("train",),
        ("test",),
        {"fine_labels": 100, "coarse_labels": 20},
    ),
}


@dataclass(frozen=True)
class CifarOptions:
    partition: str = field(
        default="dirichlet", metadata={"choices": lambda: list(partitioners.GENERIC)}
    )
    """How the images are split over clients: `iid`, `dirichlet` (dirichlet_alpha), `shards`,
    `k-labels` (labels_per_client), `power-law` (power_law_sigma); MNIST-style data also seed 004's
    `li-balanced` and `li-unbalanced`."""
    num_clients: int = field(default=100, metadata={"min": 1})
    """Clients."""
    labels_per_client: int = field(default=2, metadata={"min": 1})
    """`k-labels` and `li-balanced`: distinct labels per client."""
    dirichlet_alpha: float = field(default=0.1, metadata={"min_exclusive": 0.0})
    """`dirichlet`: the concentration of each client's label proportions (small: few labels per
    client)."""
    power_law_sigma: float = field(default=2.0, metadata={"min": 0.0})
    """`power-law` and `li-unbalanced`: the lognormal spread of client sizes."""
    # CIFAR-100 only: the 100 fine classes or the 20 superclasses
    labels: str = field(default="fine", metadata={"choices": lambda: ["fine", "coarse"]})


class _ArraysOnly(pickle.Unpickler):
    """Builds only what a CIFAR batch holds: dicts, lists, bytes, numbers and numpy arrays."""

    def __init__(self, file: io.BufferedIOBase, member: str) -> None:
        super().__init__(file, encoding="bytes")
        self.member = member

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is None:
            raise DataError(
                f"{self.member}: refusing to unpickle {module}.{name} (a CIFAR batch holds "
                "only a dict of lists, bytes and a uint8 numpy array)"
            )
        return allowed()


def _reconstruct() -> Callable[..., Any]:
    try:
        from numpy._core.multiarray import _reconstruct as found  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct as found  # type: ignore[no-redef]
    return found


_ALLOWED: dict[tuple[str, str], Callable[[], Any]] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,  # pickled by numpy 1.x
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,  # pickled by numpy 2.x
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
}


def read_batch(data: bytes, member: str, label_key: str, classes: int) -> SampleSet:
    """One pickled batch: its images as [n, 3072] pixels in [0, 1] and its labels."""
    try:
        batch = _ArraysOnly(io.BytesIO(data), member).load()
    except DataError:
        raise
    except Exception as error:  # a truncated or foreign pickle fails in many ways
        raise DataError(f"{member}: not a readable CIFAR batch pickle ({error})") from None
    if not isinstance(batch, dict):
        raise DataError(f"{member}: expected a pickled dict, got {type(batch).__name__}")
    entries = {k.decode("latin-1") if isinstance(k, bytes) else str(k): v for k, v in batch.items()}
    images, labels = entries.get("data"), entries.get(label_key)
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 2:
        raise DataError(f"{member}: 'data' must be a uint8 array [n, {PIXELS}]")
    if images.shape[1] != PIXELS:
        raise DataError(f"{member}: 'data' has {images.shape[1]} values per image, not {PIXELS}")
    if not isinstance(labels, list | np.ndarray) or len(labels) != len(images):
        raise DataError(
            f"{member}: expected {label_key!r}, a list of {len(images)} labels (one per image)"
        )
    label_array = np.asarray(labels)
    if label_array.dtype.kind not in "iu" or (
        len(label_array) and (label_array.min() < 0 or label_array.max() >= classes)
    ):
        raise DataError(f"{member}: {label_key!r} must be integers in [0, {classes})")
    pixels = images.astype(np.float32) / 255.0
    return SampleSet({}, label_array.astype(np.float32), pixels)


def locate(name: str, path: str | None) -> Path:
    """The archive, or the folder it extracts to, from ``data.path`` or the cache."""
    archive = ARCHIVES[name]
    given = Path(path) if path else cache_dir() / name
    for candidate in (given, given / archive.filename, given / archive.folder):
        if candidate.is_file() or (candidate.is_dir() and (candidate / archive.test[0]).is_file()):
            return candidate
    raise DataError(
        f"{name}: no {archive.filename} (or its extracted {archive.folder}/) in {given}; "
        f"run `fedsub data fetch {name}` or set data.path to the archive"
    )


def _members(source: Path, archive: Archive) -> Callable[[str], tuple[bytes, str]]:
    """A reader of the archive's members by name: (bytes, the name errors give)."""
    if source.is_dir():

        def from_folder(member: str) -> tuple[bytes, str]:
            file = source / member
            if not file.is_file():
                raise DataError(f"{source}: no member {member!r} (expected {archive.folder}/)")
            return file.read_bytes(), str(file)

        return from_folder

    try:
        with tarfile.open(source, "r:*") as tar:
            contents = {m.name: m for m in tar.getmembers()}
            wanted = [f"{archive.folder}/{m}" for m in archive.train + archive.test]
            blobs: dict[str, bytes] = {}
            for full in wanted:
                info = contents.get(full)
                if info is None or not info.isfile():
                    raise DataError(
                        f"{source}: no file {full!r} in the archive (expected the official "
                        f"{archive.filename} layout)"
                    )
                handle = tar.extractfile(info)
                if handle is None:  # pragma: no cover - isfile() members always have one
                    raise DataError(f"{source}: cannot read {full!r}")
                blobs[full] = handle.read()
    except (tarfile.TarError, EOFError, OSError) as error:
        raise DataError(f"{source}: not a readable tar.gz archive ({error})") from None

    def from_tar(member: str) -> tuple[bytes, str]:
        full = f"{archive.folder}/{member}"
        return blobs[full], f"{source}:{full}"

    return from_tar


def load(name: str, options: CifarOptions, path: str | None, seed: int) -> FederatedDataset:
    archive = ARCHIVES[name]
    label_key, classes = next(iter(archive.classes.items()))
    if name == "cifar100":
        label_key = f"{options.labels}_labels"
        classes = archive.classes[label_key]
    read = _members(locate(name, path), archive)

    def samples(members: tuple[str, ...]) -> SampleSet:
        return SampleSet.concat(
            [read_batch(*read(m), label_key=label_key, classes=classes) for m in members]
        )

    train, test = samples(archive.train), samples(archive.test)
    rng = np.random.default_rng([seed, 0xC1FA])
    o = options
    parts = partitioners.by_name(
        o.partition,
        train.labels.astype(np.int64),
        o.num_clients,
        rng,
        labels_per_client=o.labels_per_client,
        dirichlet_alpha=o.dirichlet_alpha,
        power_law_sigma=o.power_law_sigma,
    )
    return FederatedDataset.from_clients(name, {}, [train.take(p) for p in parts], test)
