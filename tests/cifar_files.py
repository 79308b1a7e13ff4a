"""Writes CIFAR archives in the official format (tests): Python 2 pickles inside a tar.gz.

The official batches were pickled by Python 2 with numpy 1.x: their strings are byte strings
(opcodes BINSTRING / SHORT_BINSTRING, read back as bytes with ``encoding="bytes"``) and their
arrays reference ``numpy.core.multiarray._reconstruct``. ``python2_pickle`` writes the same
opcodes, so the loader is tested on what it meets in the real files.
"""

from __future__ import annotations

import io
import pickle
import struct
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from fedsub.data.cifar import ARCHIVES


class _Python2Pickler(pickle._Pickler):  # the pure-Python pickler, whose dispatch is a dict
    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2_string(self, obj: bytes | str) -> None:
        data = obj.encode("latin-1") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        module = obj.__module__.replace("numpy._core", "numpy.core")
        self.write(pickle.GLOBAL + f"{module}\n{name or obj.__qualname__}\n".encode())
        self.memoize(obj)

    dispatch[bytes] = save_py2_string
    dispatch[str] = save_py2_string
    dispatch[type] = save_global


def python2_pickle(obj: Any) -> bytes:
    out = io.BytesIO()
    _Python2Pickler(out, protocol=2).dump(obj)
    return out.getvalue()


def batch(n: int, label_keys: dict[str, int], seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    content: dict[str, Any] = {
        "batch_label": f"generated batch {seed}",
        "data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        "filenames": [f"image_{seed}_{i}.png" for i in range(n)],
    }
    for key, classes in label_keys.items():
        content[key] = [int(i % classes) for i in range(n)]
    return content


def write_archive(
    path: Path,
    name: str,
    per_batch: int = 40,
    members: dict[str, bytes] | None = None,
) -> Path:
    """``path`` (a .tar.gz) with the official layout: ``per_batch`` images per batch;
    ``members`` replaces or adds members (by their name inside the archive's folder)."""
    archive = ARCHIVES[name]
    blobs = {
        member: python2_pickle(batch(per_batch, archive.classes, seed))
        for seed, member in enumerate(archive.train + archive.test)
    }
    blobs.update(members or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for member, data in blobs.items():
            info = tarfile.TarInfo(f"{archive.folder}/{member}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
