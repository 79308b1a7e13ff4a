"""``privacy.level``: how much of a client's submodel the server may learn, as cumulative levels.

- ``none``: the server sees every client's index set S(k) and row deltas (plain FedSubAvg).
- ``heat``: heat counts come from a private source (``privacy.heat_source``; ``exact`` is
  replaced by ``secagg``), so the precomputed heat reveals no S(k).
- ``download``: + private download requests (randomized response or size buckets,
  ``privacy/private_download.py``); row deltas still go up in the clear.
- ``full``: + secure sparse aggregation of the row deltas over the union of the requests
  (``privacy/sparse_secagg.py``): the server learns only per-row sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedsub.numerics.secret_streams import Randomness
from fedsub.privacy import private_download
from fedsub.privacy.randomness import NOT_PRIVATE

LEVELS = ("none", "heat", "download", "full")
DOWNLOADS = ("randomized-response", "buckets")
Level = Literal["none", "heat", "download", "full"]
Download = Literal["randomized-response", "buckets"]


@dataclass(frozen=True)
class Privacy:
    """The level and its settings (config keys ``privacy.level``, ``privacy.download`` ...)."""

    level: Level = "none"
    download: Download = "randomized-response"
    download_epsilon: float = 4.0  # randomized response's local epsilon per row
    download_keep: float = 0.9  # p: probability that a held row is requested
    download_bucket: int = 64  # buckets: the smallest size class
    secagg_clip: float = 1.0  # fixed-point range [-clip, clip] of a weighted delta value
    # the download requests' coins and decoys: each client's secret, or train.seed
    # (privacy/randomness.py)
    randomness: Randomness = "secret"

    @property
    def private_download(self) -> bool:
        return reaches(self.level, "download")

    @property
    def secure_aggregation(self) -> bool:
        return self.level == "full"

    @property
    def randomized(self) -> bool:
        return self.private_download and self.download == "randomized-response"

    @property
    def seeded(self) -> bool:
        """Whether the level draws requests from the public seed (its protection fails)."""
        return self.private_download and self.randomness == "seeded"

    @property
    def keep(self) -> float:
        """p: the probability that a held row is requested (1 with buckets)."""
        return self.download_keep if self.randomized else 1.0

    @property
    def decoy(self) -> float:
        """q: the probability that a row not held is requested by randomized response."""
        return private_download.decoy_probability(self.download_epsilon, self.download_keep)


def reaches(level: str, floor: str) -> bool:
    """Whether privacy ``level`` includes everything ``floor`` protects (LEVELS' order)."""
    return LEVELS.index(level) >= LEVELS.index(floor)


def heat_source_for(level: str, configured: str) -> str:
    """The heat source a level uses: from ``heat`` up, exact heat becomes ``secagg`` (a
    private source the user chose, sketch or randomized response, is kept)."""
    return "secagg" if reaches(level, "heat") and configured == "exact" else configured


def describe(privacy: Privacy) -> dict:
    """The level's guarantees, for the run's record (``privacy.json``)."""
    info: dict = {"level": privacy.level}
    if privacy.private_download:
        info["download"] = privacy.download
        if privacy.randomized:
            p, q = privacy.keep, privacy.decoy
            info.update(keep_probability=p, decoy_probability=q)
            info["epsilon"] = private_download.epsilon_of(p, q)
            info["held_rows_not_requested"] = (
                "skipped: read as zero in the local steps, no update sent; row sums divided by p"
            )
        else:
            info["smallest_size_class"] = privacy.download_bucket
        info["randomness"] = privacy.randomness  # privacy/randomness.py
        if privacy.randomness == "seeded":
            info["not_private"] = NOT_PRIVATE
    if privacy.secure_aggregation:
        info.update(secagg_clip=privacy.secagg_clip, threshold="floor(cohort / 2) + 1")
        info["fixed_point"] = "scale = largest 2^b with cohort * clip * 2^b < 2^31"
        info["error_bound"] = "cohort / (2 * scale) per summed value"
        info["sample_counts"] = "inside the secure sum: each client weights its own deltas"
    return info
