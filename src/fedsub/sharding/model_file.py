"""A sharded model written as one safetensors file, each process writing its own rows.

A safetensors file is an 8-byte header length, a JSON header (each tensor's dtype, shape and
byte range) and the tensors' bytes. A table is row-major, so process r's rows ``[start, stop)``
are one contiguous byte range of it: process 0 creates the file at its full size and writes
the header and the dense parameters; every process writes its rows at their offsets; after a
barrier process 0 flushes the file and renames it into place. No process ever holds more than
its own rows, and the file is the one a single process writes (any safetensors reader, and
fedsub's own loaders, read it). The processes must share the folder's file system (one
machine, or a shared mount).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fedsub import distributed
from fedsub.files.atomic_files import create_temp_file
from fedsub.sharding.rounds import ShardParams
from fedsub.submodel.params import Params

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
}


def layout(
    tensors: dict[str, tuple[torch.dtype, list[int]]],
) -> tuple[bytes, dict[str, int]]:
    """The file's first bytes (header length and JSON header, padded to 8 bytes) and each
    tensor's first byte after them, for tensors of these dtypes and shapes, in name order."""
    header: dict[str, dict] = {}
    offsets, position = {}, 0
    for name in sorted(tensors):
        dtype, shape = tensors[name]
        size = _nbytes(dtype, shape)
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": shape,
            "data_offsets": [position, position + size],
        }
        offsets[name] = position
        position += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def _write_at(handle, offset: int, tensor: torch.Tensor) -> None:
    handle.seek(offset)
    handle.write(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)


TEMPORARY = "fedsub-model-"  # the prefix of a run without a folder's temporary folder


@dataclass(frozen=True)
class WrittenModel:
    """A row-sharded run's final model, written as one file (``write_final_model``): what a
    process's result holds instead of the whole model, read when asked for."""

    path: Path

    def load(self) -> Params:
        """The whole model, read from the file (on the CPU)."""
        return Params.from_state_dict(load_file(str(self.path)))

    def read_into(self, params: Params) -> Params:
        """``params`` (a model as drawn, whole or a process's ``ShardParams``) holding the
        file's values instead, copied in place one tensor at a time (the model's order of
        tensors, devices and host placement kept); a process's share reads only its rows.
        The file must hold every tensor, of the model's shapes (runs/initial_model.py checks)."""
        with safe_open(str(self.path), "pt") as handle:
            for table, value in params.tables.items():
                rows = handle.get_slice(f"table.{table}")
                if isinstance(params, ShardParams):
                    mine = params.partitions[table].range_of(params.rank)
                    value.copy_(rows[mine.start : mine.stop])
                else:
                    value.copy_(rows[:])
            for name, value in params.dense.items():
                value.copy_(handle.get_tensor(f"dense.{name}"))
        return params


def write_final_model(folder: Path | None, params: ShardParams) -> WrittenModel:
    """Write the model of which ``params`` is this process's share as ``folder``'s
    ``model.safetensors`` (``folder``: the algorithm's run folder on process 0, None
    elsewhere; a collective) and return the file to every process.

    A run without a folder (``fedsub.train``) writes it into a temporary folder made by
    process 0 (under ``tempfile.gettempdir()``, which every process must see), where each
    process takes a hard link of its own, ``model-<rank>.safetensors``, and removes it when
    its Python exits (the last one removes the folder): the file lasts as long as some
    process may still read it."""
    path = None
    if params.rank == 0:
        folder = Path(tempfile.mkdtemp(prefix=TEMPORARY)) if folder is None else folder
        path = folder / "model.safetensors"
    written = write_model(path, params)
    assert written is not None, "process 0 gives the model a path"
    distributed.barrier("publishing the model file")  # process 0 has renamed it into place
    if not written.parent.name.startswith(TEMPORARY):
        return WrittenModel(written)
    own = written.with_name(f"model-{params.rank}.safetensors")
    os.link(written, own)
    atexit.register(_remove_link, own)
    distributed.barrier("linking the model file")
    if params.rank == 0:
        written.unlink()
    return WrittenModel(own)


def _remove_link(link: Path) -> None:
    """Remove this process's link to a temporary model file, and its folder once empty."""
    link.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # another process's link is still there
        link.parent.rmdir()


def write_model(path: Path | None, params: ShardParams) -> Path | None:
    """Write the whole model of which ``params`` is this process's share to ``path`` (given on
    process 0, the one that writes the run's outputs; None elsewhere) and return ``path`` to
    every process (process 0 renames the file into place after the others return). A
    collective; with no path on process 0 nothing is written (None)."""
    shapes: dict[str, tuple[torch.dtype, list[int]]] = {
        f"table.{t}": (v.dtype, [params.partitions[t].rows, *v.shape[1:]])
        for t, v in params.tables.items()
    }
    shapes.update({f"dense.{n}": (v.dtype, list(v.shape)) for n, v in params.dense.items()})
    head, offsets = layout(shapes)
    temp = None
    if path is not None:
        fd, temp = create_temp_file(path.parent, path.name)
        total = len(head) + sum(_nbytes(dtype, shape) for dtype, shape in shapes.values())
        os.ftruncate(fd, total)
        with os.fdopen(fd, "r+b") as handle:
            handle.write(head)
            for name, value in params.dense.items():
                _write_at(handle, len(head) + offsets[f"dense.{name}"], value)
    try:
        where = None if temp is None or path is None else (str(temp), str(path))
        named = distributed.all_gather(where, "writing the model")[0]
        if named is None:
            return None
        with open(named[0], "r+b") as handle:
            for table, value in params.tables.items():
                start = params.partitions[table].range_of(params.rank).start
                row = value[0].numel() * value.element_size() if len(value) else 0
                _write_at(handle, len(head) + offsets[f"table.{table}"] + start * row, value)
            handle.flush()
            os.fsync(handle.fileno())
        distributed.barrier("writing the model")
        if temp is not None and path is not None:
            os.replace(temp, path)
        return Path(named[1])
    except BaseException:
        if temp is not None:
            temp.unlink(missing_ok=True)
        raise


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    size = dtype.itemsize
    for extent in shape:
        size *= extent
    return size
