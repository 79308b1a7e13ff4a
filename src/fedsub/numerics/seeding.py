"""Independent random streams keyed by (seed, purpose, round, client).

Keying every stream by what it is for, rather than drawing from one shared generator, makes a
client's shuffle the same whoever else is in its cohort, the client schedule the same for every
algorithm of a comparison, and results independent of the execution order of clients.
"""

from __future__ import annotations

import numpy as np

SAMPLING = 1
CLIENT = 2
EVALUATION = 3
INIT = 4
DATA = 5
DP = 6  # differential privacy's noise and row selection (fedsub/dp)


def rng(seed: int, purpose: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed, purpose, *keys])
