"""Shared fixtures: tiny federated datasets built by hand or by the embedded generator."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged
from fedsub.data.synthetic_sparse import SyntheticSparseOptions, generate
from fedsub.submodel.params import Params


def make_dataset(
    clients: list[list[list[int]]], table_rows: int, seed: int = 0, table: str = "t"
) -> FederatedDataset:
    """Clients given as lists of samples, each a list of ids of one table; random labels."""
    rng = np.random.default_rng(seed)
    parts = [
        SampleSet(
            {table: Ragged.from_lists(samples)},
            rng.integers(2, size=len(samples)).astype(np.float32),
        )
        for samples in clients
    ]
    return FederatedDataset.from_clients("hand-made", {table: table_rows}, parts, parts[0])


@pytest.fixture(scope="session")
def small_synthetic() -> FederatedDataset:
    return generate(
        SyntheticSparseOptions(num_users=40, num_items=30, mean_samples_per_user=12), seed=3
    )


@dataclass(frozen=True)
class SquaredDistance:
    """Per sample: sum over its ids m of (w_m - xi)^2, xi being the label; w starts at w0."""

    rows: int
    w0: float
    task: str = "regression"

    def init(self, generator, dtype):
        return Params({"w": torch.full((self.rows, 1), self.w0, dtype=dtype)}, {})

    def embed(self, tables, ids):
        values, offsets = ids["w"]
        w = tables["w"]
        bag = lambda weight: F.embedding_bag(  # noqa: E731
            values, weight, offsets, mode="sum", include_last_offset=True
        )[:, 0]
        return {"moments": torch.stack([bag(w**2), bag(w), bag(torch.ones_like(w))], dim=1)}

    def head(self, dense, features, dense_inputs):
        return features["moments"]

    def loss(self, outputs, labels):
        sq, s, count = outputs.unbind(1)
        return (sq - 2 * labels * s + labels**2 * count).mean()
