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

Seed 004's two MNIST splits (Li et al., appendix D, Table 2) keep a subset of the samples by
design:

- ``li_balanced``: the authors' public ``generate_equal.py``: every label is cut into
  equal shards, and each client in turn draws ``k`` distinct labels at random among those
  with shards left and takes one shard of each (100 clients x 2 digits x 271 = 54,200).
- ``li_unbalanced``: the construction of the FedProx code Li et al. build on
  (``data/mnist/generate_niid.py``, sized for 100 devices): client ``u`` holds labels
  ``u, u+1, ... (mod C)``; every (client, label) slot first gets ``floor`` samples, then the
  rest of each label is shared among its slots in LogNormal(0, sigma) proportions (floored).
  On MNIST's 70,000 samples with a 90/10 train/test split per device (``split_each``) this
  gives 62,865 +- 5 training samples (Table 2: 62,864), mean 628.6 (628), std about 945
  (800; the 5-95% range over seeds is 760-1140).
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


GENERIC = ("iid", "dirichlet", "shards", "k-labels", "power-law")  # their config names


def by_name(
    name: str,
    labels: np.ndarray,
    clients: int,
    rng: np.random.Generator,
    *,
    labels_per_client: int,
    dirichlet_alpha: float,
    power_law_sigma: float,
) -> list[np.ndarray]:
    """One of the ``GENERIC`` partitioners by its config name (a labeled dataset's options)."""
    if name == "iid":
        return iid(len(labels), clients, rng)
    if name == "dirichlet":
        return dirichlet(labels, clients, dirichlet_alpha, rng)
    if name == "shards":
        return shards(labels, clients, labels_per_client, rng)
    if name == "k-labels":
        return k_labels(labels, clients, labels_per_client, rng)
    if name == "power-law":
        return power_law(len(labels), clients, power_law_sigma, rng)
    raise DataError(f"unknown partition {name!r}; expected one of {', '.join(GENERIC)}")


def li_balanced(
    labels: np.ndarray,
    clients: int,
    k: int,
    per_label: int,
    rng: np.random.Generator,
    tries: int = 100,
) -> list[np.ndarray]:
    """Every client: ``k`` distinct labels, ``per_label`` samples of each (seed 004's balanced
    MNIST). The ``clients * k`` shards are spread over the labels as evenly as possible."""
    classes = np.unique(labels)
    if k > len(classes):
        raise DataError(f"li-balanced: k = {k} but there are only {len(classes)} labels")
    counts = np.full(len(classes), clients * k // len(classes))
    counts[rng.permutation(len(classes))[: clients * k % len(classes)]] += 1
    for label, shards_of_label in zip(classes, counts, strict=True):
        have = int(np.sum(labels == label))
        if have < shards_of_label * per_label:
            raise DataError(
                f"li-balanced: label {label} has {have} samples, but {shards_of_label} clients "
                f"need {per_label} each; lower samples_per_client or num_clients"
            )
    for _ in range(tries):
        dealt = _deal_distinct(counts, clients, k, rng)
        if dealt is not None:
            break
    else:
        raise DataError(
            f"li-balanced: after {tries} draws some client could not get {k} distinct labels; "
            "use fewer labels per client"
        )
    shards = [
        rng.permutation(np.flatnonzero(labels == label))[: n * per_label].reshape(n, per_label)
        for label, n in zip(classes, counts, strict=True)
    ]
    taken = [0] * len(classes)
    parts = []
    for chosen in dealt:
        pieces = []
        for c in chosen:
            pieces.append(shards[c][taken[c]])
            taken[c] += 1
        parts.append(np.concatenate(pieces))
    return _check(parts, "li-balanced partition")


def _deal_distinct(
    counts: np.ndarray, clients: int, k: int, rng: np.random.Generator
) -> list[list[int]] | None:
    """Client after client, ``k`` distinct label positions drawn uniformly among those with
    shards left (the authors' ``choose_two_digit``); None at a dead end."""
    left = counts.copy()
    dealt = []
    for _ in range(clients):
        available = np.flatnonzero(left > 0)
        if len(available) < k:
            return None
        chosen = rng.choice(available, size=k, replace=False)
        left[chosen] -= 1
        dealt.append(chosen.tolist())
    return dealt


def li_unbalanced(
    labels: np.ndarray,
    clients: int,
    k: int,
    sigma: float,
    rng: np.random.Generator,
    floor: int = 5,
) -> list[np.ndarray]:
    """Client ``u`` holds labels ``u .. u+k-1 (mod C)``: ``floor`` samples per label, then
    each label's rest shared among its (client, label) slots in LogNormal(0, ``sigma``)
    proportions, floored (the samples the floors leave over are not used)."""
    classes = np.unique(labels)
    if k > len(classes):
        raise DataError(f"li-unbalanced: k = {k} but there are only {len(classes)} labels")
    slot_label = (np.arange(clients)[:, None] + np.arange(k)[None, :]) % len(classes)
    weights = rng.lognormal(0.0, sigma, size=slot_label.shape)
    sizes = np.zeros(slot_label.shape, dtype=np.int64)
    pools = []
    for c, label in enumerate(classes):
        slots = slot_label == c
        members = np.flatnonzero(labels == label)
        rest = len(members) - floor * int(slots.sum())
        if rest < 0:
            raise DataError(
                f"li-unbalanced: label {label} has {len(members)} samples, but its "
                f"{int(slots.sum())} client slots need {floor} each; use fewer clients"
            )
        share = weights[slots] / weights[slots].sum()
        sizes[slots] = floor + np.floor(share * rest).astype(np.int64)
        pools.append(rng.permutation(members))
    used = [0] * len(classes)
    parts = []
    for client in range(clients):
        pieces = []
        for j in range(k):
            c = int(slot_label[client, j])
            pieces.append(pools[c][used[c] : used[c] + sizes[client, j]])
            used[c] += int(sizes[client, j])
        parts.append(np.concatenate(pieces))
    return _check(parts, "li-unbalanced partition")


def split_each(
    parts: list[np.ndarray], test_fraction: float, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each client's samples shuffled and split: the first ``floor((1 - test_fraction) * n)``
    train, the rest test (the FedProx / Li et al. generators' 90/10 split)."""
    train, test = [], []
    for part in parts:
        shuffled = rng.permutation(part)
        cut = max(1, int((1.0 - test_fraction) * len(part)))
        train.append(np.sort(shuffled[:cut]))
        test.append(np.sort(shuffled[cut:]))
    return train, test
