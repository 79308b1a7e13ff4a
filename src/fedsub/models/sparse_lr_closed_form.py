"""Sparse logistic regression's cohort gradients in closed form, two kernels of one formula.

For K clients' batches (labels [K, B]), ``ids[field]`` the K * B samples' row ids one after
another and ``sample_of_id[field]`` the sample of each id::

    logit  = bias + sum over fields of the sample's weights (+ dense_inputs . dense_weight)
    r      = (sigmoid(logit) - y) / B                  d (batch-mean loss) / d logit
    grad_w = sum of r over the occurrences of each row; grad_bias = sum of r per client

Both sums run in float64 and are cast to the labels' dtype. ``torch_gradients`` is the
device-generic kernel; ``numpy_gradients`` computes the same sums in the same order (tanh and
einsum may round the last float64 bit differently) on zero-copy numpy views of CPU
tensors: a closed-form step is ~20 tiny ops, and torch's per-op overhead on the CPU makes the
torch kernel about 1.7x slower there (benchmark (a) runs it 10 times a round).
``SparseLogisticRegression.cohort_gradients`` picks by device.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsub.numerics import segment_sum

Grads = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]


def torch_gradients(
    field_tables: dict[str, str],
    dense_dim: int,
    tables: dict[str, torch.Tensor],
    dense: dict[str, torch.Tensor],
    ids: dict[str, torch.Tensor],
    sample_of_id: dict[str, torch.Tensor],
    dense_inputs: torch.Tensor | None,
    labels: torch.Tensor,
) -> Grads:
    k, batch = labels.shape
    f64 = torch.float64
    bias = dense["bias"]  # [K, 1]; float32 + float64 adds in float64
    logits = None
    for name, values in ids.items():  # bias + each field's sum, in that order
        weight = tables[field_tables.get(name, name)].index_select(0, values)
        sums = segment_sum.segment_sum(sample_of_id[name], weight.view(-1).to(f64), k * batch)
        logits = (bias if logits is None else logits) + sums.view(k, batch)
    if logits is None:
        logits = bias.to(f64).expand(k, batch)
    if dense_dim and dense_inputs is not None:
        logits = logits + torch.einsum("kbd,kd->kb", dense_inputs, dense["dense_weight"])
    # r = (sigmoid - y) / B with sigmoid = 0.5 * (1 + tanh(logit / 2)) (never overflows)
    residual = torch.tanh(logits * 0.5).mul_(0.5).add_(0.5).sub_(labels).div_(batch)
    flat = residual.view(-1)
    table_grads: dict[str, torch.Tensor] = {}
    for name, values in ids.items():
        table = field_tables.get(name, name)
        grad = segment_sum.segment_sum(
            values, flat.index_select(0, sample_of_id[name]), len(tables[table])
        )
        table_grads[table] = grad + table_grads[table] if table in table_grads else grad
    dense_grads = {"bias": residual.sum(1, keepdim=True)}
    if "dense_weight" in dense:
        dense_grads["dense_weight"] = (
            flat.new_zeros(dense["dense_weight"].shape)
            if dense_inputs is None
            else torch.einsum("kbd,kb->kd", dense_inputs.to(f64), residual)
        )
    dtype = labels.dtype
    return (
        {
            t: table_grads[t].to(dtype).unsqueeze(1) if t in table_grads else torch.zeros_like(v)
            for t, v in tables.items()
        },
        {n: g.to(dtype) for n, g in dense_grads.items()},
    )


def numpy_gradients(
    field_tables: dict[str, str],
    dense_dim: int,
    tables: dict[str, torch.Tensor],
    dense: dict[str, torch.Tensor],
    ids: dict[str, torch.Tensor],
    sample_of_id: dict[str, torch.Tensor],
    dense_inputs: torch.Tensor | None,
    labels: torch.Tensor,
) -> Grads:
    """``torch_gradients`` for CPU tensors, on numpy views (``np.bincount``)."""
    k, batch = labels.shape
    logits = np.repeat(dense["bias"].detach().numpy().astype(np.float64), batch, axis=1)
    for name, values in ids.items():
        weight = tables[field_tables.get(name, name)].detach().numpy()[:, 0]
        sums = np.bincount(
            sample_of_id[name].numpy(), weights=weight[values.numpy()], minlength=k * batch
        )
        logits += sums.reshape(k, batch)
    inputs = None if dense_inputs is None else dense_inputs.numpy()
    if dense_dim and inputs is not None:
        logits += np.einsum("kbd,kd->kb", inputs, dense["dense_weight"].detach().numpy())
    sigmoid = 0.5 * (1.0 + np.tanh(0.5 * logits))
    residual = (sigmoid - labels.numpy()) / batch
    flat = residual.reshape(-1)
    table_grads: dict[str, np.ndarray] = {}
    for name, values in ids.items():
        table = field_tables.get(name, name)
        grad = np.bincount(
            values.numpy(), weights=flat[sample_of_id[name].numpy()], minlength=len(tables[table])
        )
        table_grads[table] = grad + table_grads[table] if table in table_grads else grad
    dense_grads = {"bias": residual.sum(1, keepdims=True)}
    if "dense_weight" in dense:
        dense_grads["dense_weight"] = (
            np.zeros(dense["dense_weight"].shape)
            if inputs is None
            else np.einsum("kbd,kb->kd", inputs, residual)
        )
    dtype = labels.numpy().dtype
    return (
        {
            t: torch.from_numpy(table_grads[t].astype(dtype, copy=False)[:, None])
            if t in table_grads
            else torch.zeros_like(v)
            for t, v in tables.items()
        },
        {n: torch.from_numpy(g.astype(dtype, copy=False)) for n, g in dense_grads.items()},
    )
