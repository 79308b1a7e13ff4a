"""Client work, the sequential reference: I local SGD steps of batch size B on one submodel."""

from __future__ import annotations

import numpy as np
import torch

from fedsub.data.federated import SampleSet
from fedsub.models.base import Batch, Model, forward
from fedsub.submodel.params import Params


def local_sgd(
    model: Model,
    params: Params,
    samples: SampleSet,
    schedule: np.ndarray,
    lr: float,
) -> Params:
    """Plain SGD on ``params`` (modified in place and returned), one step per schedule row.

    Each step's loss is the mean over its batch, so the step is ``x -= lr * grad``.
    """
    tensors = params.tensors()
    dtype = tensors[0].dtype
    for t in tensors:
        t.requires_grad_(True)
    for step_indices in schedule:
        batch = Batch.from_samples(samples.take(step_indices), dtype)
        loss = model.loss(forward(model, params, batch), batch.labels)
        grads = torch.autograd.grad(loss, tensors)
        with torch.no_grad():
            for t, g in zip(tensors, grads, strict=True):
                t.sub_(lr * g)
    for t in tensors:
        t.requires_grad_(False)
    return params
