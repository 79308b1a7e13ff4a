"""``synthetic-sparse``: the embedded default, a seeded recommender-like click dataset.

Users (the clients) have a gender and an age group; items have power-law (Zipf) popularity.
Each sample is a (user, item) impression with one-hot gender, age, item, gender x item and
age x item features, all in one feature space (one table, ``features``). Labels come from a
hidden logistic model over the same features plus Gaussian logit noise. Hot features (gender,
age) are touched by most clients, cold crosses by one, so the feature heat dispersion is in the
thousands, the regime where FedSubAvg matters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged

GENDERS = 2
AGE_GROUPS = 7
TABLE = "features"


@dataclass(frozen=True)
class SyntheticSparseOptions:
    num_users: int = field(default=3000, metadata={"min": 2, "max": 10**7})
    """Clients."""
    num_items: int = field(default=2000, metadata={"min": 1, "max": 10**8})
    """Items."""
    zipf_exponent: float = field(default=1.1, metadata={"min": 0.0, "max": 10.0})
    """Item popularity ~ 1 / rank^s."""
    mean_samples_per_user: float = field(default=40.0, metadata={"min": 5.0, "max": 10**5})
    """Mean samples per user."""
    samples_sigma: float = field(default=0.8, metadata={"min": 0.0, "max": 5.0})
    """Lognormal spread of samples per user."""
    test_fraction: float = field(default=0.2, metadata={"min": 0.0, "max": 0.9})
    """Per user, held out into the pooled test set."""
    weight_std: float = field(default=1.0, metadata={"min": 0.0})
    """The hidden logistic model's weights' standard deviation."""
    noise_std: float = field(default=0.5, metadata={"min": 0.0})
    """Logit noise."""


def field_offsets(num_items: int) -> dict[str, int]:
    """Where each one-hot field starts in the shared feature space."""
    sizes = {
        "gender": GENDERS,
        "age": AGE_GROUPS,
        "item": num_items,
        "gender_x_item": GENDERS * num_items,
        "age_x_item": AGE_GROUPS * num_items,
    }
    starts = np.cumsum([0, *sizes.values()])
    return {
        **{name: int(s) for name, s in zip(sizes, starts, strict=False)},
        "total": int(starts[-1]),
    }


def generate(options: SyntheticSparseOptions, seed: int) -> FederatedDataset:
    rng = np.random.default_rng([seed, 0x5EED])
    o = options
    gender = rng.integers(GENDERS, size=o.num_users)
    age = rng.integers(AGE_GROUPS, size=o.num_users)
    mu = np.log(o.mean_samples_per_user) - o.samples_sigma**2 / 2
    counts = np.maximum(5, rng.lognormal(mu, o.samples_sigma, size=o.num_users).astype(np.int64))

    popularity = 1.0 / np.arange(1, o.num_items + 1) ** o.zipf_exponent
    popularity /= popularity.sum()
    owner = np.repeat(np.arange(o.num_users), counts)
    items = rng.choice(o.num_items, size=len(owner), p=popularity)

    at = field_offsets(o.num_items)
    ids = np.stack(
        [
            at["gender"] + gender[owner],
            at["age"] + age[owner],
            at["item"] + items,
            at["gender_x_item"] + gender[owner] * o.num_items + items,
            at["age_x_item"] + age[owner] * o.num_items + items,
        ],
        axis=1,
    )
    true_weights = rng.normal(0.0, o.weight_std, size=at["total"])
    logits = true_weights[ids].sum(1) + rng.normal(0.0, o.noise_std, size=len(owner))
    labels = (rng.random(len(owner)) < 1 / (1 + np.exp(-logits))).astype(np.float32)

    is_test = np.zeros(len(owner), dtype=bool)
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    for start, n in zip(starts, counts, strict=True):
        n_test = min(round(n * o.test_fraction), n - 1)
        is_test[start + rng.choice(n, size=n_test, replace=False)] = True

    def samples(mask: np.ndarray) -> SampleSet:
        return SampleSet({TABLE: Ragged.from_fixed(ids[mask])}, labels[mask])

    train_counts = np.bincount(owner[~is_test], minlength=o.num_users)
    offsets = np.r_[0, np.cumsum(train_counts)].astype(np.int64)
    return FederatedDataset(
        "synthetic-sparse", {TABLE: at["total"]}, samples(~is_test), offsets, samples(is_test)
    )
