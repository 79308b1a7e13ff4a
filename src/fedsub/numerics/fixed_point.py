"""Fixed-point encoding of real vectors for secure aggregation (integers mod 2^32).

Secure aggregation adds integers mod 2^32, so a client's real values are clipped to
``[-clip, clip]``, scaled by ``scale`` and rounded to the nearest integer (two's complement
mod 2^32). The sum of n encodings decodes exactly to the sum of the rounded values as long as
``n * clip * scale < 2^31`` (no wrap-around), which ``for_clients`` guarantees by choosing the
largest power-of-two scale that fits. Each rounding is off by at most ``1 / (2 * scale)``, so
a decoded sum of n clients is within ``n / (2 * scale)`` of the sum of their clipped values:
``error_bound(n)``. Values outside the range are clipped and counted, never wrapped.

A numeric codec, not a protocol: secure aggregation (privacy/sparse_secagg.py) and distributed
DP (dp/distributed.py) both encode in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MODULUS_BITS = 32
SIGNED_LIMIT = 2**31  # sums must stay in (-2^31, 2^31)


@dataclass(frozen=True)
class FixedPoint:
    """Values in ``[-clip, clip]`` as integers ``round(value * scale)`` mod 2^32."""

    clip: float
    scale: float

    @staticmethod
    def for_clients(clients: int, clip: float) -> FixedPoint:
        """The finest power-of-two scale at which the sum of ``clients`` clipped values cannot
        wrap around mod 2^32."""
        if clients < 1 or not clip > 0:
            raise ValueError(f"need at least one client and clip > 0, got {clients}, {clip}")
        bits = math.floor(math.log2((SIGNED_LIMIT - 1) / (clients * clip)))
        scale = 2.0**bits
        while clients * (round(clip * scale)) >= SIGNED_LIMIT:  # guard the rounding at the edge
            scale /= 2
        return FixedPoint(clip, scale)

    def encode(self, values: np.ndarray) -> tuple[np.ndarray, int]:
        """The uint32 encoding of ``values`` and how many of them were clipped."""
        values = np.asarray(values, dtype=np.float64)
        if not np.isfinite(values).all():
            raise ValueError("cannot encode NaN or Inf for secure aggregation")
        clipped = int(np.count_nonzero(np.abs(values) > self.clip))
        integers = np.rint(np.clip(values, -self.clip, self.clip) * self.scale).astype(np.int64)
        return (integers % 2**MODULUS_BITS).astype(np.uint32), clipped

    def decode_sum(self, total: np.ndarray) -> np.ndarray:
        """The real sum (float64) from the uint32 sum of encodings (read as signed int32)."""
        return np.asarray(total, dtype=np.uint32).view(np.int32).astype(np.float64) / self.scale

    def error_bound(self, clients: int) -> float:
        """Largest |decoded sum - sum of clipped values| per coordinate for ``clients``
        summands: each rounding is off by at most half a step."""
        return clients / (2 * self.scale)
