"""Where [dp]'s random choices come from: a secret, or (an explicit opt-in) the public seed.

Differential privacy holds only if whoever reads a run's published files cannot redraw its
random choices. Under [dp] every choice the guarantee relies on is drawn from ``DpStreams.key``:
the central Gaussian noise, the row selection's histogram noise and false positives, adaptive
clipping's count noise (dp/mechanism.py), distributed DP's member noise in simulation
(privacy/private_rounds.py), the cohort and Poisson membership (engine/server_round.py).

``dp.randomness = "secret"`` (the default): the key is a ``seeding.Secret``, 256 bits drawn
from the operating system's entropy when the run starts. It lives only in the run's private
state: the ``dp_secret`` stage of every checkpoint (``checkpoints/round-*/dp_secret
.safetensors``), never in config.toml, run.json, summary.*, metrics.jsonl, the logs or the
model file; a resumed run reads it back and continues the same streams bit for bit; two runs
of one config differ. Under torchrun process 0 draws it and sends it to the others
(``distributed.from_first``), so every process draws the same noise and cohorts.

``dp.randomness = "seeded"``: the key is ``train.seed``, published in config.toml, so the
streams are those fedsub draws without [dp] and a run repeats bit for bit (tests, ``fedsub
reproduce``); whoever knows the seed redraws the noise and subtracts it, so such a run's
epsilon is NOT a guarantee, and every output of the run says so (``NOT_A_GUARANTEE``).
"""

from __future__ import annotations

from fedsub.numerics.secret_streams import RANDOMNESS, Randomness, SecretStreams

__all__ = ["NOT_A_GUARANTEE", "RANDOMNESS", "STAGE", "DpStreams", "Randomness", "streams_of"]

STAGE = "dp_secret"  # the checkpoint stage holding the secret

NOT_A_GUARANTEE = (
    'dp.randomness = "seeded": the noise and the cohorts are drawn from train.seed, which the '
    "run folder publishes; whoever reads it can redraw and subtract the noise, so this epsilon "
    "is NOT a privacy guarantee (for tests and reproductions only)"
)


class DpStreams(SecretStreams):
    """The key of [dp]'s random streams (module docstring; ``numerics/secret_streams.py``)."""

    CONFIG_KEY = "dp.randomness"
    NOT_GUARANTEED = NOT_A_GUARANTEE


streams_of = DpStreams.started  # a run's streams, warning at the start when seeded
