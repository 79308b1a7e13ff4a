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

from fedsub.submodel.transfer import CohortUpdate

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


def client_weights(cohort: CohortUpdate, weighting: Weighting) -> torch.Tensor:
    """``a_k`` for each cohort member (float64, summing to 1)."""
    if weighting == "uniform":
        return torch.full((len(cohort),), 1.0 / len(cohort), dtype=torch.float64)
    return cohort.weights / cohort.weights.sum()


def aggregate(cohort: CohortUpdate, aggregation: Aggregation) -> ServerUpdate:
    weights = client_weights(cohort, aggregation.weighting)
    tables: dict[str, RowUpdate] = {}
    for table, rows in cohort.rows.items():
        deltas = cohort.table_deltas[table]
        row_weight = weights.to(deltas.dtype).index_select(0, cohort.row_owner[table])
        unique_rows, inverse = torch.unique(rows, return_inverse=True)
        summed = deltas.new_zeros((len(unique_rows), deltas.shape[1]))
        summed.index_add_(0, inverse, deltas * row_weight.unsqueeze(1))
        if aggregation.coefficients is not None:
            coef = aggregation.coefficients[table].index_select(0, unique_rows)
            summed *= coef.to(summed.dtype).unsqueeze(1)
        tables[table] = RowUpdate(unique_rows, summed)
    dense = {}
    for name, stacked in cohort.dense_deltas.items():
        a = weights.to(stacked.dtype).reshape(-1, *([1] * (stacked.dim() - 1)))
        dense[name] = (a * stacked).sum(0)
    return ServerUpdate(tables, dense)
