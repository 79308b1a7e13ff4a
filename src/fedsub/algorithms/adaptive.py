"""Reddi et al.'s adaptive server optimizers (2021, "Adaptive Federated Optimization",
Algorithm 2), written out. With ``Delta_t`` the round's aggregate (the mean delta)::

    m_t = b1 m_{t-1} + (1 - b1) Delta_t
    FedAdagrad: v_t = v_{t-1} + Delta_t^2
    FedYogi:    v_t = v_{t-1} - (1 - b2) Delta_t^2 sign(v_{t-1} - Delta_t^2)
    FedAdam:    v_t = b2 v_{t-1} + (1 - b2) Delta_t^2
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)          m_0 = 0, v_0 = tau^2

No bias correction (torch.optim.Adam has one), and FedAdagrad keeps the b1 first moment
(torch.optim.Adagrad has none). ``AdaptiveServer`` applies a rule over the full model, as
the paper does (Delta_t = 0 for rows no client touched: their m decays and they keep moving,
O(M) per round), or ``lazy`` (fedsub's variant): a table's untouched rows keep their value and
their m and v, O(touched rows x dim) per round; dense parameters are always updated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from fedsub.algorithms.aggregation import ServerUpdate
from fedsub.errors import FedsubError
from fedsub.submodel.params import Params

AdaptiveKind = Literal["adam", "adagrad", "yogi"]


@dataclass(frozen=True)
class AdaptiveRule:
    """One of Reddi et al.'s three rules (``beta2`` is unused by Adagrad)."""

    kind: AdaptiveKind
    lr: float
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    def second_moment(self, v: torch.Tensor, squared: torch.Tensor) -> torch.Tensor:
        if self.kind == "adagrad":
            return v + squared
        if self.kind == "yogi":
            return v - (1 - self.beta2) * squared * torch.sign(v - squared)
        if self.kind == "adam":
            return self.beta2 * v + (1 - self.beta2) * squared
        raise ValueError(f"unknown adaptive rule {self.kind!r}")

    def step(
        self, m: torch.Tensor, v: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(m_t, v_t, the model's change ``eta m_t / (sqrt(v_t) + tau)``) from the round's
        aggregate ``delta``."""
        m = self.beta1 * m + (1 - self.beta1) * delta
        v = self.second_moment(v, delta * delta)
        return m, v, self.lr * m / (v.sqrt() + self.tau)


# what fedsub's earlier torch.optim-based FedAdam / FedAdagrad saved (step counts, exp_avg, sum)
_TORCH_STATE = re.compile(r"^(full\.\d+\.|dense\.\d+\.|table\..+\.(row|shared)\.)")


class AdaptiveServer:
    """FedAdam / FedAdagrad / FedYogi (``rule``) over the full model, or ``lazy``.

    State: ``m`` and ``v`` for every table and dense parameter (full size in both forms: the
    lazy form keeps each row's own), saved as ``<rule>.<form>.m.<name>`` and ``.v.``."""

    def __init__(self, params: Params, rule: AdaptiveRule, lazy: bool = False) -> None:
        self.rule, self.lazy = rule, lazy
        self.row_local = lazy  # lazy: only the round's rows and their state are read
        tensors = {**params.tables, **params.dense}
        self.m = {n: torch.zeros_like(t) for n, t in tensors.items()}
        self.v = {n: torch.full_like(t, rule.tau**2) for n, t in tensors.items()}

    @property
    def prefix(self) -> str:
        """The state's name prefix: the rule and the form (a checkpoint of another rule or
        form is then refused by name)."""
        return f"{self.rule.kind}.{'lazy' if self.lazy else 'full'}"

    def apply(self, params: Params, update: ServerUpdate) -> None:
        for name, table in params.tables.items():
            row_update = update.tables.get(name)
            if self.lazy:
                if row_update is None:
                    continue
                rows, delta = row_update.rows, row_update.values.to(table.dtype)
                m, v = self.m[name].index_select(0, rows), self.v[name].index_select(0, rows)
                m, v, step = self.rule.step(m, v, delta)
                self.m[name].index_copy_(0, rows, m)
                self.v[name].index_copy_(0, rows, v)
                table.index_copy_(0, rows, table.index_select(0, rows) + step)
                continue
            delta = torch.zeros_like(table)  # Delta_t = 0 on the rows no client touched
            if row_update is not None:
                delta.index_copy_(0, row_update.rows, row_update.values.to(table.dtype))
            self.m[name], self.v[name], step = self.rule.step(self.m[name], self.v[name], delta)
            table.add_(step)
        for name, tensor in params.dense.items():
            delta = update.dense[name].to(tensor.dtype)
            self.m[name], self.v[name], step = self.rule.step(self.m[name], self.v[name], delta)
            tensor.add_(step)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {
            **{f"{self.prefix}.m.{n}": t for n, t in self.m.items()},
            **{f"{self.prefix}.v.{n}": t for n, t in self.v.items()},
        }

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if any(_TORCH_STATE.match(name) for name in tensors):
            raise FedsubError(
                "the checkpoint holds the state of fedsub's earlier torch.optim-based "
                "FedAdam / FedAdagrad (bias-corrected Adam, Adagrad without a first moment), "
                "not Reddi et al.'s rules this version runs; its moments do not convert, so "
                "start the run over (or resume it with the fedsub version that wrote it)"
            )
        other = f"{self.rule.kind}.{'full' if self.lazy else 'lazy'}."
        if any(name.startswith(other) for name in tensors):
            saved, wanted = ("full-model", "lazy") if self.lazy else ("lazy", "full-model")
            raise FedsubError(
                f"the checkpoint holds a {saved} adaptive server optimizer's state, but this "
                f"run's optimizer is {wanted} (fedadam/fedyogi/fedadagrad are full-model, the "
                "-lazy names and lazy = true are lazy); resume with the matching algorithm or "
                "start over"
            )
        if self.rule.kind == "yogi" and all(n.startswith(("m.", "v.")) for n in tensors):
            # fedsub's earlier FedYogi: the same rule, saved without rule and form
            tensors = {f"{self.prefix}.{name}": value for name, value in tensors.items()}
        expected = set(self.state_tensors())
        if set(tensors) != expected:
            raise ValueError(
                f"adaptive server state: expected tensors {sorted(expected)}, got {sorted(tensors)}"
            )
        for name in self.m:
            self.m[name] = tensors[f"{self.prefix}.m.{name}"].clone()
            self.v[name] = tensors[f"{self.prefix}.v.{name}"].clone()
