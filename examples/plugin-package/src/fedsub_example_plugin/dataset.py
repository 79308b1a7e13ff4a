"""A dataset: generated clicks of users on items, each user fond of a few items."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.from_python import from_clients, samples
from fedsub.data.registry import DatasetSpec


@dataclass(frozen=True)
class ToyClicksOptions:
    num_clients: int = field(default=8, metadata={"min": 2})
    num_items: int = field(default=40, metadata={"min": 2})
    samples_per_client: int = field(default=24, metadata={"min": 1})


def generate(options: ToyClicksOptions, path: str | None, seed: int) -> FederatedDataset:
    """Client k clicks (label 1) mostly on the items of its own favourite range."""
    rng = np.random.default_rng(seed)
    n, items = options.samples_per_client, options.num_items

    def client(k: int) -> SampleSet:
        item = rng.integers(0, items, size=n)
        fond = (item - 5 * k) % items < items // 4
        label = (fond ^ (rng.random(n) < 0.1)).astype(np.float32)
        return samples(label, {"user": np.full(n, k), "item": item}, where=f"client {k}")

    clients = [client(k) for k in range(options.num_clients)]
    test = client(0)
    rows = {"user": options.num_clients, "item": items}
    return from_clients(clients, test, table_rows=rows, name="toy-clicks")


SPEC = DatasetSpec(
    ToyClicksOptions,
    generate,
    "generated user x item clicks, each user fond of a range of items (example plugin)",
    name="toy-clicks",
)
