"""tensor_files: safetensors written from the tensors' own memory, copies only where needed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from fedsub.files.tensor_files import (
    unsigned_ids,
    unsigned_ids_tensor,
    writable_in_place,
    write_tensors,
    write_tensors_atomic,
)


def test_round_trip_of_views_shared_storage_and_empty_tensors(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "whole": base,
        "same": base,  # shares base's storage: safetensors refuses that, so it is copied
        "row": base[1],  # a view into a larger storage
        "column": base[:, 2],  # not contiguous
        "transposed": base.t(),
        "empty": torch.empty(0, 3),
        "int": torch.tensor([1, -2, 3], dtype=torch.int64),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "grad": torch.ones(3, requires_grad=True),
    }
    write_tensors(tmp_path / "a.safetensors", tensors)
    write_tensors_atomic(tmp_path / "sub" / "b.safetensors", tensors)
    for name in ("a.safetensors", "sub/b.safetensors"):
        loaded = load_file(str(tmp_path / name))
        assert set(loaded) == set(tensors)
        for key, value in tensors.items():
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value.detach())
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["b.safetensors"]  # no temp left


def test_only_what_safetensors_cannot_write_in_place_is_copied():
    base = torch.zeros(4, 6)
    alone = torch.ones(5)
    out = writable_in_place({"base": base, "again": base, "row": base[1], "alone": alone})
    assert out["base"].data_ptr() == base.data_ptr()
    assert out["alone"].data_ptr() == alone.data_ptr()
    assert out["again"].data_ptr() != base.data_ptr()
    assert out["row"].data_ptr() != base[1].data_ptr()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_files_follow_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        write_tensors(tmp_path / "a.safetensors", {"x": torch.ones(2)})
        write_tensors_atomic(tmp_path / "b.safetensors", {"x": torch.ones(2)})
    finally:
        os.umask(previous)
    for name in ("a.safetensors", "b.safetensors"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def disk_full(tensors, filename):
        with open(filename, "wb") as handle:
            handle.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("fedsub.files.tensor_files.save_file", disk_full)
    (tmp_path / "model.safetensors").write_bytes(b"the old model")
    with pytest.raises(OSError):
        write_tensors_atomic(tmp_path / "model.safetensors", {"x": torch.ones(2)})
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == b"the old model"


def test_writing_a_big_table_adds_no_copy_of_it(tmp_path):
    """Peak memory of a fresh process writing a 400 MB tensor: the old writer (clone, then the
    whole file as bytes) peaked at three tables; this one stays within one and a fraction."""
    script = textwrap.dedent(
        f"""
        import resource, sys, torch
        from fedsub.files.tensor_files import write_tensors_atomic
        table = torch.ones(100_000_000 // 4, 4)  # 400 MB, pages touched
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        write_tensors_atomic(__import__("pathlib").Path({str(tmp_path)!r}) / "t.safetensors",
                             {{"table": table, "bias": torch.zeros(1)}})
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) * 1024 / table.nbytes)
        """
    )
    grown = float(subprocess.check_output([sys.executable, "-c", script], text=True))
    assert grown < 0.25, f"writing grew the peak by {grown:.2f} tables"


def test_unsigned_64_bit_ids_survive_a_file_and_old_files_read_the_same(tmp_path):
    """Flower's node ids span [0, 2^64): kept as int64 of the same bits, read back unchanged
    (through a safetensors file); an int64 tensor of small ids (an older checkpoint) reads as
    it was; an id outside the range is refused, naming it."""
    ids = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 12128749746587692147]
    write_tensors(tmp_path / "ids.safetensors", {"nodes": unsigned_ids_tensor(ids)})
    assert unsigned_ids(load_file(tmp_path / "ids.safetensors")["nodes"]) == ids
    assert unsigned_ids(torch.tensor([100, 7], dtype=torch.int64)) == [100, 7]
    assert unsigned_ids(unsigned_ids_tensor([])) == []
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match=f"node id {bad} is not an unsigned 64-bit"):
            unsigned_ids_tensor([bad])
