"""The discrete Gaussian N_Z(0, sigma^2): P(X = x) proportional to exp(-x^2 / (2 sigma^2)) on the
integers (Canonne, Kamath and Steinke 2020, "The discrete Gaussian for differential privacy").

Sampled by their rejection method (their Algorithm 3): with t = floor(sigma) + 1, draw Y from
the discrete Laplace P(Y = y) proportional to exp(-|y| / t) and keep it with probability
exp(-(|Y| - sigma^2 / t)^2 / (2 sigma^2)); a kept Y has exactly the discrete Gaussian's law.
Y is drawn as the difference of two independent geometric counts G with
P(G = k) = (1 - e^{-1/t}) e^{-k/t}, k >= 0, whose difference has the discrete Laplace law;
each G by inversion, G = floor(-t ln U) with U uniform on (0, 1]: P(G >= k) = P(U <= e^{-k/t})
= e^{-k/t} (about 10 times faster than numpy's geometric sampler).

fedsub's form, vectorized over numpy: the geometric draws and the acceptance test use floating
point (the paper's sampler is exact in rational arithmetic); each probability is off by at most
a few ulps, far below what a statistical test or the accountant resolves. About 70-76% of the
proposals are kept for sigma >= 1 (measured: 0.70 at sigma 1.5, 0.76 at 40 and 2.4e6), so a
batch of n draws takes about 1.4 n proposals.
"""

from __future__ import annotations

import math

import numpy as np


def discrete_laplace(scale: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of P(Y = y) proportional to exp(-|y| / scale) (int64)."""
    # 1 - U is uniform on (0, 1]: its log is finite
    first = np.floor(-scale * np.log1p(-rng.random(size)))
    second = np.floor(-scale * np.log1p(-rng.random(size)))
    return (first - second).astype(np.int64)


def sample(sigma: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` independent draws of N_Z(0, sigma^2) (int64), from ``rng`` only."""
    if not sigma > 0:
        raise ValueError(f"the discrete Gaussian needs sigma > 0, got {sigma}")
    t = math.floor(sigma) + 1
    kept: list[np.ndarray] = []
    wanted = size
    while wanted > 0:
        batch = int(wanted * 1.5 + 16)  # about 70-76% are kept (sigma >= 1); the rest redrawn
        y = discrete_laplace(t, batch, rng)
        accept = np.exp(-((np.abs(y) - sigma**2 / t) ** 2) / (2 * sigma**2))
        chosen = y[rng.random(batch) < accept][:wanted]
        kept.append(chosen)
        wanted -= len(chosen)
    return np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)
