"""``li-quadratic``: the distributed ridge regression of seed 004's Theorem 4 (appendix C).

Global objective (23): ``F(w) = [w'Aw - 2b'w] / (2N) + mu/2 ||w||^2`` over ``w`` in
``R^(Np+1)``, ``A`` tridiagonal (2 on the diagonal, -1 beside it), ``b = e_1``. Device k holds
``A_k = X_k'X_k``: the path-graph Laplacian of its block ``I_k = {(k-1)p+1, ..., kp+1}``
(rows ``e_j - e_(j+1)``), plus ``e_1`` on device 1 and ``e_(Np+1)`` on device N, so that
``sum_k A_k = A``; ``b_1 = e_1`` (the label of device 1's ``e_1`` row is 1, every other label 0)
and ``F_k(w) = ||X_k w - y_k||^2 / 2 + mu/2 ||w||^2`` (C.3). As the paper says, every device
holds p + 1 samples (devices 2..N-1 get one zero row), and each row and label is scaled by
``sqrt(p + 1)`` so that ``linear-regression``'s loss, a mean over the device's samples, is
``||X_k w - y_k||^2 / 2``; ``train.weight_decay = mu`` adds the ridge term. With
``batch_size = p + 1`` every local step is the device's exact gradient, as Theorem 5 assumes.

The closed forms below are what the paper derives: the optimum ``w* = (A + N mu I)^-1 b`` and
the point FedAvg with full participation, E local steps and a constant learning rate eta
converges to, eq. (28) with ``A_k + mu I`` in place of ``A_k`` (the paper's mu > 0 case).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet


@dataclass(frozen=True)
class LiQuadraticOptions:
    num_devices: int = field(default=5, metadata={"min": 2, "max": 10_000})
    """N, the devices (seed 004's appendix C.2: 5)."""
    block: int = field(default=4, metadata={"min": 2, "max": 10_000})
    """p, the rows of each device's block of the path Laplacian (C.2: 4)."""


def device_rows(options: LiQuadraticOptions, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Device k's (0-based) ``X_k`` and labels ``y_k`` (unscaled, without padding)."""
    n, p = options.num_devices, options.block
    dim = n * p + 1
    rows, labels = [], []
    for j in range(k * p, k * p + p):
        row = np.zeros(dim)
        row[j], row[j + 1] = 1.0, -1.0
        rows.append(row)
        labels.append(0.0)
    for end, label in ((0, 1.0), (dim - 1, 0.0)):
        if (end == 0 and k == 0) or (end == dim - 1 and k == n - 1):
            row = np.zeros(dim)
            row[end] = 1.0
            rows.append(row)
            labels.append(label)
    return np.array(rows), np.array(labels)


def generate(options: LiQuadraticOptions, seed: int) -> FederatedDataset:
    """The N devices' scaled rows (p + 1 each); no test split (the objective is the metric).
    Deterministic: ``seed`` is unused."""
    p = options.block
    scale = math.sqrt(p + 1)
    parts = []
    for k in range(options.num_devices):
        x, y = device_rows(options, k)
        padding = p + 1 - len(x)
        x = np.vstack([x, np.zeros((padding, x.shape[1]))])
        y = np.concatenate([y, np.zeros(padding)])
        parts.append(SampleSet({}, scale * y, scale * x))
    dim = options.num_devices * p + 1
    empty = SampleSet({}, np.zeros(0), np.zeros((0, dim)))
    name = f"li-quadratic(N={options.num_devices},p={p})"
    return FederatedDataset.from_clients(name, {}, parts, empty)


def local_matrices(options: LiQuadraticOptions) -> list[np.ndarray]:
    """``A_k = X_k'X_k`` per device."""
    matrices = []
    for k in range(options.num_devices):
        x, _ = device_rows(options, k)
        matrices.append(x.T @ x)
    return matrices


def global_matrix(options: LiQuadraticOptions) -> np.ndarray:
    """``A = sum_k A_k``, tridiagonal."""
    return np.sum(local_matrices(options), axis=0)


def objective(options: LiQuadraticOptions, mu: float, w: np.ndarray) -> float:
    """F(w) of eq. (23)."""
    a = global_matrix(options)
    b = np.zeros(len(w))
    b[0] = 1.0
    return float((w @ a @ w - 2 * b @ w) / (2 * options.num_devices) + mu / 2 * w @ w)


def optimum(options: LiQuadraticOptions, mu: float) -> np.ndarray:
    """``w* = (A + N mu I)^-1 e_1``, the minimizer of F."""
    a = global_matrix(options)
    b = np.zeros(len(a))
    b[0] = 1.0
    return np.linalg.solve(a + options.num_devices * mu * np.eye(len(a)), b)


def fedavg_limit(options: LiQuadraticOptions, mu: float, lr: float, local_steps: int) -> np.ndarray:
    """Eq. (28) with ``A_k + mu I``: the fixed point of FedAvg (all N devices every round,
    E = ``local_steps`` full-gradient steps of constant ``lr``)."""
    matrices = local_matrices(options)
    n, dim = len(matrices), len(matrices[0])
    eye = np.eye(dim)
    steps = [eye - lr * (a + mu * eye) for a in matrices]
    mean_power = np.mean([np.linalg.matrix_power(s, local_steps) for s in steps], axis=0)
    b = np.zeros(dim)
    b[0] = 1.0
    drift = np.sum([np.linalg.matrix_power(steps[0], j) for j in range(local_steps)], axis=0) @ b
    return np.linalg.solve(eye - mean_power, lr / n * drift)
