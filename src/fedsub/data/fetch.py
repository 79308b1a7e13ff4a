"""Downloads into the cache (``$FEDSUB_DATA``, default ``~/.cache/fedsub``), checked against a
pinned checksum, resumable, never half-written.

A transfer goes to ``<file>.part``; an interrupted one resumes from where it stopped (HTTP
Range) when the server allows, or restarts. Only a file whose checksum matches is renamed into
place; on a mismatch the partial file is removed and the error says so.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from fedsub.errors import DataError

CHUNK = 1 << 20


@dataclass(frozen=True)
class Download:
    url: str
    filename: str
    checksum: str  # "sha256:<hex>" or "md5:<hex>" (GroupLens publishes MD5 sums)


def _idx_set(base: str, md5: tuple[str, str, str, str]) -> tuple[Download, ...]:
    names = (
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    )
    return tuple(Download(base + n, n, f"md5:{h}") for n, h in zip(names, md5, strict=True))


# Official public addresses with the MD5 sums their publishers (and torchvision) list.
DOWNLOADS: dict[str, tuple[Download, ...]] = {
    "movielens-100k": (
        Download(
            "https://files.grouplens.org/datasets/movielens/ml-100k.zip",
            "ml-100k.zip",
            "md5:0e33842e24a9c977be4e0107933c0723",
        ),
    ),
    "movielens-1m": (
        Download(
            "https://files.grouplens.org/datasets/movielens/ml-1m.zip",
            "ml-1m.zip",
            "md5:c4d9eecfca2ab87c1945afe126590906",
        ),
    ),
    "mnist": _idx_set(
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        (
            "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "d53e105ee54ea40749a09fcbcd1e9432",
            "9fb629c4189551a2d022fa330f9573f3",
            "ec29112dd5afa0611ce80d1b7f02629c",
        ),
    ),
    "fashion-mnist": _idx_set(
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        (
            "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "25c81989df183df01b3e8a0aad5dffbe",
            "bef4ecab320f06d8554ea6380940ec79",
            "bb300cfdad3c16e7a12a480ee83cd310",
        ),
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("FEDSUB_DATA", Path.home() / ".cache" / "fedsub"))


def cached_file(name: str) -> Path | None:
    """The cached archive of a one-file dataset, if fetched."""
    downloads = DOWNLOADS.get(name)
    if not downloads:
        return None
    path = cache_dir() / name / downloads[0].filename
    return path if path.exists() else None


def _digest(path: Path, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def fetch(name: str, download: Download, timeout: float = 60.0) -> Path:
    """The verified file in the cache, downloading (or resuming) it first when needed."""
    algorithm, _, expected = download.checksum.partition(":")
    if algorithm not in ("sha256", "md5") or not expected:
        raise DataError(f"{name}: checksum must be 'sha256:<hex>' or 'md5:<hex>'")
    folder = cache_dir() / name
    final = folder / download.filename
    if final.exists():
        return final
    folder.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".part")
    start = partial.stat().st_size if partial.exists() else 0
    request = urllib.request.Request(download.url)
    if start:
        request.add_header("Range", f"bytes={start}-")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            resumed = start > 0 and response.status == 206
            with open(partial, "ab" if resumed else "wb") as handle:
                while block := response.read(CHUNK):
                    handle.write(block)
            expected_length = response.headers.get("Content-Length")
    except (urllib.error.URLError, http.client.HTTPException, OSError, TimeoutError) as error:
        raise DataError(
            f"{name}: download from {download.url} failed ({error}); the partial file "
            f"{partial} is kept and the next `fedsub data fetch {name}` resumes it"
        ) from None
    if expected_length is not None and partial.stat().st_size < start * resumed + int(
        expected_length
    ):
        raise DataError(f"{name}: the transfer from {download.url} was cut off; run it again")
    actual = _digest(partial, algorithm)
    if actual != expected:
        partial.unlink()
        raise DataError(
            f"{name}: checksum mismatch for {download.url}: {algorithm} {actual}, expected "
            f"{expected}; the partial file was removed"
        )
    os.replace(partial, final)
    return final
