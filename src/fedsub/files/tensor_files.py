"""safetensors files written straight from the tensors' memory, never through a copy.

A server table can be most of the process's memory: ``safetensors.torch.save`` builds the whole
file as one ``bytes`` object (a second table), and cloning the tensors first made a third. Since
safetensors 0.8, ``save_file`` writes each tensor from its own buffer, so writing a model or a
checkpoint costs no more memory than the file's header. Only tensors that safetensors cannot
write in place are copied, one at a time: a non-contiguous tensor, a view into a larger
storage, and a tensor whose storage another tensor of the same file already uses (safetensors
refuses shared storage). A CUDA tensor is copied to the host by safetensors, one at a time.

``save_file`` creates its file private (0600) whatever the umask says; the file gets the mode
the user's umask gives a new file (as ``atomic_files``' files do), read off an empty file this
module creates first, and the data are flushed to disk before the file is published.

Flower's node ids are unsigned 64-bit integers (half of them at or above 2^63): torch and
safetensors have no uint64 to keep them in, so ``unsigned_ids_tensor`` stores them as int64
with the same bits and ``unsigned_ids`` reads them back (every checkpoint stage that keeps
node ids goes through the two).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from fedsub.files.atomic_files import create_temp_file


def writable_in_place(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as safetensors can write them from their own memory: detached, each alone
    in its storage and contiguous (a copy only where it is not)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        storage = tensor.untyped_storage()
        whole = tensor.is_contiguous() and storage.nbytes() == tensor.nbytes
        if not whole or storage.data_ptr() in seen:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        elif storage.nbytes():  # an empty tensor's storage may be shared freely
            seen.add(storage.data_ptr())
        out[name] = tensor
    return out


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``path`` as a safetensors file of ``tensors``, on disk when this returns (fsync)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    os.close(fd)
    _save(path, tensors)


def write_tensors_atomic(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write via a temporary file beside ``path`` and a rename: no reader sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = create_temp_file(path.parent, path.name)
    os.close(fd)
    try:
        _save(tmp, tensors)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write over the empty file ``path``, keep its mode (the umask's), and fsync."""
    mode = path.stat().st_mode & 0o777
    save_file(writable_in_place(tensors), str(path))
    os.chmod(path, mode)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unsigned_ids_tensor(ids: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Unsigned 64-bit ids (Flower's node ids) as an int64 tensor of the same bits; a
    ``ValueError`` naming the id for one outside [0, 2^64)."""
    for i in ids:
        if not 0 <= int(i) < 2**64:
            raise ValueError(f"node id {i} is not an unsigned 64-bit integer")
    return torch.from_numpy(np.array([int(i) for i in ids], dtype=np.uint64).view(np.int64))


def unsigned_ids(tensor: torch.Tensor) -> list[int]:
    """The unsigned 64-bit ids ``unsigned_ids_tensor`` stored (an int64 tensor; one written
    before ids were stored this way holds ids below 2^63, which read back the same)."""
    return [int(i) for i in tensor.numpy().astype(np.int64, copy=False).view(np.uint64)]
