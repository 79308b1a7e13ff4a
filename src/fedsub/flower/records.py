"""Submodels and row deltas as Flower ``ArrayRecord``s (names ``rows.<table>``,
``table.<table>``, ``dense.<name>``), and back as tensors.

Every ArrayRecord fedsub sends is packed (``packed``): its tensors are one Flower ``Array``,
the safetensors file of them (key ``fedsub.safetensors``, stype ``safetensors``). Flower moves
a message as a tree of objects, one request per object per hop (each ``Array`` and its chunk
are two): a train message of three tensors was ten objects, packed it is six, and a round's
time on real processes is mostly those requests (benchmarks/flower_rounds.py). ``tensors_of``
reads a packed record and Flower's one-Array-per-tensor records alike, so a node running an
older fedsub is still understood; anything else a message holds is a ``FedsubError``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TypeVar

import numpy as np
import safetensors.torch
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.app.typing import ConfigRecordValues

from fedsub.errors import FedsubError
from fedsub.submodel.params import Params

AnyRecord = TypeVar("AnyRecord", ArrayRecord, MetricRecord, ConfigRecord)


PACKED = "fedsub.safetensors"  # the one Array of a packed ArrayRecord
PACKED_STYPE = "safetensors"  # its serialization (Flower's own arrays: "numpy.ndarray")


def packed(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """``tensors`` as an ArrayRecord of one Array: their safetensors file (the values bit for
    bit, each with its name, dtype and shape)."""
    own = {
        n: t.detach().cpu().clone(memory_format=torch.contiguous_format) for n, t in tensors.items()
    }
    data = safetensors.torch.save(own)
    array = Array(dtype="uint8", shape=(len(data),), stype=PACKED_STYPE, data=data)
    return ArrayRecord({PACKED: array})


def tensors_of(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """``record``'s tensors (a ``packed`` record's, or Flower's one Array per tensor); a
    ``FedsubError`` when they cannot be read (a message from another node may hold any
    bytes)."""
    try:
        if PACKED not in record:
            return dict(record.to_torch_state_dict())
        if len(record) != 1:
            raise FedsubError(f"its packed arrays come with {len(record) - 1} other array(s)")
        array = record[PACKED]
        if array.stype != PACKED_STYPE:
            raise FedsubError(f"its packed arrays are {array.stype[:40]!r}, not safetensors")
        return dict(safetensors.torch.load(array.data))
    except FedsubError:
        raise
    except Exception as error:  # numpy's, torch's, safetensors' errors on bytes that are no array
        raise FedsubError(f"its arrays cannot be read ({type(error).__name__})") from None


def submodel_record(rows: dict[str, torch.Tensor], submodel: Params) -> ArrayRecord:
    """A node's rows S(k) per table, those rows' values, and the dense parameters."""
    tensors = {f"rows.{t}": r for t, r in rows.items()}
    tensors.update({f"table.{t}": v for t, v in submodel.tables.items()})
    tensors.update({f"dense.{n}": v for n, v in submodel.dense.items()})
    return packed(tensors)


def read_submodel(record: ArrayRecord) -> tuple[dict[str, torch.Tensor], Params]:
    flat = tensors_of(record)
    rows = {k[len("rows.") :]: v for k, v in flat.items() if k.startswith("rows.")}
    return rows, Params.from_state_dict(
        {k: v for k, v in flat.items() if not k.startswith("rows.")}
    )


def deltas_record(table_deltas: dict[str, torch.Tensor], dense_deltas: dict[str, torch.Tensor]):
    return packed(Params(table_deltas, dense_deltas).state_dict())


def read_deltas(record: ArrayRecord) -> Params:
    return Params.from_state_dict(tensors_of(record))


def rows_record(rows: Mapping[str, np.ndarray | torch.Tensor]) -> ArrayRecord:
    """Row ids per table (``rows.<table>``), e.g. a node's S(k) or its request."""
    return packed({f"rows.{t}": torch.as_tensor(r) for t, r in rows.items()})


def rows_in(record: ArrayRecord, tables: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """The row ids per table of a ``rows_record``; with ``tables`` (name -> rows) checked:
    a known table's, 1-d integers, row ids below its rows (a ``FedsubError`` otherwise)."""
    flat = tensors_of(record)
    if tables is not None and (other := sorted(k for k in flat if not k.startswith("rows."))):
        raise FedsubError(f"its rows record holds {[k[:40] for k in other[:5]]}, not rows.*")
    rows = {k[len("rows.") :]: v for k, v in flat.items()}
    if tables is not None:
        for table, r in rows.items():
            if table not in tables:
                raise FedsubError(f"its rows name table {table[:40]!r}, not one of the model's")
            if r.ndim != 1 or r.is_floating_point() or r.dtype == torch.bool:
                raise FedsubError(f"its rows of table {table!r} are not a list of row ids")
            if len(r) and not 0 <= int(r.min()) <= int(r.max()) < tables[table]:
                raise FedsubError(
                    f"its rows of table {table!r} are not row ids below {tables[table]}"
                )
    return {t: v.numpy().astype(np.int64) for t, v in rows.items()}


def reply_row_ids(reply: Message, tables: Iterable[str]) -> dict[str, torch.Tensor]:
    """A reply's row ids of every table (its ``index`` record), checked to be 1-d integer
    tensors; a ``FedsubError`` saying what is wrong otherwise."""
    if "index" not in reply.content:
        raise FedsubError("its reply names no rows")
    index = tensors_of(record_of(reply.content, "index", ArrayRecord))
    rows = {}
    for table in tables:
        r = index.get(f"rows.{table}")
        if r is None or r.ndim != 1 or r.is_floating_point():
            raise FedsubError(f"no row ids for table {table!r} in its reply")
        rows[table] = r.to(torch.int64)
    return rows


def query_message(node: int, asked: Mapping[str, ConfigRecordValues], group: int = 0) -> Message:
    """A "query" Message asking ``node`` what ``asked`` says (its ``what``, the run's spec)."""
    content = RecordDict({"query": ConfigRecord(dict(asked))})
    return Message(content, node, MessageType.QUERY, group_id=str(group) if group else None)


def record_of(content: RecordDict, key: str, kind: type[AnyRecord]) -> AnyRecord:
    """``content[key]``, checked to be a ``kind``: a message from another node may hold any."""
    if key not in content:
        raise FedsubError(f"Flower: the message has no {key!r} record")
    record = content[key]
    if not isinstance(record, kind):
        raise FedsubError(
            f"Flower: the message's {key!r} is a {type(record).__name__}, expected {kind.__name__}"
        )
    return record


def number_of(record: MetricRecord | ConfigRecord, key: str) -> int | float:
    """``record[key]``, checked to be one number (not a list, text or flag)."""
    if key not in record:
        raise FedsubError(f"Flower: the message has no {key!r}")
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FedsubError(f"Flower: the message's {key!r} is {_short(value)}, expected a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise FedsubError(f"Flower: the message's {key!r} is {value!r}, expected a finite number")
    return value


def count_of(record: MetricRecord | ConfigRecord, key: str, below: int | None = None) -> int:
    """``record[key]``, checked to be a whole number >= 0 (and < ``below``)."""
    value = number_of(record, key)
    if value != int(value) or value < 0 or (below is not None and value >= below):
        bound = f" below {below}" if below is not None else ""
        raise FedsubError(
            f"Flower: the message's {key!r} is {value!r}, expected a whole number >= 0{bound}"
        )
    return int(value)


def _short(value: object) -> str:
    """``value``'s repr, cut to 60 characters (a reply may hold anything)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
