"""Submodels and row deltas as Flower ``ArrayRecord``s (names ``rows.<table>``,
``table.<table>``, ``dense.<name>``), and back as tensors."""

from __future__ import annotations

from typing import TypeVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedsub.errors import FedsubError
from fedsub.submodel.params import Params

AnyRecord = TypeVar("AnyRecord", ArrayRecord, MetricRecord, ConfigRecord)


def submodel_record(rows: dict[str, torch.Tensor], submodel: Params) -> ArrayRecord:
    """A node's rows S(k) per table, those rows' values, and the dense parameters."""
    tensors = {f"rows.{t}": r for t, r in rows.items()}
    tensors.update({f"table.{t}": v for t, v in submodel.tables.items()})
    tensors.update({f"dense.{n}": v for n, v in submodel.dense.items()})
    return ArrayRecord(tensors)


def read_submodel(record: ArrayRecord) -> tuple[dict[str, torch.Tensor], Params]:
    flat = record.to_torch_state_dict()
    rows = {k[len("rows.") :]: v for k, v in flat.items() if k.startswith("rows.")}
    return rows, Params.from_state_dict(
        {k: v for k, v in flat.items() if not k.startswith("rows.")}
    )


def deltas_record(table_deltas: dict[str, torch.Tensor], dense_deltas: dict[str, torch.Tensor]):
    return ArrayRecord(Params(table_deltas, dense_deltas).state_dict())


def read_deltas(record: ArrayRecord) -> Params:
    return Params.from_state_dict(record.to_torch_state_dict())


def record_of(content: RecordDict, key: str, kind: type[AnyRecord]) -> AnyRecord:
    """``content[key]``, checked to be a ``kind``: a message from another node may hold any."""
    record = content[key]
    if not isinstance(record, kind):
        raise FedsubError(
            f"Flower: the message's {key!r} is a {type(record).__name__}, expected {kind.__name__}"
        )
    return record


def number_of(record: MetricRecord | ConfigRecord, key: str) -> int | float:
    """``record[key]``, checked to be one number (not a list, text or flag)."""
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FedsubError(f"Flower: the message's {key!r} is {value!r}, expected a number")
    return value
