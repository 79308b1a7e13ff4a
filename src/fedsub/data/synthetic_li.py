"""``synthetic-li``: synthetic(alpha, beta) of Li et al. (seed 004, appendix D), after Sahu et al.

For each of N devices: ``u_k ~ N(0, alpha)``, entries of ``W_k`` [10 x 60] and ``b_k`` [10]
``~ N(u_k, 1)``; ``B_k ~ N(0, beta)``, ``v_k ~ N(B_k, 1)`` (a 60-vector); samples
``x ~ N(v_k, diag(j^-1.2))``, ``y = argmax(W_k x + b_k)``; sample counts
``floor(LogNormal(4, 2)) + 50`` (a power law). alpha and beta are standard deviations, as in
Sahu et al.'s generator (for the papers' values 0 and 1 the two readings coincide). Each
device's samples are split into train / test at random (``test_fraction``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet


@dataclass(frozen=True)
class SyntheticLiOptions:
    alpha: float = field(default=0.0, metadata={"min": 0.0})
    """How much the devices' models differ (synthetic(alpha, beta))."""
    beta: float = field(default=0.0, metadata={"min": 0.0})
    """How much the devices' data differ."""
    num_devices: int = field(default=100, metadata={"min": 2, "max": 10**6})
    """Devices (clients), with power-law sizes."""
    dim: int = field(default=60, metadata={"min": 1, "max": 10**6})
    """Dense features per sample."""
    classes: int = field(default=10, metadata={"min": 2, "max": 10**5})
    """Classes."""
    test_fraction: float = field(default=0.2, metadata={"min": 0.0, "max": 0.9})
    """Each device's share of samples held out into the pooled test set."""


def generate(options: SyntheticLiOptions, seed: int) -> FederatedDataset:
    o = options
    rng = np.random.default_rng([seed, 0x11])
    counts = np.floor(rng.lognormal(4, 2, size=o.num_devices)).astype(np.int64) + 50
    std = np.arange(1, o.dim + 1) ** -0.6  # variance j^-1.2
    train_parts, test_parts = [], []
    for n in counts:
        u = rng.normal(0, o.alpha)
        weights = rng.normal(u, 1, size=(o.classes, o.dim))
        bias = rng.normal(u, 1, size=o.classes)
        v = rng.normal(rng.normal(0, o.beta), 1, size=o.dim)
        x = rng.normal(v, std, size=(n, o.dim)).astype(np.float32)
        y = np.argmax(x @ weights.T + bias, axis=1).astype(np.float32)
        test = np.zeros(n, dtype=bool)
        test[rng.choice(n, size=min(round(n * o.test_fraction), n - 1), replace=False)] = True
        train_parts.append(SampleSet({}, y[~test], x[~test]))
        test_parts.append(SampleSet({}, y[test], x[test]))
    return FederatedDataset.from_clients(
        f"synthetic-li({o.alpha:g},{o.beta:g})", {}, train_parts, SampleSet.concat(test_parts)
    )
