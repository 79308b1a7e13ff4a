"""Shamir t-of-n secret sharing over the prime field GF(2^521 - 1).

A secret (an integer below the prime, e.g. 32 key bytes) is the constant term of a random
polynomial of degree t - 1; share i is the polynomial at x = i (i >= 1). Any t shares
determine the secret by Lagrange interpolation at 0; fewer reveal nothing about it.
"""

from __future__ import annotations

import secrets
from functools import lru_cache

PRIME = 2**521 - 1  # a Mersenne prime, comfortably above any 256-bit secret
SHARE_BYTES = 66  # ceil(521 / 8)

Share = tuple[int, int]  # (x, y)


def split(secret: int, n: int, t: int) -> list[Share]:
    """n shares at x = 1..n, any t of which recover ``secret``."""
    if not 1 <= t <= n:
        raise ValueError(f"need 1 <= t <= n, got t={t}, n={n}")
    if not 0 <= secret < PRIME:
        raise ValueError("secret out of the field")
    coefficients = [secret] + [secrets.randbelow(PRIME) for _ in range(t - 1)]
    return [(x, evaluate(coefficients, x)) for x in range(1, n + 1)]


def evaluate(coefficients: list[int], x: int) -> int:
    result = 0
    for c in reversed(coefficients):
        result = (result * x + c) % PRIME
    return result


@lru_cache(maxsize=4096)
def lagrange_weights(xs: tuple[int, ...], at: int) -> tuple[int, ...]:
    """Weights l_i with p(at) = sum_i l_i y_i for any polynomial of degree < len(xs).

    Cached: the server reconstructs many secrets from the same responders' shares."""
    if len(set(xs)) != len(xs):
        raise ValueError("shares must have distinct x")
    weights = []
    for i, xi in enumerate(xs):
        numerator, denominator = 1, 1
        for j, xj in enumerate(xs):
            if i != j:
                numerator = numerator * (at - xj) % PRIME
                denominator = denominator * (xi - xj) % PRIME
        weights.append(numerator * pow(denominator, -1, PRIME) % PRIME)
    return tuple(weights)


def interpolate(shares: list[Share], at: int = 0) -> int:
    """The value at ``at`` of the unique polynomial of degree < len(shares) through them."""
    weights = lagrange_weights(tuple(x for x, _ in shares), at)
    return sum(w * y for w, (_, y) in zip(weights, shares, strict=True)) % PRIME


def reconstruct(shares: list[Share]) -> int:
    return interpolate(shares, 0)
