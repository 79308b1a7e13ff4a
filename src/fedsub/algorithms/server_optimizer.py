"""Server optimizers apply a ``ServerUpdate`` (the aggregated pseudo-gradient, negated) to the
global model. Plain averaging is SGD with learning rate 1: ``X[rows] += update``."""

from __future__ import annotations

from dataclasses import dataclass

from fedsub.algorithms.aggregation import ServerUpdate
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import scatter_add_rows


@dataclass(frozen=True)
class ServerSGD:
    lr: float = 1.0

    def apply(self, params: Params, update: ServerUpdate) -> None:
        for table, row_update in update.tables.items():
            scatter_add_rows(params.tables[table], row_update.rows, self.lr * row_update.values)
        for name, delta in update.dense.items():
            params.dense[name].add_(self.lr * delta)
