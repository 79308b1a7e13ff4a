"""IDX files (the MNIST family's format), gzip-compressed or not.

Header: two zero bytes, a type code (0x08 ubyte, 0x09 byte, 0x0B int16, 0x0C int32, 0x0D
float32, 0x0E float64), the number of dimensions, then each dimension as a big-endian uint32;
the data follow in row-major order, big-endian.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from fedsub.errors import DataError

TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as error:
        raise DataError(f"{path}: cannot be read ({error})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in TYPES:
        raise DataError(
            f"{path}: not an IDX file (expected 00 00 <type in {sorted(TYPES)}> <ndim>, "
            f"got {raw[:4].hex(' ')})"
        )
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: IDX header of {ndim} dimensions is truncated")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(TYPES[raw[2]])
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise DataError(
            f"{path}: IDX header says shape {shape} ({expected} bytes) but the file has "
            f"{len(raw)} bytes"
        )
    return (
        np.frombuffer(raw, dtype=dtype, offset=header)
        .reshape(shape)
        .astype(dtype.newbyteorder("="))
    )
