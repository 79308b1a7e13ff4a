"""Pull a client's submodel out of the global model and push its row deltas back.

A pull gathers ``X[S(k)]`` per table (a copy of |S(k)| rows) and the dense parameters; a push
is the difference between the trained local model and what was pulled. Nothing here touches a
row outside ``S(k)``, so a round costs O(sum_k |S(k)|), never O(table rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedsub.submodel.params import Params


@dataclass
class ClientUpdate:
    """What a client sends back: its rows, their deltas, dense deltas, its sample count."""

    client: int
    weight: float
    rows: dict[str, torch.Tensor]
    table_deltas: dict[str, torch.Tensor]
    dense_deltas: dict[str, torch.Tensor]


def pull(global_params: Params, rows: dict[str, torch.Tensor]) -> Params:
    """The client's local model: its rows of each table (copied) and the dense parameters."""
    return Params(
        tables={t: global_params.tables[t].index_select(0, rows[t]) for t in global_params.tables},
        dense={name: p.clone() for name, p in global_params.dense.items()},
    )


def push(
    client: int,
    weight: float,
    rows: dict[str, torch.Tensor],
    pulled: Params,
    trained: Params,
) -> ClientUpdate:
    """Row and dense deltas ``trained - pulled`` of one client."""
    return ClientUpdate(
        client=client,
        weight=weight,
        rows=rows,
        table_deltas={t: trained.tables[t] - pulled.tables[t] for t in pulled.tables},
        dense_deltas={n: trained.dense[n] - pulled.dense[n] for n in pulled.dense},
    )


def scatter_add_rows(table: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``table[rows] += values`` in place; rows may repeat (their values add up)."""
    table.index_add_(0, rows, values.to(table.dtype))
