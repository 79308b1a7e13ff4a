"""Each cohort member's whole update (its row deltas and dense deltas together) clipped to L2
norm C: delta_k * min(1, C / ||delta_k||) (McMahan et al. 2018), optionally times a capped
weight w_k <= 1, so every member's contribution to the sum has norm <= C.

On the CPU the per-member factors are computed in numpy after torch's square root (the same
IEEE operations as torch's: max, reciprocal then product (torch's scalar / tensor), min, each
exact or correctly rounded in both; torch's vectorised sqrt is kept, as it is not always the
correctly rounded one numpy computes), a few numpy calls costing less than torch's on a
cohort's few dozen numbers."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from fedsub.submodel.transfer import CohortUpdate

TINY = torch.finfo(torch.float64).tiny


def clip_factors(squared_norms: torch.Tensor, clip: float) -> torch.Tensor:
    """min(1, C / ||delta_k||) per member (1 for a zero update), float64."""
    norms = squared_norms.to(torch.float64).sqrt()  # torch's (its vectorised sqrt is not
    # always numpy's correctly rounded one)
    if norms.device.type == "cpu":  # the same operations in numpy (module docstring)
        factors = norms.numpy()  # the round's own (sqrt made it)
        np.maximum(factors, TINY, out=factors)  # NaN stays NaN, as torch.clamp keeps it
        np.divide(1.0, factors, out=factors)  # torch's C / x: reciprocal(x) * C, two roundings
        np.multiply(factors, clip, out=factors)
        np.minimum(factors, 1.0, out=factors)
        return torch.from_numpy(factors)
    return torch.clamp(clip / torch.clamp(norms, min=TINY), max=1.0)


def clipped(factors: torch.Tensor) -> int:
    """How many members were clipped (factor < 1)."""
    if factors.device.type == "cpu":
        return int(np.count_nonzero(factors.numpy() < 1))
    return int((factors < 1).sum())


def capped_weights(sample_counts: torch.Tensor, cap: float) -> torch.Tensor:
    """w_k = min(1, n_k / cap) (McMahan et al.'s capped weights); all 1 when cap is 0."""
    counts = sample_counts.to(torch.float64)
    if cap <= 0:
        return torch.ones_like(counts)
    return torch.clamp(counts / cap, max=1.0)


def scaled(update: CohortUpdate, factors: torch.Tensor) -> CohortUpdate:
    """The update with member k's deltas times ``factors[k]`` (a new ``CohortUpdate``); the
    factors converted once per dtype."""
    converted: dict[torch.dtype, torch.Tensor] = {}

    def of(dtype: torch.dtype) -> torch.Tensor:
        if dtype not in converted:
            converted[dtype] = factors.to(dtype)
        return converted[dtype]

    tables = {}
    for table, deltas in update.table_deltas.items():
        row_factor = of(deltas.dtype).index_select(0, update.row_owner[table])
        tables[table] = deltas * row_factor.unsqueeze(1)
    dense = {}
    for name, stacked in update.dense_deltas.items():
        dense[name] = stacked * of(stacked.dtype).reshape(-1, *([1] * (stacked.dim() - 1)))
    return dataclasses.replace(update, table_deltas=tables, dense_deltas=dense)
