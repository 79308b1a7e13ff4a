"""Partitioners: which samples each client holds, for labeled datasets without natural clients.

Each returns a list of index arrays, one per client: seeded, disjoint and covering every
sample (no client left empty).

- ``iid``: a random permutation cut into near-equal parts.
- ``dirichlet``: per class, client shares ~ Dirichlet(alpha) (small alpha = skewed labels).
- ``shards``: McMahan et al.'s pathological split: sort by label, cut into ``clients * k``
  shards, deal k shards to each client.
- ``k_labels``: every client gets samples of exactly k labels (labels dealt round-robin from a
  random permutation; each label's samples split evenly among its clients).
- ``power_law``: client sizes proportional to LogNormal(0, sigma) draws, samples at random.
- ``natural``: one client per distinct value of an id column (e.g. the user).
"""

from __future__ import annotations

import numpy as np

from fedsub.errors import DataError


def _check(parts: list[np.ndarray], what: str) -> list[np.ndarray]:
    if any(len(p) == 0 for p in parts):
        raise DataError(f"{what}: some client would get no samples; use fewer clients")
    return [np.sort(p) for p in parts]


def iid(n: int, clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return _check(np.array_split(rng.permutation(n), clients), "iid partition")


def dirichlet(
    labels: np.ndarray, clients: int, alpha: float, rng: np.random.Generator, tries: int = 100
) -> list[np.ndarray]:
    classes = np.unique(labels)
    for _ in range(tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
        for c in classes:
            members = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
            for k, piece in enumerate(np.split(members, cuts)):
                parts[k].append(piece)
        merged = [np.concatenate(p) for p in parts]
        if all(len(p) for p in merged):
            return _check(merged, "dirichlet partition")
    raise DataError(
        f"dirichlet partition: after {tries} draws some client still had no samples; "
        f"raise alpha ({alpha}) or use fewer clients"
    )


def shards(labels: np.ndarray, clients: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, clients * k)
    dealt = rng.permutation(clients * k).reshape(clients, k)
    return _check([np.concatenate([pieces[s] for s in row]) for row in dealt], "shards")


def k_labels(
    labels: np.ndarray, clients: int, k: int, rng: np.random.Generator
) -> list[np.ndarray]:
    classes = rng.permutation(np.unique(labels))
    if k > len(classes):
        raise DataError(f"k_labels: k = {k} but there are only {len(classes)} labels")
    if clients * k < len(classes):
        raise DataError(
            f"k_labels: {clients} clients x {k} labels cannot cover all {len(classes)} labels"
        )
    chosen = [[classes[(c * k + j) % len(classes)] for j in range(k)] for c in range(clients)]
    holders: dict[int, list[int]] = {}
    for c, owned in enumerate(chosen):
        for label in owned:
            holders.setdefault(int(label), []).append(c)
    parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
    for label, owners in holders.items():
        members = rng.permutation(np.flatnonzero(labels == label))
        if len(members) < len(owners):
            raise DataError(
                f"k_labels: label {label} has {len(members)} samples but {len(owners)} "
                "clients must each get some; use fewer clients or a smaller k"
            )
        for c, piece in zip(owners, np.array_split(members, len(owners)), strict=True):
            parts[c].append(piece)
    return _check([np.concatenate(p) for p in parts], "k_labels partition")


def power_law(n: int, clients: int, sigma: float, rng: np.random.Generator) -> list[np.ndarray]:
    if n < clients:
        raise DataError(f"power_law: {n} samples cannot fill {clients} clients")
    weights = rng.lognormal(0.0, sigma, size=clients)
    sizes = 1 + np.floor(weights / weights.sum() * (n - clients)).astype(np.int64)
    sizes[np.argmax(sizes)] += n - sizes.sum()
    cuts = np.cumsum(sizes)[:-1]
    return _check(np.split(rng.permutation(n), cuts), "power_law partition")


def natural(ids: np.ndarray) -> list[np.ndarray]:
    _, inverse = np.unique(ids, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    counts = np.bincount(inverse)
    return _check(np.split(order, np.cumsum(counts)[:-1]), "natural partition")
