"""The key of random streams a privacy guarantee relies on: a run secret, or the public seed.

A guarantee built on random choices (Gaussian noise, a randomized-response coin, a decoy row)
holds only if whoever reads the run's published files cannot redraw those choices. fedsub's
own streams are keyed by ``train.seed``, which config.toml publishes; a guarantee's streams
are keyed by ``SecretStreams.key`` instead:

- ``"secret"``: a ``seeding.Secret``, 256 bits of OS entropy drawn when the run starts and
  kept only in the run's private state (a checkpoint stage, never config.toml, run.json,
  summaries, logs or the model). A resumed run reads it back and continues the same streams
  bit for bit; two runs of one config differ. Under torchrun process 0 draws it and sends it
  to the others (``distributed.from_first``), so every process draws the same choices.
- ``"seeded"``: the key is ``train.seed``, so a run repeats bit for bit (tests, reproductions),
  and whoever knows the seed redraws the choices: the guarantee does NOT hold.

Each guarantee has its own streams object and config key ([dp]'s in ``dp/randomness.py``,
the privacy levels' in ``privacy/randomness.py``); the purpose numbers of ``seeding`` keep
their draws apart even when two share one kind of key.
"""

from __future__ import annotations

import logging
from typing import ClassVar, Literal, Self

import torch

from fedsub import distributed
from fedsub.numerics.seeding import Secret, Seed

LOG = logging.getLogger("fedsub")

Randomness = Literal["secret", "seeded"]
RANDOMNESS: tuple[Randomness, ...] = ("secret", "seeded")


def draw_secret() -> Secret:
    """A fresh secret from the operating system (one place, so a test can pin it)."""
    return Secret.fresh()


class SecretStreams:
    """The key of one guarantee's random streams (module docstring); a checkpoint stage
    (``Stateful``) in secret mode, whose one tensor is the secret's bytes. ``CONFIG_KEY``
    names the key that chose the mode, for errors."""

    CONFIG_KEY: ClassVar[str] = "randomness"
    KEPT_FROM_THE_START: ClassVar[bool] = True  # fedsub/stateful.py's kept_from_the_start
    NOT_GUARANTEED: ClassVar[str] = "randomness = 'seeded': the guarantee does NOT hold"

    @classmethod
    def started(cls, randomness: Randomness, seed: int) -> Self:
        """A run's streams; seeded mode says at the start, once, what the guarantee loses
        (``NOT_GUARANTEED``)."""
        streams = cls(randomness, seed)
        if not streams.guaranteed:
            LOG.warning(streams.NOT_GUARANTEED)
        return streams

    def __init__(self, randomness: Randomness, seed: int) -> None:
        if randomness not in RANDOMNESS:
            raise ValueError(f"{self.CONFIG_KEY} must be one of {RANDOMNESS}, got {randomness!r}")
        self.randomness = randomness
        self.seed = seed
        self.secret: Secret | None = None
        if randomness == "secret":  # process 0's, in every process
            self.secret = distributed.from_first(draw_secret(), f"sharing {self.CONFIG_KEY}")

    @property
    def key(self) -> Seed:
        """What the streams are keyed by: the secret, or the public seed."""
        return self.secret if self.secret is not None else self.seed

    @property
    def guaranteed(self) -> bool:
        """Whether the streams are secret (the guarantee holds)."""
        return self.secret is not None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.randomness!r})"

    def state_tensors(self) -> dict[str, torch.Tensor]:
        assert self.secret is not None, "only a secret is checkpointed (seeded: train.seed)"
        data = bytearray(self.secret.to_bytes())
        return {"secret": torch.frombuffer(data, dtype=torch.uint8).clone()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if set(tensors) != {"secret"} or tensors["secret"].dtype != torch.uint8:
            raise ValueError(
                f"{self.CONFIG_KEY}'s secret is one uint8 'secret', got {sorted(tensors)}"
            )
        self.secret = Secret.from_bytes(tensors["secret"].cpu().numpy().tobytes())
