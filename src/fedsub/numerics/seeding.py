"""Independent random streams keyed by (seed, purpose, round, client).

Keying every stream by what it is for, rather than drawing from one shared generator, makes a
client's shuffle the same whoever else is in its cohort, the client schedule the same for every
algorithm of a comparison, and results independent of the execution order of clients.

A stream's key is the run's public ``train.seed`` or, for the random choices differential
privacy relies on (fedsub/dp/randomness.py), a ``Secret``: entropy from the operating system
that only the run's checkpoints keep. A secret's streams are keyed the same way, (secret,
purpose, round, client), so a resumed run that reads its secret back continues them bit for bit.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

SAMPLING = 1
CLIENT = 2
EVALUATION = 3
INIT = 4
DATA = 5
DP = 6  # differential privacy's noise and row selection (fedsub/dp)

SECRET_BITS = 256


@dataclass(frozen=True)
class Secret:
    """A stream key nobody outside the run knows: ``SECRET_BITS`` bits of entropy from the
    operating system (``fresh``). Its ``repr`` shows none of them, so a log line or a traceback
    that prints it gives nothing away."""

    entropy: int

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    @staticmethod
    def fresh() -> Secret:
        """A new secret from the operating system's entropy (``secrets``)."""
        return Secret(secrets.randbits(SECRET_BITS))

    def to_bytes(self) -> bytes:
        return self.entropy.to_bytes(SECRET_BITS // 8, "little")

    @staticmethod
    def from_bytes(data: bytes) -> Secret:
        if len(data) != SECRET_BITS // 8:
            raise ValueError(f"a secret is {SECRET_BITS // 8} bytes, got {len(data)}")
        return Secret(int.from_bytes(data, "little"))


Seed = int | Secret  # a stream key: the public seed, or the run's secret


def seed_sequence(seed: Seed, purpose: int, *keys: int) -> np.random.SeedSequence:
    """The SeedSequence of (seed, purpose, keys): a public seed's is numpy's of the list
    ``[seed, purpose, *keys]`` (the streams fedsub has always drawn); a secret's takes the
    secret as its entropy and (purpose, keys) as its spawn key."""
    if isinstance(seed, Secret):
        return np.random.SeedSequence(seed.entropy, spawn_key=(purpose, *keys))
    return np.random.SeedSequence([seed, purpose, *keys])


def rng(seed: Seed, purpose: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng(seed_sequence(seed, purpose, *keys))
