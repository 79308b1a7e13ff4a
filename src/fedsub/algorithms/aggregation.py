"""Combine a round's client updates into one server update.

For each row ``m`` of a table touched this round::

    aggregate[m] = coef[m] * sum_{k in C_r, m in S(k)} a_k * delta_k[m]

with ``a_k = w_k / sum_{k in C_r} w_k`` ("samples") or ``1 / K`` ("uniform"), and
``coef = 1`` for FedAvg or FedSubAvg's heat coefficients. Dense parameters use coefficient 1.
The work is one concatenation and one scatter over the round's rows: O(sum_k |S(k)|).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedsub.submodel.transfer import ClientUpdate

Weighting = Literal["samples", "uniform"]


@dataclass(frozen=True)
class RowUpdate:
    """An update to some rows of a table: ``rows`` sorted unique, ``values`` [len(rows), dim]."""

    rows: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class ServerUpdate:
    tables: dict[str, RowUpdate]
    dense: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Aggregation:
    """How to weight clients and, optionally, per-row correction coefficients per table."""

    weighting: Weighting
    coefficients: dict[str, torch.Tensor] | None = None


def client_weights(updates: list[ClientUpdate], weighting: Weighting) -> list[float]:
    if weighting == "uniform":
        return [1.0 / len(updates)] * len(updates)
    total = sum(u.weight for u in updates)
    return [u.weight / total for u in updates]


def aggregate(updates: list[ClientUpdate], aggregation: Aggregation) -> ServerUpdate:
    if not updates:
        raise ValueError("cannot aggregate an empty round")
    weights = client_weights(updates, aggregation.weighting)
    tables: dict[str, RowUpdate] = {}
    for table in updates[0].rows:
        rows = torch.cat([u.rows[table] for u in updates])
        values = torch.cat(
            [a * u.table_deltas[table] for a, u in zip(weights, updates, strict=True)]
        )
        unique_rows, inverse = torch.unique(rows, return_inverse=True)
        summed = values.new_zeros((len(unique_rows), values.shape[1]))
        summed.index_add_(0, inverse, values)
        if aggregation.coefficients is not None:
            coef = aggregation.coefficients[table].index_select(0, unique_rows)
            summed *= coef.to(summed.dtype).unsqueeze(1)
        tables[table] = RowUpdate(unique_rows, summed)
    dense = {
        name: torch.stack(
            [a * u.dense_deltas[name] for a, u in zip(weights, updates, strict=True)]
        ).sum(0)
        for name in updates[0].dense_deltas
    }
    return ServerUpdate(tables, dense)
