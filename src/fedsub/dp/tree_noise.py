"""Tree-aggregation noise for DP-FTRL, per row and without O(V) state (dp/ftrl.py uses it).

Kairouz et al. 2021 ("Practical and Private (Deep) Learning without Sampling or Shuffling",
ICML, arXiv 2103.00039) release the prefix sums s_t = sum_{i <= t} x_i of a stream through a
binary tree: every complete dyadic interval [i 2^l, (i + 1) 2^l) of the rounds (a node at level
l) gets its own Gaussian noise n(l, i) ~ N(0, sigma^2 I), and the prefix of t rounds is the sum
of the nodes of t's binary decomposition. Their experiments (and TF Privacy's / TFF's
``EfficientTreeAggregator``, which the DP-FTRL code uses) take Honaker's (2015) online,
bottom-up estimate of each node instead of its raw noisy value:

    b(0, i) = n(0, i),   b(l, i) = n(l, i) + (b(l - 1, 2i) + b(l - 1, 2i + 1)) / 2,
    estimate(l, i) = b(l, i) / (2 - 2^-l),

unbiased with variance sigma^2 / (2 - 2^-l) (the estimate of a node is a fixed linear function
of the released noisy nodes of its subtree, so the privacy is the tree's). The noise of the
prefix of t rounds is ``N(t) = sum over the nodes (l, i) of t's decomposition of
estimate(l, i)``, and ``b(l, i) = sum_{m <= l} 2^-(l - m) sum of n(m, j) over the level-m nodes
j under (l, i)``.

Every node's noise is a function of (key, table, row, level, node index) only: a counter-based
generator, Philox4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3";
the generator of Random123, cuRAND and JAX), keyed by 64 bits derived from the run's secret
(``dp.randomness = "secret"``; the same key width as the torch generators of
dp/mechanism.py) and the table, with the counter (pair, node index, level, row). So a row's
noise at any round is computable on its own: the private rows (``rows = "private"``) draw
only the rows selected, a round stays O(touched + selected), and the dense tree over every
row is the same numbers (tests/test_dp_ftrl.py checks both).

Gaussians by Box-Muller from two 53-bit uniforms (as numpy's doubles are built from two
32-bit words): the tail beyond 8.5 standard deviations is not reached, as for every
floating-point Gaussian sampler.
"""

from __future__ import annotations

import functools

import numpy as np

from fedsub.numerics import seeding

__all__ = [
    "FTRL_PURPOSE",
    "decomposition",
    "difference_terms",
    "entry_noise",
    "honaker_prefix",
    "node_noise",
    "node_terms",
    "philox4x32",
    "prefix_difference",
    "subtree_sum",
    "table_key",
]

FTRL_PURPOSE = 7  # the spawn key of the tree's streams under seeding.DP

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LOW = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def philox4x32(counter: np.ndarray, key: tuple[int, int], rounds: int = 10) -> np.ndarray:
    """Philox4x32-``rounds`` (Salmon et al. 2011) of each row of ``counter`` (n, 4) uint32
    words under ``key`` (two uint32 words): (n, 4) uint32."""
    c = [counter[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & _LOW, (k1 + _W1) & _LOW
        p0, p1 = _M0 * c[0], _M1 * c[2]  # 32 x 32 -> 64 bits, exact in uint64
        hi0, lo0, hi1, lo1 = p0 >> _SHIFT, p0 & _LOW, p1 >> _SHIFT, p1 & _LOW
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return np.stack(c, axis=1).astype(np.uint32)


def table_key(seed: seeding.Seed, table: int) -> tuple[int, int]:
    """The Philox key of table number ``table``'s tree: 64 bits of the SeedSequence of (seed,
    DP, FTRL_PURPOSE, table); the seed is the run's secret (or train.seed when seeded)."""
    words = seeding.seed_sequence(seed, seeding.DP, FTRL_PURPOSE, table).generate_state(2)
    return int(words[0]), int(words[1])


def node_noise(
    key: tuple[int, int], rows: np.ndarray, level: int, nodes: np.ndarray, dim: int
) -> np.ndarray:
    """Standard normal noise of the tree nodes (``level``, each of ``nodes``) of each of
    ``rows``: (len(rows), len(nodes), dim) float64, every entry a function of (key, row,
    level, node, its position) only (``entry_noise`` of every pair)."""
    every_row = np.repeat(rows, len(nodes))
    every_node = np.tile(nodes, len(rows))
    levels = np.full(len(every_row), level, dtype=np.int64)
    flat = entry_noise(key, every_row, levels, every_node, dim)
    return flat.reshape(len(rows), len(nodes), dim)


def entry_noise(
    key: tuple[int, int], rows: np.ndarray, levels: np.ndarray, nodes: np.ndarray, dim: int
) -> np.ndarray:
    """``node_noise`` of the nodes (levels[i], nodes[i]) of rows[i], one entry each:
    (len(rows), dim), the same numbers as ``node_noise`` draws for that (row, level, node)."""
    pairs = (dim + 1) // 2
    count = len(rows)
    counter = np.empty((count * pairs, 4), dtype=np.uint32)
    counter[:, 0] = np.tile(np.arange(pairs, dtype=np.uint32), count)
    counter[:, 1] = np.repeat(nodes.astype(np.uint32), pairs)
    counter[:, 2] = np.repeat(levels.astype(np.uint32), pairs)
    counter[:, 3] = np.repeat(rows.astype(np.uint32), pairs)
    return _normals(philox4x32(counter, key)).reshape(count, 2 * pairs)[:, :dim]


def _normals(words32: np.ndarray) -> np.ndarray:
    """Two standard normals from each Philox output (Box-Muller on two 53-bit uniforms):
    (n, 2)."""
    words = words32.astype(np.uint64)
    scale = 1.0 / 2.0**53
    u1 = (words[:, 0] >> np.uint64(5)) * np.uint64(1 << 26) + (words[:, 1] >> np.uint64(6))
    u2 = (words[:, 2] >> np.uint64(5)) * np.uint64(1 << 26) + (words[:, 3] >> np.uint64(6))
    radius = np.sqrt(-2.0 * np.log1p(-u1.astype(np.float64) * scale))
    angle = 2.0 * np.pi * u2.astype(np.float64) * scale
    return np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)


@functools.lru_cache(maxsize=4096)
def node_terms(level: int, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Honaker's estimate of node (level, index) as (levels, nodes, weights): the estimate is
    sum of weights[i] n(levels[i], nodes[i]) over its 2^(level + 1) - 1 subtree nodes."""
    levels, nodes, weights = [], [], []
    for m in range(level + 1):
        width = 1 << (level - m)
        levels.append(np.full(width, m))
        nodes.append(np.arange(index * width, (index + 1) * width))
        weights.append(np.full(width, 2.0 ** -(level - m) / (2.0 - 2.0**-level)))
    return np.concatenate(levels), np.concatenate(nodes), np.concatenate(weights)


@functools.lru_cache(maxsize=4096)
def difference_terms(t: int, since: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """N(t) - N(since) as (levels, nodes, weights), the nodes both decompositions share left
    out (they cancel): for since = t - 1 only the nodes that round t completes remain."""
    now, before = decomposition(t), decomposition(since)
    signed = [(n, 1.0) for n in now if n not in before]
    signed += [(n, -1.0) for n in before if n not in now]
    if not signed:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    terms = [node_terms(*node) for node, _ in signed]
    return (
        np.concatenate([t[0] for t in terms]),
        np.concatenate([t[1] for t in terms]),
        np.concatenate([sign * t[2] for t, (_, sign) in zip(terms, signed, strict=True)]),
    )


def prefix_difference(
    key: tuple[int, int], rows: np.ndarray, t: int, since: np.ndarray, dim: int
) -> np.ndarray:
    """(N_r(t) - N_r(since_r)) / sigma for each of ``rows`` in one vectorized draw (the same
    numbers as ``honaker_prefix``'s; since_r = 0: N_r(t)). A row updated in the previous
    round draws only the nodes round t completes (O(1) amortized); O(t) otherwise."""
    out = np.zeros((len(rows), dim))
    parts = []
    for at in range(len(rows)):
        levels, nodes, weights = difference_terms(t, int(since[at]))
        parts.append((np.full(len(levels), at), levels, nodes, weights))
    if not parts:
        return out
    owner = np.concatenate([p[0] for p in parts]).astype(np.int64)
    levels = np.concatenate([p[1] for p in parts])
    nodes = np.concatenate([p[2] for p in parts])
    weights = np.concatenate([p[3] for p in parts])
    if len(owner):
        noise = entry_noise(key, rows[owner], levels, nodes, dim) * weights[:, None]
        np.add.at(out, owner, noise)
    return out


def decomposition(t: int) -> list[tuple[int, int]]:
    """The complete dyadic nodes (level, index) whose union is the first ``t`` rounds, the
    highest first (one per bit of t)."""
    nodes, start = [], 0
    for level in reversed(range(max(t.bit_length(), 1))):
        if t >> level & 1:
            nodes.append((level, start >> level))
            start += 1 << level
    return nodes


def subtree_sum(
    key: tuple[int, int], rows: np.ndarray, level: int, index: int, dim: int
) -> np.ndarray:
    """Honaker's b(level, index) of each row (module docstring): (len(rows), dim), from the
    2^(level + 1) - 1 node noises of its subtree."""
    total = np.zeros((len(rows), dim))
    for m in range(level + 1):
        width = 1 << (level - m)
        nodes = np.arange(index * width, (index + 1) * width)
        total += node_noise(key, rows, m, nodes, dim).sum(axis=1) * 2.0 ** -(level - m)
    return total


def honaker_prefix(key: tuple[int, int], rows: np.ndarray, t: int, dim: int) -> np.ndarray:
    """N(t) / sigma for each row: the sum of Honaker's estimates of the nodes of t's
    decomposition (module docstring); zeros for t = 0. O(t) node draws per row."""
    total = np.zeros((len(rows), dim))
    for level, index in decomposition(t):
        total += subtree_sum(key, rows, level, index, dim) / (2.0 - 2.0**-level)
    return total
