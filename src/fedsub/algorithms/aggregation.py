"""Combine a round's client updates into one server update.

For each row ``m`` of a table touched this round::

    aggregate[m] = coef[m] * sum_{k in C_r, m in S(k)} a_k * delta_k[m]

with ``coef = 1`` for FedAvg or FedSubAvg's heat coefficients, and ``a_k`` a client
weighting (``algorithms/weighting.py``: samples, uniform, scheme2, original). An aggregation
rule (``algorithms/aggregation_rules.py``) builds the ``Aggregation``: its weighting, its
coefficients, and, for a rule whose combine step is not this weighted sum, that step.

Dense parameters use coefficient 1. The work is one concatenation and one scatter over the
round's rows: O(sum_k |S(k)|).

Li et al.'s Scheme II averages *models*, ``w_{t+1} = (N/K) sum_{k in S_t} p_k w_k``, which also
rescales the previous global model by ``f = (N/K) sum_{S_t} p_k`` (f != 1 on unbalanced data).
An aggregation with ``model_average`` records f on its ``ServerUpdate`` (``model_scale``), and
``as_model_delta`` turns the update into ``w_{t+1} - w_t = (f - 1) w_t + (N/K) sum p_k delta_k``
over every row of the model (O(M) per round), so any server optimizer applies it unchanged
and server SGD with lr 1 gives the paper's model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from fedsub import device as device_lib
from fedsub.algorithms.weighting import WEIGHTINGS, CohortMembers, Weighting
from fedsub.numerics import segment_sum
from fedsub.numerics.finite import any_nonfinite
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import CohortUpdate

__all__ = ["CohortMembers", "Weighting"]  # re-exported: older imports name this module


@dataclass(frozen=True)
class RowUpdate:
    """An update to some rows of a table: ``rows`` sorted unique, ``values`` [len(rows), dim]."""

    rows: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class ServerUpdate:
    """A round's aggregate. ``model_scale`` (a 0-d tensor): the factor f by which the round
    also rescales the previous global model (Scheme II's model average; ``as_model_delta``
    folds it in), None for a delta-form aggregate."""

    tables: dict[str, RowUpdate]
    dense: dict[str, torch.Tensor]
    model_scale: torch.Tensor | None = None

    def nonfinite(self) -> torch.Tensor:
        """A 0-d bool tensor on the update's device: whether any entry is NaN or Inf (no
        host read; ``is_finite`` reads it)."""
        return any_nonfinite([*(u.values for u in self.tables.values()), *self.dense.values()])

    def is_finite(self) -> bool:
        return not bool(self.nonfinite())


class RowUnion:
    """The distinct rows of a round (sorted) and each entry's position among them, as
    ``torch.unique(rows, return_inverse=True)`` gives. On the CPU in O(entries) time: a slot
    array as long as the largest row id seen (int32, 4 bytes per row), allocated once and
    never cleared, stands in for the sort (about 2x faster for a cohort's rows; every slot
    read was written first); on other devices ``torch.unique`` (a sort, where it is fast)."""

    def __init__(self) -> None:
        self.slots = np.empty(0, dtype=np.int32)

    def __call__(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not device_lib.on_host(rows) or len(rows) >= 2**31:  # int32 slots hold < 2^31 entries
            distinct, inverse = torch.unique(rows, sorted=True, return_inverse=True)
            return distinct, inverse
        values = rows.numpy()
        if len(values) == 0:
            return rows.clone(), rows.clone()
        top = int(values.max())
        if top >= len(self.slots):
            self.slots = np.empty(max(top + 1, 2 * len(self.slots)), dtype=np.int32)
        slots, positions = self.slots, np.arange(len(values), dtype=np.int32)
        slots[values] = positions  # the last position of each distinct row wins
        distinct = np.sort(values[slots[values] == positions])
        slots[distinct] = np.arange(len(distinct), dtype=np.int32)
        return torch.from_numpy(distinct), torch.from_numpy(slots[values].astype(np.int64))


class PendingUnion:
    """``torch.unique(rows, sorted=True, return_inverse=True)`` in two halves, so a GPU never
    waits for it: the device work (a sort, group numbers by a cumsum) now, and the result once
    the caller has read ``size`` (the number of distinct rows, a 0-d device tensor) together
    with its other reads; ``torch.unique`` itself reads that size from the device."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.sorted, self.order = torch.sort(rows, stable=True)
        starts = torch.ones_like(self.sorted, dtype=torch.bool)
        starts[1:] = self.sorted[1:] != self.sorted[:-1]
        self.group = torch.cumsum(starts, 0) - 1  # each sorted entry's distinct row
        self.size = starts.sum()

    def finish(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(distinct rows sorted, each entry's position among them), given ``size``."""
        inverse = torch.empty_like(self.group).index_copy_(0, self.order, self.group)
        distinct = self.sorted.new_empty(size)
        distinct.scatter_(0, self.group, self.sorted)  # repeats write the same row id
        return distinct, inverse


@dataclass(frozen=True)
class Aggregation:
    """How to weight clients and, optionally, per-row correction coefficients per table.

    ``population_weight`` (sum of w_k over all N clients) and ``num_clients`` (N) are needed
    by the "scheme2" and "original" weightings only. ``model_average``: the round averages
    models, rescaling the old model by the sum of the weights (Li et al.'s Scheme II).
    ``combine_step``: a rule's own combine step in place of the weighted sum (None: the
    weighted sum, ``weighted_sum``)."""

    weighting: Weighting
    coefficients: dict[str, torch.Tensor] | None = None
    population_weight: float = 0.0
    num_clients: int = 0
    model_average: bool = False
    union: RowUnion = field(default_factory=RowUnion, compare=False, repr=False)
    combine_step: Callable[[CohortUpdate, Aggregation], ServerUpdate] | None = field(
        default=None, compare=False
    )

    def to(self, device: torch.device) -> Aggregation:
        """The same aggregation with its row coefficients on ``device``."""
        if self.coefficients is None:
            return self
        moved = {t: c.to(device) for t, c in self.coefficients.items()}
        return dataclasses.replace(self, coefficients=moved)


def client_weights(cohort: CohortMembers, weighting: Weighting) -> torch.Tensor:
    """``a_k`` for each cohort member (float64), for a weighting that needs no population
    totals."""
    piece = WEIGHTINGS[weighting]
    if piece.reads_totals:
        raise ValueError(f"weighting {weighting!r} needs the population: use aggregation_weights")
    return piece.weights(cohort, Aggregation(weighting))


def aggregation_weights(cohort: CohortMembers, aggregation: Aggregation) -> torch.Tensor:
    return WEIGHTINGS[aggregation.weighting].weights(cohort, aggregation)


def with_coefficients(
    tables: dict[str, RowUpdate], coefficients: dict[str, torch.Tensor]
) -> dict[str, RowUpdate]:
    """Each row's aggregate times its table's per-row coefficient (FedSubAvg's heat
    correction), read where the coefficients live (the device, or the host when
    ``execution.table_placement = "host"``)."""
    scaled = {}
    for table, update in tables.items():
        coef = coefficients[table].index_select(0, update.rows)
        values = update.values * coef.to(update.values.dtype).unsqueeze(1)
        scaled[table] = RowUpdate(update.rows, values)
    return scaled


def aggregate(cohort: CohortUpdate, aggregation: Aggregation) -> ServerUpdate:
    """The round's server update: the rule's own combine step, or the weighted sum."""
    if aggregation.combine_step is not None:
        return aggregation.combine_step(cohort, aggregation)
    return weighted_sum(cohort, aggregation)


def weighted_sum(cohort: CohortUpdate, aggregation: Aggregation) -> ServerUpdate:
    """Per touched row ``coef[m] * sum_k a_k delta_k[m]``; dense: ``sum_k a_k delta_k``."""
    weights = aggregation_weights(cohort, aggregation)
    tables: dict[str, RowUpdate] = {}
    for table, rows in cohort.rows.items():
        deltas = cohort.table_deltas[table]
        row_weight = weights.to(deltas.dtype).index_select(0, cohort.row_owner[table])
        known = cohort.unions.get(table) if cohort.unions else None  # the backend's
        unique_rows, inverse = known if known is not None else aggregation.union(rows)
        summed = deltas.new_zeros((len(unique_rows), deltas.shape[1]))
        segment_sum.index_add_(summed, inverse, deltas * row_weight.unsqueeze(1))
        tables[table] = RowUpdate(unique_rows, summed)
    if aggregation.coefficients is not None:
        tables = with_coefficients(tables, aggregation.coefficients)
    dense = {}
    for name, stacked in cohort.dense_deltas.items():
        a = weights.to(stacked.dtype).reshape(-1, *([1] * (stacked.dim() - 1)))
        dense[name] = (a * stacked).sum(0)
    return ServerUpdate(tables, dense, weights.sum() if aggregation.model_average else None)


def as_model_delta(update: ServerUpdate, params: Params) -> ServerUpdate:
    """A model-average update (``model_scale`` f set) as the change of the global model:
    ``(f - 1) X + aggregate`` on every row of every table and every dense parameter, so
    ``X + that`` is ``f X + aggregate``. O(M) per round. A delta-form update is returned as
    is."""
    if update.model_scale is None:
        return update
    tables = {}
    for table, values in params.tables.items():
        change = values * (update.model_scale.to(values.device, values.dtype) - 1)
        row_update = update.tables.get(table)
        if row_update is not None:
            rows = row_update.rows.to(values.device)
            segment_sum.index_add_(change, rows, row_update.values.to(values.device))
        rows = torch.arange(len(values), device=values.device)
        tables[table] = RowUpdate(rows, change)
    dense = {}
    for name, value in params.dense.items():
        scale = update.model_scale.to(value.device, value.dtype) - 1
        dense[name] = value * scale + update.dense[name].to(value.device)
    return ServerUpdate(tables, dense)
