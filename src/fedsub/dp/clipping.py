"""Each cohort member's whole update (its row deltas and dense deltas together) clipped to L2
norm C: delta_k * min(1, C / ||delta_k||) (McMahan et al. 2018), optionally times a capped
weight w_k <= 1, so every member's contribution to the sum has norm <= C."""

from __future__ import annotations

import dataclasses

import torch

from fedsub.submodel.transfer import CohortUpdate


def clip_factors(squared_norms: torch.Tensor, clip: float) -> torch.Tensor:
    """min(1, C / ||delta_k||) per member (1 for a zero update), float64."""
    norms = squared_norms.to(torch.float64).sqrt()
    return torch.clamp(clip / torch.clamp(norms, min=torch.finfo(torch.float64).tiny), max=1.0)


def capped_weights(sample_counts: torch.Tensor, cap: float) -> torch.Tensor:
    """w_k = min(1, n_k / cap) (McMahan et al.'s capped weights); all 1 when cap is 0."""
    counts = sample_counts.to(torch.float64)
    if cap <= 0:
        return torch.ones_like(counts)
    return torch.clamp(counts / cap, max=1.0)


def scaled(update: CohortUpdate, factors: torch.Tensor) -> CohortUpdate:
    """The update with member k's deltas times ``factors[k]`` (a new ``CohortUpdate``)."""
    tables = {}
    for table, deltas in update.table_deltas.items():
        row_factor = factors.to(deltas.dtype).index_select(0, update.row_owner[table])
        tables[table] = deltas * row_factor.unsqueeze(1)
    dense = {}
    for name, stacked in update.dense_deltas.items():
        dense[name] = stacked * factors.to(stacked.dtype).reshape(-1, *([1] * (stacked.dim() - 1)))
    return dataclasses.replace(update, table_deltas=tables, dense_deltas=dense)
