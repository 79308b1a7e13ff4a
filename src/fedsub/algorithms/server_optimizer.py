"""Server optimizers: apply a round's aggregate (a ``ServerUpdate``, the mean delta) to the
global model.

``ServerSGD`` and the lazy adaptive optimizers touch only the rows the round touched:
O(touched rows x dim) per round. Reddi et al.'s adaptive optimizers over the full model
(``algorithms/adaptive.py``) and ``ServerMomentum`` keep moving every row through their
moments, so each round costs O(table rows x dim), the O(RM) overhead seed 002's appendix E
attributes to FedAdam.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from fedsub.algorithms.aggregation import RowUpdate, ServerUpdate
from fedsub.numerics import segment_sum
from fedsub.stateful import Stateful
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import scatter_add_rows


class ServerOptimizer(Stateful, Protocol):
    """Applies a round's aggregate; its state (``Stateful``) is the checkpoint's "server"."""

    def apply(self, params: Params, update: ServerUpdate) -> None: ...


@runtime_checkable
class RowLocal(Protocol):
    """A server optimizer that says whether its step reads and writes only the rows the
    round's update touched (and their per-row state): what ``execution.table_placement = "host"``
    needs, as only those rows travel to the device (engine/placement.py)."""

    @property
    def row_local(self) -> bool: ...


def every_row(row_update: RowUpdate, table: torch.Tensor) -> bool:
    """Whether ``row_update`` changes every row of ``table`` (its rows, sorted and distinct,
    as many as the table's: 0 .. V - 1), so that ``table[rows] += values`` is ``table +=
    values``: the same additions, one per entry, without the scatter. Not on a deterministic
    run, whose scatter sums through a segment sum (0 + v, which can differ from v in a zero's
    sign)."""
    return len(row_update.rows) == len(table) and not segment_sum.deterministic()


@dataclass(frozen=True)
class ServerSGD:
    """``X[rows] += lr * aggregate``; lr = 1 is plain averaging. Cost O(touched rows)."""

    lr: float = 1.0
    row_local = True

    def apply(self, params: Params, update: ServerUpdate) -> None:
        for table, row_update in update.tables.items():
            values = row_update.values if self.lr == 1.0 else self.lr * row_update.values
            target = params.tables[table]
            if every_row(row_update, target):  # a dense update (DP's rows = "all")
                target.add_(values.to(target.dtype))
            else:
                scatter_add_rows(target, row_update.rows, values)
        for name, delta in update.dense.items():
            params.dense[name].add_(delta if self.lr == 1.0 else self.lr * delta)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        pass


class ServerMomentum:
    """SCAFFOLD's server-side approximation for CTR tasks (seed 002, appendix D.2, eq. 47)::

        global update = beta * previous global update + (1 - beta) * aggregate,  beta = (N-K)/N
        X = X + lr * global update

    The previous update keeps moving every row it ever touched, so each round costs
    O(table rows x dim) (one fused pass over the momentum buffers), not O(touched rows).
    """

    row_local = False

    def __init__(self, params: Params, beta: float, lr: float = 1.0) -> None:
        self.beta, self.lr = beta, lr
        self.previous = {
            n: torch.zeros_like(t) for n, t in {**params.tables, **params.dense}.items()
        }

    def apply(self, params: Params, update: ServerUpdate) -> None:
        for buffer in self.previous.values():
            buffer.mul_(self.beta)
        for name, row_update in update.tables.items():
            segment_sum.index_add_(
                self.previous[name], row_update.rows, (1 - self.beta) * row_update.values
            )
        for name, u in update.dense.items():
            self.previous[name].add_((1 - self.beta) * u)
        for name, table in params.tables.items():
            table.add_(self.lr * self.previous[name])
        for name, tensor in params.dense.items():
            tensor.add_(self.lr * self.previous[name])

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"previous.{k}": v for k, v in self.previous.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in self.previous:
            self.previous[name] = tensors[f"previous.{name}"].clone()
