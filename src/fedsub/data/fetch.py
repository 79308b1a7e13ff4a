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
from fedsub.files.atomic_files import write_atomic
from fedsub.files.run_folder import missing_ancestors, remove_if_empty

CHUNK = 1 << 20
# Debian's dataset-fashion-mnist package installs the files here (read in place, no download)
DEBIAN_FASHION = Path("/usr/share/datasets/fashion-mnist")


@dataclass(frozen=True)
class Download:
    url: str
    filename: str
    checksum: str | None  # "sha256:<hex>" or "md5:<hex>"; None: no public pin exists
    size: int | None = None  # bytes, when published


def _idx_set(base: str, pins: tuple[tuple[str, int], ...]) -> tuple[Download, ...]:
    names = (
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    )
    return tuple(
        Download(base + n, n, f"sha256:{h}", size) for n, (h, size) in zip(names, pins, strict=True)
    )


# Official public addresses. The sha256 sums and sizes are the ones TensorFlow Datasets
# (url_checksums/) and Hugging Face datasets (dataset_infos.json) record for these files;
# MovieLens and the IDX sets agree with the MD5 sums their publishers list. The CIFAR sums
# are the ones Keras (keras/datasets/cifar10.py, cifar100.py: get_file's file_hash) and
# torchvision's prototype datasets (_builtin/cifar.py) pin; the CIFAR page publishes only
# MD5s (c58f30108f718f92721af3b95e74349a, eb9058c3a382ffc7106e4002c42a8d85), which
# torchvision's CIFAR10 / CIFAR100 classes check.
DOWNLOADS: dict[str, tuple[Download, ...]] = {
    "movielens-100k": (
        Download(
            "https://files.grouplens.org/datasets/movielens/ml-100k.zip",
            "ml-100k.zip",
            "sha256:50d2a982c66986937beb9ffb3aa76efe955bf3d5c6b761f4e3a7cd717c6a3229",
            4_924_029,
        ),
    ),
    "movielens-1m": (
        Download(
            "https://files.grouplens.org/datasets/movielens/ml-1m.zip",
            "ml-1m.zip",
            "sha256:a6898adb50b9ca05aa231689da44c217cb524e7ebd39d264c56e2832f2c54e20",
            5_917_549,
        ),
    ),
    "mnist": _idx_set(
        "https://storage.googleapis.com/cvdf-datasets/mnist/",
        (
            ("440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609", 9_912_422),
            ("3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c", 28_881),
            ("8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6", 1_648_877),
            ("f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6", 4_542),
        ),
    ),
    "fashion-mnist": _idx_set(
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        (
            ("3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84", 26_421_880),
            ("a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845", 29_515),
            ("346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073", 4_422_102),
            ("67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5", 5_148),
        ),
    ),
    "cifar10": (
        Download(
            "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
            "cifar-10-python.tar.gz",
            "sha256:6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",
            170_498_071,
        ),
    ),
    "cifar100": (
        Download(
            "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
            "cifar-100-python.tar.gz",
            "sha256:85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7",
            169_001_437,
        ),
    ),
    "sent140": (
        Download(
            "https://cs.stanford.edu/people/alecmgo/trainingandtestdata.zip",
            "trainingandtestdata.zip",
            "sha256:004a3772c8a7ff9bbfeb875880f47f0679d93fc63e5cf9cff72d54a8a6162e57",
            81_363_704,
        ),
    ),
    # No public checksum of this file exists to pin: only its size is known (318,766,497 bytes),
    # so fetching it needs --checksum, or --unpinned to accept it on its size alone.
    "amazon-electronics": (
        Download(
            "https://snap.stanford.edu/data/amazon/productGraph/categoryFiles/ratings_Electronics.csv",
            "ratings_Electronics.csv",
            None,
            318_766_497,
        ),
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("FEDSUB_DATA", Path.home() / ".cache" / "fedsub"))


def cached_file(name: str) -> Path | None:
    """The cached file of a one-file dataset, if fetched."""
    downloads = DOWNLOADS.get(name)
    if not downloads:
        return None
    path = cache_dir() / name / downloads[0].filename
    return path if path.exists() else None


def _url_lines(url: str, indent: str, width: int) -> list[str]:
    """A URL on lines of at most ``width`` characters, broken after a '/' where needed."""
    lines, line = [], indent
    for piece in url.replace("/", "/\n").split("\n"):
        if len(line) + len(piece) > width and line.strip():
            lines.append(line)
            line = indent + "  "
        line += piece
    return [*lines, line]


def listing(width: int = 80) -> list[str]:
    """What ``fedsub data fetch`` can download, from where, its pin and whether it is cached,
    readable at ``width`` columns (one header line per dataset, one line per file)."""
    lines = ["Fetchable datasets, cached in:", f"  {cache_dir()}"]
    for name, downloads in DOWNLOADS.items():
        lines.append("")
        folders = {d.url[: -len(d.filename)] for d in downloads if d.url.endswith(d.filename)}
        if len(folders) == 1 and len(downloads) > 1:
            lines += _url_lines(f"{name} from {folders.pop()}", "", width)
        else:
            lines.append(name)
            for d in downloads:
                lines += _url_lines(d.url, "  ", width)
        for d in downloads:
            size = f"{d.size:,} bytes" if d.size else "size unknown"
            pin = (
                d.checksum[: d.checksum.index(":") + 9] + "..."
                if d.checksum
                else "no checksum published"
            )
            cached = "cached" if (cache_dir() / name / d.filename).exists() else "not cached"
            lines.append(f"  {d.filename}  {size}  {pin}  {cached}")
    return lines


def _digest(path: Path, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def fetch(name: str, download: Download, timeout: float = 60.0, unpinned: bool = False) -> Path:
    """The verified file in the cache, downloading (or resuming) it first when needed.

    ``unpinned`` accepts a download that has no checksum on its size alone (the sha256 is
    then written next to it, ``<file>.sha256``, for the user to pin).
    """
    algorithm, expected = _checksum(name, download, unpinned)
    folder = cache_dir() / name
    final = folder / download.filename
    if final.exists():
        return final
    created = missing_ancestors(folder)
    folder.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".part")
    try:
        _download(name, download, partial, timeout)
        actual = _verified_digest(name, download, partial, algorithm, expected)
    except BaseException:  # offline, a bad file, Ctrl-C: no empty cache folder is left
        remove_if_empty(created)
        raise
    if expected is None:
        write_atomic(final.with_name(final.name + ".sha256"), f"{actual}  {final.name}\n")
    os.replace(partial, final)
    return final


def _checksum(name: str, download: Download, unpinned: bool) -> tuple[str, str | None]:
    """(algorithm, expected hex digest); no digest for an ``unpinned`` download."""
    if download.checksum is None:
        if not unpinned:
            raise DataError(
                f"{name}: {download.url} has no published checksum to verify it against; pass "
                "--checksum sha256:<hex> if you know it, or --unpinned to accept the file on "
                "its size alone"
            )
        return "sha256", None
    algorithm, _, expected = download.checksum.partition(":")
    if algorithm not in ("sha256", "md5") or not expected:
        raise DataError(f"{name}: checksum must be 'sha256:<hex>' or 'md5:<hex>'")
    return algorithm, expected


def _download(name: str, download: Download, partial: Path, timeout: float) -> None:
    """Download into ``partial``, resuming what an earlier attempt left there; a failed
    attempt keeps what it got for the next one."""
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
        if partial.exists() and partial.stat().st_size > 0:
            kept = (
                f"the partial file {partial} ({partial.stat().st_size:,} bytes) is kept and "
                f"the next `fedsub data fetch {name}` resumes it"
            )
        else:
            partial.unlink(missing_ok=True)
            kept = "nothing was downloaded"
        raise DataError(f"{name}: download from {download.url} failed ({error}); {kept}") from None
    if expected_length is not None and partial.stat().st_size < start * resumed + int(
        expected_length
    ):
        raise DataError(f"{name}: the transfer from {download.url} was cut off; run it again")


def _verified_digest(
    name: str, download: Download, partial: Path, algorithm: str, expected: str | None
) -> str:
    """The downloaded file's digest, after checking its size and digest where known; a file
    that fails is removed."""
    size = partial.stat().st_size
    if download.size is not None and size != download.size:
        partial.unlink()
        raise DataError(
            f"{name}: {download.url} gave {size:,} bytes, expected {download.size:,}; the "
            "partial file was removed"
        )
    actual = _digest(partial, algorithm)
    if expected is not None and actual != expected:
        partial.unlink()
        raise DataError(
            f"{name}: checksum mismatch for {download.url}: {algorithm} {actual}, expected "
            f"{expected}; the partial file was removed"
        )
    return actual
