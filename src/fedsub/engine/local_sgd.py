"""Client work, the sequential reference: I local steps of batch size B on one submodel."""

from __future__ import annotations

import numpy as np
import torch

from fedsub.client.layout import OneClient
from fedsub.client.transforms import Chain, Members
from fedsub.data.federated import SampleSet
from fedsub.models.base import Batch, Model, forward
from fedsub.profiling import timed
from fedsub.submodel.params import Params


def local_sgd(
    model: Model,
    params: Params,
    samples: SampleSet,
    schedule: np.ndarray,
    chain: Chain,
    lr: float,
    correction: Params | None = None,
) -> Params:
    """Steps of ``chain`` on ``params`` (modified in place and returned), one per schedule row.

    ``lr`` is this client's learning rate; the proximal anchor is ``params`` as given."""
    tensors = params.tensors()
    members = Members(
        OneClient(),
        np.array([lr], dtype=np.float64),
        correction.tensors() if correction is not None else None,
    )
    dtype = tensors[0].dtype
    with torch.no_grad():
        state = chain.init(tensors, members)
    for t in tensors:
        t.requires_grad_(True)
    for step_indices in schedule:
        with timed("forward"):
            batch = Batch.from_samples(samples.take(step_indices), dtype, tensors[0].device)
            loss = model.loss(forward(model, params, batch), batch.labels)
        with timed("backward"):
            grads = list(torch.autograd.grad(loss, tensors))
        with torch.no_grad(), timed("client rule"):
            state = chain.step(grads, state, tensors, members)
    for t in tensors:
        t.requires_grad_(False)
    return params
