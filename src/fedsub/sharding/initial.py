"""This process's rows of the initial model, drawn without drawing the whole tables.

The initial model must be the one-process model's, whose ``init`` draws each table with one
``torch.randn(rows, dim, generator=g)``. torch's CPU normal sampler turns a stream of uniforms
into normals in blocks of 16 (and redraws the last 16 values of a tensor whose size is not a
multiple of 16), so the same call cut into consecutive draws of whole blocks of 16 values (the
last one at least 16 values long) gives the same numbers and leaves the generator where the
whole draw does (tests/test_sharding.py checks this against the whole draw for every table
model). So ``init`` runs once more, with each table's ``randn`` drawn in such chunks, keeping
only this process's rows: the process never holds more than its shard and one chunk.

Which ``randn`` calls are tables is found by a first run of ``init`` on which ``randn``
returns tensors on the meta device (no memory): the calls whose shapes are the tables'
shapes. When that is ambiguous (a table drawn otherwise, or a dense parameter of a table's
shape drawn by ``randn`` too), or the first run fails, the model is drawn whole and cut.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fedsub.distributed import Processes
from fedsub.sharding.partition import RowPartition
from fedsub.sharding.rounds import ShardParams, shard
from fedsub.submodel.params import Params

CHUNK_VALUES = 1 << 20  # about how many values one chunk of a table's draw holds


def _shape(args: tuple) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(int(x) for x in args[0])
    return tuple(int(x) for x in args)


class _OnMeta(TorchFunctionMode):
    """``torch.randn`` returns an empty meta tensor; every call's shape is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.randn:
            shape = _shape(args)
            self.shapes.append(shape)
            return torch.empty(shape, dtype=kwargs.get("dtype"), device="meta")
        return func(*args, **kwargs)


class _RowsOnly(TorchFunctionMode):
    """``torch.randn`` of a table's shape keeps only ``keep[shape]``'s rows of the draw."""

    def __init__(self, keep: dict[tuple[int, ...], range]) -> None:
        super().__init__()
        self.keep = keep

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.randn:
            shape = _shape(args)
            if shape in self.keep:  # (the mode is off while it handles a call)
                return rows_of_randn(shape, self.keep[shape], kwargs)
        return func(*args, **kwargs)


def rows_of_randn(shape: tuple[int, ...], keep: range, kwargs: dict[str, Any]) -> torch.Tensor:
    """Rows ``keep`` of ``torch.randn(*shape, **kwargs)``, drawn in chunks of whole blocks of
    16 values (the generator ends where the whole draw leaves it)."""
    rows, per_row = shape[0], math.prod(shape[1:])
    if rows * per_row < 2 * CHUNK_VALUES:  # small: the whole draw, cut
        return torch.randn(shape, **kwargs)[keep.start : keep.stop].clone()
    step = 16 * max(1, CHUNK_VALUES // (16 * per_row))  # rows per chunk: 16 k values
    kept = torch.empty(
        (len(keep), *shape[1:]), dtype=kwargs.get("dtype"), device=kwargs.get("device")
    )
    start = 0
    while start < rows:
        size = min(step, rows - start)
        if (rows - start - size) * per_row < 16:  # a last chunk under 16 values: join it
            size = rows - start
        chunk = torch.randn((size, *shape[1:]), **kwargs)
        low, high = max(keep.start, start), min(keep.stop, start + size)
        if low < high:  # copied into place: no list of pieces to concatenate (twice the shard)
            kept[low - keep.start : high - keep.start] = chunk[low - start : high - start]
        start += size
    return kept


def drawn_shapes(
    init: Callable[[torch.Generator], Params], generator: Callable[[], torch.Generator]
) -> Params:
    """``init(generator())`` with every ``torch.randn`` on the meta device: the model's
    tensors' names, shapes and dtypes without the memory of the tables it draws that way
    (what checking a model file needs, runs/initial_model.py); drawn whole when that fails."""
    try:
        with _OnMeta():
            return init(generator())
    except Exception:
        return init(generator())


def sharded_init(
    init: Callable[[torch.Generator], Params],
    generator: Callable[[], torch.Generator],
    processes: Processes,
) -> ShardParams:
    """This process's share of ``init(generator())`` (the whole model's draw), drawing only its
    rows of each table when the tables can be told apart (see the module's docstring)."""
    probe = _OnMeta()
    try:
        with probe:
            shapes = init(generator())
    except Exception:
        return shard(init(generator()), processes)
    tables = {t: tuple(v.shape) for t, v in shapes.tables.items()}
    drawn = Counter(probe.shapes)
    wanted = Counter(tables.values())
    metas = all(v.is_meta for v in shapes.tables.values())
    if not metas or any(drawn[s] != n for s, n in wanted.items()):
        return shard(init(generator()), processes)
    keep = {s: RowPartition(s[0], processes.world_size).range_of(processes.rank) for s in wanted}
    with _RowsOnly(keep):
        mine = init(generator())
    partitions = {t: RowPartition(s[0], processes.world_size) for t, s in tables.items()}
    return ShardParams(mine.tables, mine.dense, partitions, processes.rank)
