"""A two-tower recommender as a plain nn.Module, and generated click data to train it on.

The model knows nothing of fedsub: its forward reads ``batch.ids[field]`` as ``(values,
offsets)`` and returns one logit per sample. Its embedding modules are named after the
dataset's tables (user, age, item, category), so fedsub finds them: they are the row tables
clients pull by S(k) and FedSubAvg scales by heat; the towers are dense.

The data: users (the clients) with an age group, items with Zipf popularity and a category,
one click label per (user, item) impression from a hidden dot product of user and item
factors; each impression also carries the user's last few items (``history``, read from the
item table like the target ``item``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.from_python import from_clients, samples


class TwoTower(nn.Module):
    def __init__(self, users: int, ages: int, items: int, categories: int, dim: int = 8):
        super().__init__()
        self.user = nn.Embedding(users, dim)
        self.age = nn.Embedding(ages, dim)
        self.item = nn.EmbeddingBag(items, dim, mode="mean", include_last_offset=True)
        self.category = nn.Embedding(categories, dim)
        for table in (self.user, self.age, self.item, self.category):
            nn.init.normal_(table.weight, std=0.1)
        self.user_tower = nn.Sequential(nn.Linear(3 * dim, 32), nn.ReLU(), nn.Linear(32, dim))
        self.item_tower = nn.Sequential(nn.Linear(2 * dim, 32), nn.ReLU(), nn.Linear(32, dim))

    def forward(self, batch) -> torch.Tensor:
        ids = batch.ids
        user = [self.user(ids["user"][0]), self.age(ids["age"][0]), self.item(*ids["history"])]
        item = [self.item(*ids["item"]), self.category(ids["category"][0])]
        return (self.user_tower(torch.cat(user, -1)) * self.item_tower(torch.cat(item, -1))).sum(-1)


def clicks(users=500, items=2000, ages=7, categories=20, seed=0, history=5) -> FederatedDataset:
    """Users' impressions (20% of each user's held out as the pooled test set)."""
    rng = np.random.default_rng(seed)
    age, category = rng.integers(ages, size=users), rng.integers(categories, size=items)
    taste = rng.normal(size=(ages, 4))[age] + rng.normal(scale=0.7, size=(users, 4))
    factors = rng.normal(size=(categories, 4))[category] + rng.normal(scale=0.7, size=(items, 4))
    bias = rng.normal(scale=0.5, size=items)
    popularity = 1.0 / np.arange(1, items + 1) ** 1.1
    counts = np.maximum(5, rng.lognormal(np.log(30) - 0.32, 0.8, size=users).astype(int))
    train, test = [], []
    for u, n in enumerate(counts):
        seen = rng.choice(items, size=n, p=popularity / popularity.sum())
        logits = factors[seen] @ taste[u] + bias[seen] + rng.normal(scale=0.3, size=n)
        labels = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.float32)
        ids = {
            "user": np.full(n, u),
            "age": np.full(n, age[u]),
            "item": seen,
            "category": category[seen],
            "history": [seen[max(0, i - history) : i].tolist() for i in range(n)],
        }
        held_out = (rng.random(n) < 0.2) & (np.arange(n) > 0)  # every user keeps one to train
        for part, keep in ((train, ~held_out), (test, held_out)):
            part.append(samples(labels[keep], {f: _take(v, keep) for f, v in ids.items()}))
    tables = {"history": "item"}  # the history reads the item table
    rows = {"user": users, "age": ages, "item": items, "category": categories}
    test_set = SampleSet.concat(test)
    return from_clients(train, test_set, table_rows=rows, field_tables=tables, name="clicks")


def _take(values, keep):
    return (
        [v for v, k in zip(values, keep, strict=True) if k]
        if isinstance(values, list)
        else values[keep]
    )
