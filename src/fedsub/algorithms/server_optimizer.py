"""Server optimizers: apply a round's aggregate (a ``ServerUpdate``, the mean delta) to the
global model. The pseudo-gradient is the negated aggregate (zero for rows no client touched).

``ServerSGD`` and the lazy adaptive optimizers touch only the rows the round touched:
O(touched rows x dim) per round. Reddi et al.'s adaptive optimizers (``TorchServerOptimizer``,
``ServerYogi``) and ``ServerMomentum`` keep moving every row through their moments, so each
round costs O(table rows x dim), the O(RM) overhead seed 002's appendix E attributes to FedAdam.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from fedsub import segment_sum
from fedsub.algorithms.aggregation import RowUpdate, ServerUpdate
from fedsub.errors import FedsubError
from fedsub.stateful import Stateful
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import scatter_add_rows


class ServerOptimizer(Stateful, Protocol):
    """Applies a round's aggregate; its state (``Stateful``) is the checkpoint's "server"."""

    def apply(self, params: Params, update: ServerUpdate) -> None: ...


@runtime_checkable
class RowLocal(Protocol):
    """A server optimizer that says whether its step reads and writes only the rows the
    round's update touched (and their per-row state): what ``train.table_placement = "host"``
    needs, as only those rows travel to the device (engine/placement.py)."""

    @property
    def row_local(self) -> bool: ...


def _torch_optimizer_tensors(optimizer: torch.optim.Optimizer, prefix: str) -> dict:
    return {
        f"{prefix}.{index}.{key}": value
        for index, state in optimizer.state_dict()["state"].items()
        for key, value in state.items()
    }


def _load_torch_optimizer(optimizer: torch.optim.Optimizer, prefix: str, tensors: dict) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith(prefix + "."):
            index, key = name[len(prefix) + 1 :].split(".", 1)
            state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict(
        {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}
    )


@dataclass(frozen=True)
class ServerSGD:
    """``X[rows] += lr * aggregate``; lr = 1 is plain averaging. Cost O(touched rows)."""

    lr: float = 1.0
    row_local = True

    def apply(self, params: Params, update: ServerUpdate) -> None:
        for table, row_update in update.tables.items():
            scatter_add_rows(params.tables[table], row_update.rows, self.lr * row_update.values)
        for name, delta in update.dense.items():
            params.dense[name].add_(self.lr * delta)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        pass


class RowwiseTorchOptimizer:
    """A real ``torch.optim`` optimizer applied to only the touched rows of a table.

    Per-row state (e.g. Adam's moments) lives in full-table tensors; each round the touched
    rows and their state are gathered into a small leaf tensor, one ``step()`` of a fresh
    optimizer runs on it with the saved state, and rows and state are scattered back. The
    step count is global (one per round), as in ``torch.optim.SparseAdam``. When every row
    is touched every round this is exactly the dense optimizer; otherwise untouched rows keep
    their state and do not move (lazy). Cost per round: O(touched rows x dim).
    """

    def __init__(self, make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        self.make = make
        self.row_state: dict[str, torch.Tensor] = {}
        self.shared_state: dict[str, Any] = {}

    def step(self, table: torch.Tensor, rows: torch.Tensor, gradient: torch.Tensor) -> None:
        x = table.index_select(0, rows)
        optimizer = self.make([x])
        if self.shared_state or self.row_state:
            optimizer.state[x] = {
                **{k: v.clone() for k, v in self.shared_state.items()},
                **{k: v.index_select(0, rows) for k, v in self.row_state.items()},
            }
        x.grad = gradient
        optimizer.step()
        for key, value in optimizer.state[x].items():
            if torch.is_tensor(value) and value.shape == x.shape:
                if key not in self.row_state:
                    self.row_state[key] = torch.zeros_like(table)
                self.row_state[key].index_copy_(0, rows, value)
            else:
                self.shared_state[key] = value
        table.index_copy_(0, rows, x.detach())

    def state_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            **{f"{prefix}.row.{k}": v for k, v in self.row_state.items()},
            **{f"{prefix}.shared.{k}": v for k, v in self.shared_state.items()},
        }

    def load_state_tensors(self, prefix: str, tensors: dict[str, torch.Tensor]) -> None:
        for name, value in tensors.items():
            if name.startswith(f"{prefix}.row."):
                self.row_state[name[len(prefix) + 5 :]] = value.clone()
            elif name.startswith(f"{prefix}.shared."):
                self.shared_state[name[len(prefix) + 8 :]] = value.clone()


def _torch_factory(
    kind: Literal["adam", "adagrad"], lr: float, beta1: float, beta2: float, tau: float
) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    if kind == "adam":
        return lambda ps: torch.optim.Adam(ps, lr=lr, betas=(beta1, beta2), eps=tau)
    if kind == "adagrad":
        return lambda ps: torch.optim.Adagrad(ps, lr=lr, eps=tau)
    raise ValueError(f"unknown torch server optimizer {kind!r}")


def dense_pseudo_gradient(table: torch.Tensor, update: RowUpdate | None) -> torch.Tensor:
    """The negated aggregate over the whole table: zeros for rows no client touched."""
    gradient = torch.zeros_like(table)
    if update is not None:
        gradient.index_copy_(0, update.rows, -update.values.to(table.dtype))
    return gradient


def _require_form(tensors: dict[str, torch.Tensor], lazy: bool) -> None:
    """A saved state of the other form (full-model vs lazy) would load as empty moments and
    silently restart them: refuse it instead."""
    full = any(name.startswith("full.") for name in tensors)
    if tensors and full == lazy:
        saved, wanted = ("full-model", "lazy") if full else ("lazy", "full-model")
        raise FedsubError(
            f"the checkpoint holds a {saved} adaptive server optimizer's state, but this run's "
            f"optimizer is {wanted} (fedadam/fedyogi/fedadagrad are full-model, the -lazy "
            "names and lazy = true are lazy); resume with the matching algorithm or start over"
        )


class TorchServerOptimizer:
    """FedAdam / FedAdagrad of Reddi et al. (2021): ``torch.optim.Adam`` / ``Adagrad`` over
    the FULL model, the pseudo-gradient being the negated aggregate with zeros for untouched
    rows. Every row's moments decay every round and every row moves by its moment ratio, as
    in the paper (and as seed 002 compares against). Cost per round: O(table rows x dim).

    torch's conventions hold: Adam has bias correction, Adagrad has no first moment."""

    row_local = False  # every row's moments decay and every row moves, every round

    def __init__(
        self,
        kind: Literal["adam", "adagrad"],
        params: Params,
        lr: float,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
    ) -> None:
        make = _torch_factory(kind, lr, beta1, beta2, tau)
        self.optimizer = make([*params.tables.values(), *params.dense.values()])

    def apply(self, params: Params, update: ServerUpdate) -> None:
        for name, table in params.tables.items():
            table.grad = dense_pseudo_gradient(table, update.tables.get(name))
        for name, tensor in params.dense.items():
            tensor.grad = -update.dense[name]
        self.optimizer.step()
        for tensor in [*params.tables.values(), *params.dense.values()]:
            tensor.grad = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return _torch_optimizer_tensors(self.optimizer, "full")

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        _require_form(tensors, lazy=False)
        _load_torch_optimizer(self.optimizer, "full", tensors)


class LazyTorchServerOptimizer:
    """fedsub's lazy variant of FedAdam / FedAdagrad (``fedadam-lazy``, ``lazy = true``).

    Dense parameters: ``torch.optim.Adam`` / ``Adagrad`` stepped as usual. Tables: the same
    optimizer on the touched rows only (``RowwiseTorchOptimizer``, SparseAdam-style): rows
    no client touched keep their value and their moments. Per round O(touched rows x dim).
    """

    row_local = True

    def __init__(
        self,
        kind: Literal["adam", "adagrad"],
        params: Params,
        lr: float,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
    ) -> None:
        make = _torch_factory(kind, lr, beta1, beta2, tau)
        self.dense = make(list(params.dense.values())) if params.dense else None
        self.tables = {name: RowwiseTorchOptimizer(make) for name in params.tables}

    def apply(self, params: Params, update: ServerUpdate) -> None:
        for name, row_update in update.tables.items():
            self.tables[name].step(params.tables[name], row_update.rows, -row_update.values)
        if self.dense is not None:
            for name, tensor in params.dense.items():
                tensor.grad = -update.dense[name]
            self.dense.step()
            for tensor in params.dense.values():
                tensor.grad = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {}
        for name, rowwise in self.tables.items():
            tensors.update(rowwise.state_tensors(f"table.{name}"))
        if self.dense is not None:
            tensors.update(_torch_optimizer_tensors(self.dense, "dense"))
        return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        _require_form(tensors, lazy=True)
        for name, rowwise in self.tables.items():
            rowwise.load_state_tensors(f"table.{name}", tensors)
        if self.dense is not None:
            _load_torch_optimizer(self.dense, "dense", tensors)


class ServerYogi:
    """FedYogi (Reddi et al. 2021, Algorithm 2), written out (torch.optim has no Yogi)::

        m = beta1 m + (1 - beta1) u;   v = v - (1 - beta2) u^2 sign(v - u^2)
        X = X + lr * m / (sqrt(v) + tau)          with u the aggregate, m0 = 0, v0 = tau^2

    Default: over the full model, u = 0 for untouched rows (their m decays and they keep
    moving), O(table rows x dim) per round. ``lazy``: only touched rows' state and values
    are updated (fedsub's variant), O(touched rows x dim).
    """

    def __init__(
        self,
        params: Params,
        lr: float,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
        lazy: bool = False,
    ) -> None:
        self.lr, self.beta1, self.beta2, self.tau, self.lazy = lr, beta1, beta2, tau, lazy
        self.row_local = lazy
        self.m = {n: torch.zeros_like(t) for n, t in {**params.tables, **params.dense}.items()}
        self.v = {
            n: torch.full_like(t, tau**2) for n, t in {**params.tables, **params.dense}.items()
        }

    def _step(self, m: torch.Tensor, v: torch.Tensor, u: torch.Tensor) -> tuple:
        m = self.beta1 * m + (1 - self.beta1) * u
        u2 = u * u
        v = v - (1 - self.beta2) * u2 * torch.sign(v - u2)
        return m, v, self.lr * m / (v.sqrt() + self.tau)

    def apply(self, params: Params, update: ServerUpdate) -> None:
        for name, table in params.tables.items():
            row_update = update.tables.get(name)
            if self.lazy:
                if row_update is None:
                    continue
                rows = row_update.rows
                m, v, step = self._step(self.m[name][rows], self.v[name][rows], row_update.values)
                self.m[name][rows], self.v[name][rows] = m, v
                segment_sum.index_add_(table, rows, step)
            else:
                u = -dense_pseudo_gradient(table, row_update)
                self.m[name], self.v[name], step = self._step(self.m[name], self.v[name], u)
                table.add_(step)
        for name, u in update.dense.items():
            self.m[name], self.v[name], step = self._step(self.m[name], self.v[name], u)
            params.dense[name].add_(step)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {
            **{f"m.{k}": v for k, v in self.m.items()},
            **{f"v.{k}": v for k, v in self.v.items()},
        }

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in self.m:
            self.m[name] = tensors[f"m.{name}"].clone()
            self.v[name] = tensors[f"v.{name}"].clone()


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
