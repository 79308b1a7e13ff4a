"""A client's download request in one round, drawn from the client's own stream.

The in-process engine (``privacy/private_rounds.py``) and a Flower node
(``privacy/download_protocol.py``) call this one function with the key (seed, round, client):
the seed is the client's secret (``privacy.randomness = "secret"``, privacy/randomness.py), or
``train.seed`` (``"seeded"``), with which a node draws the very request the simulator draws
for its client.
"""

from __future__ import annotations

import numpy as np

from fedsub.numerics import seeding
from fedsub.privacy import private_download
from fedsub.privacy.levels import Privacy

DOWNLOAD_STREAM = 0x5D0  # seeding purpose of the download requests


def client_request(
    privacy: Privacy,
    rows: dict[str, np.ndarray],
    table_rows: dict[str, int],
    seed: seeding.Seed,
    round_index: int,
    client: int,
) -> dict[str, np.ndarray]:
    """Client ``client``'s request (table -> sorted rows) in round ``round_index``, from its
    rows S(k); S(k) itself below level ``download``."""
    if not privacy.private_download:
        return rows
    rng = seeding.rng(seed, DOWNLOAD_STREAM, round_index, client)
    if privacy.randomized:
        return {
            t: private_download.randomized_request(
                r, table_rows[t], privacy.keep, privacy.decoy, rng
            )
            for t, r in rows.items()
        }
    return {
        t: private_download.bucketed_request(r, table_rows[t], privacy.download_bucket, rng)
        for t, r in rows.items()
    }
