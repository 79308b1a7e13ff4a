"""The discrete Gaussian N_Z(0, sigma^2): P(X = x) proportional to exp(-x^2 / (2 sigma^2)) on the
integers (Canonne, Kamath and Steinke 2020, "The discrete Gaussian for differential privacy").

Sampled by their rejection method (their Algorithm 3): with t = floor(sigma) + 1, draw Y from
the discrete Laplace P(Y = y) proportional to exp(-|y| / t) and keep it with probability
exp(-(|Y| - sigma^2 / t)^2 / (2 sigma^2)); a kept Y has exactly the discrete Gaussian's law.
Y is drawn as the difference of two independent geometric counts G with
P(G = k) = (1 - e^{-1/t}) e^{-k/t}, k >= 0, whose difference has the discrete Laplace law.

fedsub's form, vectorized over numpy: the geometric draws and the acceptance test use floating
point (the paper's sampler is exact in rational arithmetic); each probability is off by at most
a few ulps, far below what a statistical test or the accountant resolves. Each proposal is kept
with probability >= about 0.37 (the paper's bound on the rejection rate), so a batch of size
n needs about 2.7 n proposals on average.
"""

from __future__ import annotations

import math

import numpy as np


def discrete_laplace(scale: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of P(Y = y) proportional to exp(-|y| / scale) (int64)."""
    success = -math.expm1(-1.0 / scale)  # 1 - e^{-1/t}
    # numpy's geometric counts trials (>= 1): minus one counts the failures before a success
    first = rng.geometric(success, size) - 1
    second = rng.geometric(success, size) - 1
    return (first - second).astype(np.int64)


def sample(sigma: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` independent draws of N_Z(0, sigma^2) (int64), from ``rng`` only."""
    if not sigma > 0:
        raise ValueError(f"the discrete Gaussian needs sigma > 0, got {sigma}")
    t = math.floor(sigma) + 1
    kept: list[np.ndarray] = []
    wanted = size
    while wanted > 0:
        batch = int(wanted * 3 + 16)  # >= 2.7 proposals per draw on average
        y = discrete_laplace(t, batch, rng)
        accept = np.exp(-((np.abs(y) - sigma**2 / t) ** 2) / (2 * sigma**2))
        chosen = y[rng.random(batch) < accept][:wanted]
        kept.append(chosen)
        wanted -= len(chosen)
    return np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)
