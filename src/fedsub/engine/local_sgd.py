"""Client work, the sequential reference: I local steps of batch size B on one submodel."""

from __future__ import annotations

import numpy as np
import torch

from fedsub.client.local_rule import LocalRule, clip_scale, descend
from fedsub.data.federated import SampleSet
from fedsub.models.base import Batch, Model, forward
from fedsub.submodel.params import Params


def local_sgd(
    model: Model,
    params: Params,
    samples: SampleSet,
    schedule: np.ndarray,
    rule: LocalRule,
    lr: float,
    correction: Params | None = None,
) -> Params:
    """Steps of ``rule`` on ``params`` (modified in place and returned), one per schedule row.

    ``lr`` is this client's learning rate; the proximal anchor is ``params`` as given."""
    tensors = params.tensors()
    anchor = [t.clone() for t in tensors] if rule.mu else None
    offsets = correction.tensors() if correction is not None else None
    buffers = [torch.zeros_like(t) for t in tensors] if rule.momentum else None
    dtype = tensors[0].dtype
    for t in tensors:
        t.requires_grad_(True)
    for step_indices in schedule:
        batch = Batch.from_samples(samples.take(step_indices), dtype, tensors[0].device)
        loss = model.loss(forward(model, params, batch), batch.labels)
        grads = list(torch.autograd.grad(loss, tensors))
        with torch.no_grad():
            if anchor is not None:
                grads = [
                    g + rule.mu * (t - a) for g, t, a in zip(grads, tensors, anchor, strict=True)
                ]
            if rule.clip_norm:
                scale = clip_scale(sum(g.pow(2).sum() for g in grads), rule.clip_norm)
                grads = [g * scale for g in grads]
            descend(rule, tensors, grads, [lr] * len(tensors), offsets, buffers)
    for t in tensors:
        t.requires_grad_(False)
    return params
