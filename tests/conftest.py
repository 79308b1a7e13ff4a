"""Shared fixtures: tiny federated datasets built by hand or by the embedded generator."""

from __future__ import annotations

import numpy as np
import pytest

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged
from fedsub.data.synthetic_sparse import SyntheticSparseOptions, generate


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
