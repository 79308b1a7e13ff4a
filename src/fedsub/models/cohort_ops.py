"""Building blocks for heads written once for a whole cohort (leading client axis K).

A per-client ``head`` is then the cohort head with K = 1, so both backends run one code path
per model and the batched engine needs no vmap for it.
"""

from __future__ import annotations

import torch

from fedsub.models.low_rank import LowRankWeight


def linear(
    x: torch.Tensor, weight: torch.Tensor | LowRankWeight, bias: torch.Tensor
) -> torch.Tensor:
    """Per-client affine map: x [K, ..., in], weight [K, in, out] (or the batched engine's
    ``LowRankWeight``: the global weight plus each client's low-rank change), bias [K, out]."""
    if isinstance(weight, LowRankWeight):
        return weight.linear(x, bias)
    k = x.shape[0]
    flat = torch.baddbmm(bias.unsqueeze(1), x.reshape(k, -1, x.shape[-1]), weight)
    return flat.reshape(*x.shape[:-1], weight.shape[-1])


def single_client(
    cohort_head,
    dense: dict,
    features: dict,
    dense_inputs=None,
    packed: frozenset[str] = frozenset(),
) -> torch.Tensor:
    """Run a cohort head on one client's parameters and batch (``packed``: the features that
    are packed rows, which take no client axis; models/base.py: PackedFeatures)."""
    one = {n: v.unsqueeze(0) for n, v in dense.items()}
    inputs = None if dense_inputs is None else dense_inputs.unsqueeze(0)
    batch = {n: f if n in packed else f.unsqueeze(0) for n, f in features.items()}
    return cohort_head(one, batch, inputs)[0]
