"""The benchmark workloads, generated: clients of equal size, Zipf item popularity."""

from __future__ import annotations

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged


def zipf_clicks(
    clients: int = 1000,
    samples_per_client: int = 100,
    rows: int = 20_000,
    ids_per_sample: int = 5,
    exponent: float = 1.1,
    seed: int = 0,
) -> FederatedDataset:
    """Issue 5's workload: each sample has ``ids_per_sample`` ids drawn Zipf(exponent) over
    ``rows``; labels from a hidden logistic model over the ids."""
    rng = np.random.default_rng(seed)
    n = clients * samples_per_client
    popularity = 1.0 / np.arange(1, rows + 1) ** exponent
    cumulative = np.cumsum(popularity / popularity.sum())
    ids = np.searchsorted(cumulative, rng.random((n, ids_per_sample)))
    ids = np.minimum(ids, rows - 1)
    weights = rng.normal(size=rows)
    labels = (rng.random(n) < 1 / (1 + np.exp(-weights[ids].sum(1)))).astype(np.float32)
    train = SampleSet({"features": Ragged.from_fixed(ids)}, labels)
    offsets = np.arange(0, n + 1, samples_per_client, dtype=np.int64)
    test = train.slice(0, min(n, 1000))
    return FederatedDataset("zipf-clicks", {"features": rows}, train, offsets, test)


def amazon_like(
    users: int = 1859,
    samples_per_user: int = 54,
    items: int = 60_000,
    max_history: int = 20,
    exponent: float = 1.1,
    seed: int = 0,
) -> FederatedDataset:
    """The FedSubAvg authors' Amazon shape: 1,859 users with ~54 training samples each,
    Zipf item popularity, ragged click histories; fields user / item / history."""
    rng = np.random.default_rng(seed)
    n = users * samples_per_user
    popularity = 1.0 / np.arange(1, items + 1) ** exponent
    cumulative = np.cumsum(popularity / popularity.sum())

    def draw(size: int) -> np.ndarray:
        return np.minimum(np.searchsorted(cumulative, rng.random(size)), items - 1)

    lengths = rng.integers(0, max_history + 1, size=n)
    history = Ragged(draw(int(lengths.sum())), np.r_[0, np.cumsum(lengths)].astype(np.int64))
    samples = SampleSet(
        {
            "user": Ragged.from_fixed(np.repeat(np.arange(users), samples_per_user)[:, None]),
            "item": Ragged.from_fixed(draw(n)[:, None]),
            "history": history,
        },
        (rng.random(n) < 0.555).astype(np.float32),
    )
    offsets = np.arange(0, n + 1, samples_per_user, dtype=np.int64)
    return FederatedDataset(
        "amazon-like",
        {"user": users, "item": items},
        samples,
        offsets,
        samples.slice(0, 2000),
        {"user": "user", "item": "item", "history": "item"},
    )
