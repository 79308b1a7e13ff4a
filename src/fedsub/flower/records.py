"""Submodels and row deltas as Flower ``ArrayRecord``s (names ``rows.<table>``,
``table.<table>``, ``dense.<name>``), and back as tensors."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord

from fedsub.submodel.params import Params


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
