"""Convergence diagnostics of seed 001, section 4.3 (seed 000's element-wise gradient norm).

For the full training objective f (the mean loss over every training sample, the weighted case
of appendix D.4) at the current global model: ``||grad f||^2`` and the preconditioned
``grad f^T D grad f`` with ``D = diag(coef)``, FedSubAvg's heat coefficients per table row
(``N / n_m`` or the sample-weighted form) and 1 for dense parameters.
"""

from __future__ import annotations

import torch

from fedsub.data.federated import SampleSet
from fedsub.models.base import Batch, Model, forward
from fedsub.submodel.params import Params

CHUNK = 65_536


def gradient_norms(
    model: Model, params: Params, samples: SampleSet, coefficients: dict[str, torch.Tensor]
) -> dict[str, float]:
    work = params.clone()
    tensors = [t.requires_grad_(True) for t in work.tensors()]
    grads = [torch.zeros_like(t) for t in tensors]
    dtype = tensors[0].dtype
    for start in range(0, len(samples), CHUNK):
        part = samples.slice(start, min(start + CHUNK, len(samples)))
        batch = Batch.from_samples(part, dtype, work.device)
        share = len(part) / len(samples)
        loss = model.loss(forward(model, work, batch), batch.labels) * share
        for total, g in zip(grads, torch.autograd.grad(loss, tensors), strict=True):
            total += g
    plain = sum(float(g.double().pow(2).sum()) for g in grads)
    preconditioned = 0.0
    for name, g in zip(work.tables, grads, strict=False):
        coefficient = coefficients[name].to(g.device).unsqueeze(1)
        preconditioned += float((coefficient * g.double().pow(2)).sum())
    for g in grads[len(work.tables) :]:
        preconditioned += float(g.double().pow(2).sum())
    return {"grad_norm_sq": plain, "precond_grad_norm_sq": preconditioned}
