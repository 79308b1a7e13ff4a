"""Pull a client's submodel out of the global model and push its row deltas back.

A pull gathers ``X[S(k)]`` per table (a copy of |S(k)| rows) and the dense parameters; a push
is the difference between the trained local model and what was pulled. Nothing here touches a
row outside ``S(k)``, so a round costs O(sum_k |S(k)|), never O(table rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Self

import torch

from fedsub.numerics import segment_sum
from fedsub.numerics.finite import any_nonfinite
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
        tables={t: global_params.gather_rows(t, rows[t]) for t in global_params.tables},
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
    segment_sum.index_add_(table, rows, values)


class Updates(Protocol):
    """What the round reads of a cohort's updates, whatever their form (a ``CohortUpdate``;
    width slices' ``MaskedCohortUpdate``; the clock's buffer): who the members are, the checks
    that screen them (engine/guards.py), and the updates of a subset of them. A combine that
    reads one form narrows to it by name (engine/contribution.py's ``taking``)."""

    @property
    def clients(self) -> torch.Tensor:
        """The members' client ids, in cohort order."""
        ...

    def __len__(self) -> int: ...

    def squared_norms(self) -> torch.Tensor:
        """Each member's squared update norm."""
        ...

    def nonfinite(self) -> torch.Tensor:
        """A 0-d bool tensor: whether any member's update holds NaN or Inf."""
        ...

    def select(self, members: list[int]) -> Self:
        """The updates of a subset of the members, renumbered in the given order."""
        ...


@dataclass
class CohortUpdate:
    """A round's pushes, concatenated: what the aggregator works on.

    Per table, ``rows`` is every cohort member's S(k) one after another and ``row_owner`` the
    cohort position of each of those rows; ``table_deltas`` the matching delta rows. Dense
    deltas are stacked on a leading cohort axis. ``weights`` are the members' sample counts.
    """

    clients: torch.Tensor
    weights: torch.Tensor
    multiplicity: torch.Tensor
    rows: dict[str, torch.Tensor]
    row_owner: dict[str, torch.Tensor]
    table_deltas: dict[str, torch.Tensor]
    dense_deltas: dict[str, torch.Tensor]
    # per table, ``torch.unique(rows, sorted=True, return_inverse=True)`` when the backend
    # computed it already (the batched backend on a GPU, without a host sync); else None
    unions: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return len(self.clients)

    def select(self, members: list[int]) -> CohortUpdate:
        """The updates of a subset of the members (in the given order)."""
        device = self.clients.device
        index = torch.tensor(members, dtype=torch.int64, device=device)
        rows, owner, deltas = {}, {}, {}
        for t in self.rows:
            spans = [self.member_rows(t, j) for j in members]
            rows[t] = torch.cat([self.rows[t][s] for s in spans])
            deltas[t] = torch.cat([self.table_deltas[t][s] for s in spans])
            owner[t] = torch.repeat_interleave(
                torch.arange(len(members), device=device),
                torch.tensor([s.stop - s.start for s in spans], device=device),
            )
        return CohortUpdate(
            clients=self.clients[index],
            weights=self.weights[index],
            multiplicity=self.multiplicity[index],
            rows=rows,
            row_owner=owner,
            table_deltas=deltas,
            dense_deltas={n: v[index] for n, v in self.dense_deltas.items()},
        )

    def squared_norms(self) -> torch.Tensor:
        """Each member's ||delta||^2 over its rows and the dense parameters (float64).

        Per row / member norms accumulated in float64 without a float64 copy of the deltas
        (``vector_norm``'s ``dtype``): a cohort's dense deltas are tens of MB, and writing a
        converted copy, then its squares, cost more than the round's aggregation."""
        norms = torch.zeros(len(self), dtype=torch.float64, device=self.clients.device)
        if len(self) == 0:  # a cohort of nobody (an empty Poisson draw under DP)
            return norms
        for t, deltas in self.table_deltas.items():
            segment_sum.index_add_(norms, self.row_owner[t], _squared_norms(deltas))
        for deltas in self.dense_deltas.values():
            norms += _squared_norms(deltas.reshape(len(self), -1))
        return norms

    def nonfinite(self) -> torch.Tensor:
        """A 0-d bool tensor on the update's device: whether any delta is NaN or Inf (no host
        read)."""
        deltas = [*self.table_deltas.values(), *self.dense_deltas.values()]
        return any_nonfinite(deltas, self.clients.device)

    def member_rows(self, table: str, j: int) -> slice:
        """Where cohort member j's rows of ``table`` lie in the concatenated tensors."""
        owner = self.row_owner[table]
        start = int(torch.searchsorted(owner, j))
        return slice(start, int(torch.searchsorted(owner, j, right=True)))

    @staticmethod
    def from_clients(
        updates: list[ClientUpdate], multiplicity: torch.Tensor | None = None
    ) -> CohortUpdate:
        if not updates:
            raise ValueError("a cohort needs at least one client update")
        tables = updates[0].rows
        first = [*updates[0].rows.values(), *updates[0].dense_deltas.values()]
        device = first[0].device if first else torch.device("cpu")
        return CohortUpdate(
            clients=torch.tensor([u.client for u in updates], device=device),
            weights=torch.tensor([u.weight for u in updates], dtype=torch.float64, device=device),
            multiplicity=(
                torch.ones(len(updates), dtype=torch.int64, device=device)
                if multiplicity is None
                else multiplicity.to(device)
            ),
            rows={t: torch.cat([u.rows[t] for u in updates]) for t in tables},
            row_owner={
                t: torch.repeat_interleave(
                    torch.arange(len(updates), device=device),
                    torch.tensor([len(u.rows[t]) for u in updates], device=device),
                )
                for t in tables
            },
            table_deltas={t: torch.cat([u.table_deltas[t] for u in updates]) for t in tables},
            dense_deltas={
                n: torch.stack([u.dense_deltas[n] for u in updates])
                for n in updates[0].dense_deltas
            },
        )


def _squared_norms(rows: torch.Tensor) -> torch.Tensor:
    """[n]: each row's squared L2 norm, accumulated in float64."""
    return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64).square()


def empty_update(params: Params) -> CohortUpdate:
    """A cohort of nobody (an empty Poisson draw, every member rejected): what a round
    that combines all the same (a mechanism adding noise) combines."""
    device = next(iter([*params.tables.values(), *params.dense.values()])).device
    none = torch.zeros(0, dtype=torch.int64, device=device)
    return CohortUpdate(
        clients=none,
        weights=torch.zeros(0, dtype=torch.float64, device=device),
        multiplicity=none,
        rows={t: none for t in params.tables},
        row_owner={t: none for t in params.tables},
        table_deltas={t: v.new_zeros((0, v.shape[1])) for t, v in params.tables.items()},
        dense_deltas={n: v.new_zeros((0, *v.shape)) for n, v in params.dense.items()},
    )
