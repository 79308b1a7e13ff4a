"""Where the privacy levels' random choices come from: each client's secret, or the seed.

``privacy.level = download`` hides a client's rows S(k) behind random choices: randomized
response's coins (a held row requested with probability p, any other with q) or the size
buckets' decoy rows. Whoever can redraw those choices decodes S(k) from the request (a coin
under p but over q means a held row), so they must be the client's secret:

- in process (the simulator), ``privacy.randomness = "secret"`` keys every client's requests
  by one run secret (``PrivacyStreams``, ``numerics/secret_streams.py``; the checkpoint stage
  ``privacy_secret``), standing for the clients' own secrets: a published run folder redraws
  none of them, a resumed run continues them bit for bit;
- on Flower each node draws its own secret the first time it needs one and keeps it in its
  SuperNode's run state (``privacy/download_protocol.NodeRequests.key``): the server never holds it;
- ``"seeded"`` keys the requests by ``train.seed`` (the streams fedsub always drew), so a
  deployment and the simulator draw the very same requests (tests, reproductions); whoever
  knows the seed decodes S(k), so every output says the level's protection does NOT hold.

The same key covers ``privacy.heat_source = "randomized-response"`` in process: every
simulated client's noisy indicator bits (``HeatCoins``). Drawn from ``train.seed`` they redraw
from config.toml, and the published heat estimate (which shapes FedSubAvg's coefficients,
hence the model) decodes back into the exact counts. The heat is computed once, when the
algorithms are built, before any checkpoint is restored, so the run settles the key first
(``HeatCoins.settle``: the secret read back from the checkpoints it resumes, or a fresh one,
process 0's in every process) and every algorithm's checkpoints keep it (stage
``heat_secret``). On Flower each node draws its bits from OS entropy
(``privacy/heat_vectors.noisy_bits``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from fedsub import distributed
from fedsub.errors import FedsubError
from fedsub.numerics import secret_streams
from fedsub.numerics.secret_streams import RANDOMNESS, Randomness, SecretStreams
from fedsub.numerics.seeding import Secret, Seed

LOG = logging.getLogger("fedsub")

__all__ = [
    "HEAT_NOT_PRIVATE",
    "HEAT_STAGE",
    "NOT_PRIVATE",
    "RANDOMNESS",
    "STAGE",
    "HeatCoins",
    "PrivacyStreams",
    "Randomness",
    "streams_of",
]

STAGE = "privacy_secret"  # the checkpoint stage holding the secret
HEAT_STAGE = "heat_secret"  # the randomized-response heat's secret (``HeatCoins``)

NOT_PRIVATE = (
    'privacy.randomness = "seeded": the download requests\' coins and decoys are drawn from '
    "train.seed, which the run folder publishes; whoever reads it redraws them and reads each "
    "client's rows off its request, so the private download hides NOTHING (for tests and "
    "reproductions only)"
)


class PrivacyStreams(SecretStreams):
    """The key of the privacy levels' random streams (module docstring)."""

    CONFIG_KEY = "privacy.randomness"
    NOT_GUARANTEED = NOT_PRIVATE

    def load_absent(self) -> None:
        """Resumed from a checkpoint without this stage: written by a fedsub that drew the
        requests from train.seed, so the run continues seeded, as it started, and says so."""
        LOG.warning("%s (the checkpoint resumed has no request secret)", NOT_PRIVATE)
        self.randomness, self.secret = "seeded", None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The secret, or nothing once the run continues seeded (``load_absent``)."""
        return {} if self.secret is None else super().state_tensors()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:  # saved after a resume that continued seeded
            self.load_absent()
            return
        super().load_state_tensors(tensors)


streams_of = PrivacyStreams.started  # a run's streams, warning at the start when seeded


HEAT_NOT_PRIVATE = (
    'privacy.randomness = "seeded": the randomized-response heat\'s coins are drawn from '
    "train.seed, which the run folder publishes; whoever reads it redraws every client's bits "
    "and turns the heat estimate back into the exact counts, so its local epsilon is NOT a "
    "guarantee (for tests and reproductions only)"
)

StageStates = Mapping[str, Mapping[str, torch.Tensor]]  # a checkpoint's stages (Checkpoint)


class HeatCoins(SecretStreams):
    """The key of the in-process randomized-response heat's coins (module docstring): not
    drawn when made (the processes of a torchrun run may not have joined yet) but settled
    once, before the heat is first computed (``settle``; ``key`` settles a run that never
    asked: a fresh secret). A checkpoint stage in secret mode; a restore only checks that the
    checkpoint's secret is the one the heat was computed from (it cannot be recomputed)."""

    CONFIG_KEY = "privacy.randomness"
    NOT_GUARANTEED = HEAT_NOT_PRIVATE

    def __init__(self, randomness: Randomness, seed: int) -> None:
        if randomness not in RANDOMNESS:
            raise ValueError(f"{self.CONFIG_KEY} must be one of {RANDOMNESS}, got {randomness!r}")
        self.randomness, self.seed = randomness, seed
        self.secret: Secret | None = None
        self.settled = False

    def settle(self, resumed: Sequence[StageStates] = ()) -> None:
        """Fix the key before the heat is computed: with ``resumed`` (the stages of the
        checkpoints the run continues) their secret, or seeded when they hold none (written
        by a fedsub that drew the coins from train.seed: the run continues as it started, and
        says so); else a fresh secret, process 0's in every process. Seeded mode warns."""
        if self.settled:
            raise FedsubError("the heat coins' key is settled once, before the heat is computed")
        self.settled = True
        if self.randomness == "seeded":
            LOG.warning(HEAT_NOT_PRIVATE)
        elif resumed:
            self.secret = distributed.from_first(_saved_secret(resumed), "sharing the heat secret")
            if self.secret is None:
                LOG.warning("%s (the checkpoint resumed has no heat secret)", HEAT_NOT_PRIVATE)
                self.randomness = "seeded"
        else:
            self.secret = distributed.from_first(secret_streams.draw_secret(), "heat secret")

    @property
    def key(self) -> Seed:
        """The coins' key (settled now if the run has not: a fresh secret)."""
        if not self.settled:
            self.settle()
        return super().key

    def load_absent(self) -> None:
        """Restored from a checkpoint without this stage: the heat must have been seeded."""
        self._check_restored(None)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.secret is None else super().state_tensors()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            self._check_restored(None)
            return
        held = self.secret
        super().load_state_tensors(tensors)
        saved, self.secret = self.secret, held
        self._check_restored(saved)

    def _check_restored(self, saved: Secret | None) -> None:
        """The heat was computed before the restore: from the checkpoint's key, or refused."""
        if saved != self.secret or not self.settled:
            raise FedsubError(
                "the checkpoint's randomized-response heat secret is not the one this run's "
                "heat was computed from; a resume reads it back before the algorithms are "
                "built (fedsub run --resume, compare(resume=True), or HeatCoins.settle)"
            )


def _saved_secret(resumed: Sequence[StageStates]) -> Secret | None:
    """The one heat secret of the resumed checkpoints (None: they hold none), refused when
    they disagree."""
    secrets: set[Secret | None] = set()
    for stages in resumed:
        tensors = stages.get(HEAT_STAGE) or {}
        if "secret" in tensors:
            secrets.add(Secret.from_bytes(tensors["secret"].cpu().numpy().tobytes()))
        else:
            secrets.add(None)
    if len(secrets) > 1:
        raise FedsubError(
            "the checkpoints resumed disagree on the randomized-response heat's secret (the "
            "run's algorithms computed one heat): resume a folder one run wrote"
        )
    return secrets.pop()
