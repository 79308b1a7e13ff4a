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
  SuperNode's run state (``flower/private_download.node_key``): the server never holds it;
- ``"seeded"`` keys the requests by ``train.seed`` (the streams fedsub always drew), so a
  deployment and the simulator draw the very same requests (tests, reproductions); whoever
  knows the seed decodes S(k), so every output says the level's protection does NOT hold.
"""

from __future__ import annotations

import logging

import torch

from fedsub.numerics.secret_streams import RANDOMNESS, Randomness, SecretStreams

LOG = logging.getLogger("fedsub")

__all__ = ["NOT_PRIVATE", "RANDOMNESS", "STAGE", "PrivacyStreams", "Randomness", "streams_of"]

STAGE = "privacy_secret"  # the checkpoint stage holding the secret

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
