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

Every node's noise is a function of (key, table, row, level, node index) only: a keyed
pseudo-random function, AES-256 (FIPS-197, through the ``cryptography`` library, as the
secure-aggregation masks use ChaCha20) of the 16-byte counter block (pair, node index, level,
row), i.e. AES-CTR's keystream at chosen counters, computed for every block in one call. The
256-bit key is derived from the run's secret (``dp.randomness = "secret"``) and the table. So a
row's noise at any round is computable on its own: the private rows (``rows = "private"``)
draw only the rows selected, a round stays O(touched + selected), and the dense tree over
every row is the same numbers (tests/test_dp_ftrl.py checks both).

The Gaussian of the keystream has two versions, and the version is part of a run's private DP
state (``StreamVersionRecord``, the ``dp_noise_stream`` checkpoint stage); a key carries its
version (``StreamKey``):

- version 2, what new runs draw: the ziggurat method of Marsaglia and Tsang 2000
  (dp/ziggurat.py), each entry from its own stream of 64-bit words: word 0 of an entry at
  position j of its row's vector is word j % 2 of the block (j // 2, node, level, row) (a
  block's two 64-bit words are its uint32 words (0, 1) and (2, 3), little-endian), and the
  ~1.4% of entries not accepted in their rectangle read block k = 1, 2, ... at the counter
  (j // 2 + (j % 2) 2^20 + k 2^21, node, level, row). The key is derived apart from version
  1's (``stream_key``), so the two streams are independent. No transcendental function on
  the fast path: about 2x faster than version 1 over a 20,009-row table, 1.3-2x at widths 4
  and 16, and as fast on draws of 50-500 entries of width 1 (a few pending entries go one at
  a time in Python, their retry blocks packed in Python: benchmarks/noise_stream.py,
  benchmarks/README.md).
- version 1, what runs started before versions draw, kept so that they resume bit for bit:
  Box-Muller from two 53-bit uniforms (as numpy's doubles are built from two 32-bit words)
  per block (pair p, node, level, row), its cosine normal at position 2p and its sine at
  2p + 1; the tail beyond 8.5 standard deviations is not reached, as for every
  floating-point Gaussian sampler. A plain 32-byte key (no version) draws version 1.

Both are position-independent: an entry's value is a function of (key, row, level, node, its
position in the row's vector) only, whatever else is drawn in the same call.
"""

from __future__ import annotations

import functools
import struct
import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedsub.dp import ziggurat
from fedsub.numerics import seeding

__all__ = [
    "FTRL_PURPOSE",
    "STREAM_VERSION",
    "STREAM_VERSIONS",
    "VERSION_STAGE",
    "Key",
    "RowsCounter",
    "StreamKey",
    "StreamVersionRecord",
    "decomposition",
    "difference_terms",
    "entry_noise",
    "every_node_noise",
    "honaker_prefix",
    "keystream_words",
    "node_noise",
    "node_terms",
    "prefix_difference",
    "stream_key",
    "subtree_sum",
    "table_key",
    "version_of",
]

FTRL_PURPOSE = 7  # the spawn key of the tree's streams under seeding.DP

Key = bytes
"""A tree's 32-byte AES-256 key (``table_key``): a ``StreamKey``, or plain bytes (version 1)."""

STREAM_VERSION = 2  # the noise stream a new run draws (module docstring)
STREAM_VERSIONS = (1, 2)  # the versions this fedsub draws: 1 for runs resumed from before


class StreamKey(bytes):
    """A 32-byte AES-256 key and the version of the noise stream drawn under it."""

    version: int

    def __new__(cls, key: bytes, version: int) -> StreamKey:
        if version not in STREAM_VERSIONS:
            raise ValueError(f"noise stream version {version}: this fedsub draws {STREAM_VERSIONS}")
        made = super().__new__(cls, key)
        made.version = version
        return made

    def __reduce__(self):  # pickled with its version (bytes' own would drop it)
        return StreamKey, (bytes(self), self.version)


def version_of(key: Key) -> int:
    """The noise stream version ``key`` draws (a plain key: 1, the stream before versions)."""
    return getattr(key, "version", 1)


def keystream_words(counter: np.ndarray, key: Key) -> np.ndarray:
    """AES-256 under ``key`` of each row of ``counter`` ((n, 4) uint32 words, little-endian,
    one 16-byte block each): (n, 4) uint32. ECB over distinct counter blocks is CTR mode's
    keystream at those counters: a pseudo-random function of (key, block)."""
    blocks = np.ascontiguousarray(counter, dtype="<u4")
    if not blocks.size:
        return np.zeros((0, 4), dtype=np.uint32)
    out = np.empty(blocks.nbytes + 16, dtype=np.uint8)  # update_into's room (a block of slack)
    written = _encryptor(key, threading.get_ident()).update_into(blocks.data.cast("B"), out)
    return out[:written].view("<u4").reshape(-1, 4)


@functools.lru_cache(maxsize=64)
def _encryptor(key: Key, thread: int):
    """One AES-256-ECB encryptor per key and thread (an OpenSSL context is not shared across
    threads), reused: ECB keeps no state between whole blocks, so each ``update_into`` is the
    cipher of its blocks alone (never finalized)."""
    return Cipher(algorithms.AES(key), modes.ECB()).encryptor()


def table_key(seed: seeding.Seed, table: int, version: int = STREAM_VERSION) -> StreamKey:
    """The AES-256 key of table number ``table``'s tree (``stream_key`` of FTRL_PURPOSE)."""
    return stream_key(seed, FTRL_PURPOSE, table, version)


def stream_key(seed: seeding.Seed, purpose: int, table: int, version: int) -> StreamKey:
    """The key of stream ``table`` of ``purpose`` (the tree's, the BLT's) for noise stream
    ``version``: 256 bits of the SeedSequence of (seed, DP, purpose, table), and version 2
    of (seed, DP, purpose, table, 2), its own derivation, so that the streams of the two
    versions are independent; the seed is the run's secret (or train.seed when seeded)."""
    domain = (table,) if version == 1 else (table, version)
    words = seeding.seed_sequence(seed, seeding.DP, purpose, *domain).generate_state(8)
    return StreamKey(np.asarray(words, dtype="<u4").tobytes(), version)


def node_noise(key: Key, rows: np.ndarray, level: int, nodes: np.ndarray, dim: int) -> np.ndarray:
    """Standard normal noise of the tree nodes (``level``, each of ``nodes``) of each of
    ``rows``: (len(rows), len(nodes), dim) float64, every entry a function of (key, row,
    level, node, its position) only (``entry_noise`` of every pair, row by row)."""
    nodes = np.asarray(nodes)
    pairs = np.repeat(np.asarray(rows), len(nodes)), np.tile(nodes, len(rows))
    flat = entry_noise(key, pairs[0], np.full(len(pairs[0]), level), pairs[1], dim)
    return flat.reshape(len(rows), len(nodes), dim)


class RowsCounter:
    """The counter blocks of one node of every row 0 .. rows - 1, kept: a dense stream
    (dp/ftrl.py's ``DenseTree``, dp/blt_noise.py's ``DenseBlt``) draws a node of every row each
    round, and only the node's two counter words change. ``noise`` is ``node_noise(key,
    np.arange(rows), level, [node], dim)[:, 0]`` (the same blocks in the same order)."""

    def __init__(self, rows: int, dim: int) -> None:
        pairs = (dim + 1) // 2
        self.rows, self.dim = rows, dim
        self.counter = np.zeros((rows, pairs, 4), dtype=np.uint32)
        self.counter[..., 0] = np.arange(pairs, dtype=np.uint32)
        self.counter[..., 3] = np.arange(rows, dtype=np.uint32)[:, None]
        self.flat = self.counter.reshape(-1, 4)
        self.many = self.flat[:0]  # ``nodes_noise``'s blocks of several nodes (grown on use)
        self.flat_level = 0  # the level columns as written (zeros: level 0)
        self.many_levels: list[int] = []

    def noise(self, key: Key, level: int, node: int) -> np.ndarray:
        """The noise of node (``level``, ``node``) of every row: (rows, dim) float64."""
        self.flat[:, 1] = node
        if self.flat_level != level:  # a column written only when it changes (BLT: never)
            self.flat[:, 2] = self.flat_level = level
        return _draw(key, self.flat, self.rows, self.dim)

    def nodes_noise(self, key: Key, nodes: list[tuple[int, int]]) -> np.ndarray:
        """``noise`` of each (level, node) of ``nodes`` in one draw: (len(nodes), rows, dim)
        float64 (the blocks of each node in turn, as ``every_node_noise`` orders them)."""
        if len(nodes) == 1:
            return self.noise(key, *nodes[0])[None]
        size = len(self.flat)
        if len(self.many) < len(nodes) * size:  # the blocks of more nodes: kept, grown
            self.many = np.tile(self.flat, (len(nodes), 1))
            self.many_levels = [-1] * len(nodes)  # every level column to write
        many = self.many[: len(nodes) * size]
        for k, (level, node) in enumerate(nodes):
            many[k * size : (k + 1) * size, 1] = node
            if self.many_levels[k] != level:  # the tree's node k is at level k: once
                many[k * size : (k + 1) * size, 2] = self.many_levels[k] = level
        return _draw(key, many, len(nodes) * self.rows, self.dim).reshape(
            len(nodes), self.rows, self.dim
        )


def every_node_noise(
    key: Key, rows: np.ndarray, nodes: list[tuple[int, int]], dim: int
) -> np.ndarray:
    """``node_noise`` of each (level, index) of ``nodes`` for each of ``rows``, in one
    keystream call: (len(nodes), len(rows), dim) float64, the same numbers as a
    ``node_noise`` call per node (``entry_noise`` of every pair, node by node)."""
    count = len(rows)
    levels = np.repeat(np.array([level for level, _ in nodes], dtype=np.int64), count)
    indices = np.repeat(np.array([index for _, index in nodes], dtype=np.int64), count)
    flat = entry_noise(key, np.tile(np.asarray(rows), len(nodes)), levels, indices, dim)
    return flat.reshape(len(nodes), count, dim)


def entry_noise(
    key: Key, rows: np.ndarray, levels: np.ndarray, nodes: np.ndarray, dim: int
) -> np.ndarray:
    """``node_noise`` of the nodes (levels[i], nodes[i]) of rows[i], one entry each:
    (len(rows), dim), the same numbers as ``node_noise`` draws for that (row, level, node)."""
    pairs = (dim + 1) // 2
    count = len(rows)
    if pairs == 1:  # the same blocks, written column by column (no broadcast: faster)
        counter = np.zeros((count, 4), dtype=np.uint32)
        counter[:, 1], counter[:, 2], counter[:, 3] = nodes, levels, rows
        return _draw(key, counter, count, dim)
    counter = np.empty((count, pairs, 4), dtype=np.uint32)
    counter[..., 0] = np.arange(pairs, dtype=np.uint32)
    counter[..., 1] = np.asarray(nodes, dtype=np.uint32)[:, None]
    counter[..., 2] = np.asarray(levels, dtype=np.uint32)[:, None]
    counter[..., 3] = np.asarray(rows, dtype=np.uint32)[:, None]
    return _draw(key, counter.reshape(-1, 4), count, dim)


def _draw(key: Key, counter: np.ndarray, count: int, dim: int) -> np.ndarray:
    """``count`` rows of ``dim`` standard normals from the (count * pairs, 4) counter blocks
    (pair, node, level, row), by ``key``'s stream version (module docstring)."""
    if version_of(key) == 1:
        return _entries(keystream_words(counter, key), count, dim)
    return _entries_v2(key, counter, count, dim)


PAIR_BITS = 20  # version 2's retry counters: word 0 = pair + slot 2^20 + step 2^21
STEPS = 1 << (32 - PAIR_BITS - 1)  # steps a retry counter can name (more are never needed)


def _entries_v2(key: Key, counter: np.ndarray, count: int, dim: int) -> np.ndarray:
    """Version 2 (module docstring): the ziggurat over each entry's word stream, its first
    word from the block of its pair and the few later ones from its own retry counters. A
    large draw takes its first words and fast path in pieces of about ``CHUNK`` entries (its
    arrays stay in the cache), then the entries no piece accepted at once all together (one
    vectorised step for a draw of several nodes or pieces): the same numbers, every entry's
    value being its own."""
    pairs = (dim + 1) // 2
    if pairs > 1 << PAIR_BITS:
        raise ValueError(f"noise stream version 2 draws at most {2 << PAIR_BITS} values an entry")
    piece = max(CHUNK // dim, 1)  # rows a piece
    out = np.empty(count * dim)
    pending, words = [], []
    for start in range(0, count, piece):
        stop = min(start + piece, count)
        part = keystream_words(counter[start * pairs : stop * pairs], key).view(np.uint64)
        part = part.reshape(stop - start, 2 * pairs)
        if dim == 2 * pairs:
            first = part.reshape(-1)
        else:  # an odd width: the last pair's second word is not read (dim 1: a strided view)
            first = part[:, 0] if dim == 1 else part[:, :dim].reshape(-1)
        at = ziggurat.accepted(first, out[start * dim : stop * dim])
        pending.append(at + start * dim)
        words.append(first[at])
    if pending:  # one piece's as they are, several pieces' together
        at, first = (
            (pending[0], words[0]) if len(pending) == 1 else map(np.concatenate, (pending, words))
        )
        ziggurat.finish(out, at, first, _more(key, counter, dim))
    return out.reshape(count, dim)


CHUNK = 20480  # _entries_v2: the entries of a piece (its arrays in the CPU's cache)
# version 2's retry counters by step: word 0 = step 2^21 (the block's pair and slot OR-ed in)
_STEP_TAGS = np.zeros((STEPS, 4), dtype=np.uint32)
_STEP_TAGS[:, 0] = np.arange(STEPS, dtype=np.uint32) << (PAIR_BITS + 1)


BLOCK_ITEM = np.dtype("V16")  # a counter block as one item (``_items``)


def _items(counter: np.ndarray) -> np.ndarray:
    """The (n, 4) uint32 counter blocks as n 16-byte items: a gather or copy of whole blocks
    in one long loop instead of numpy's loops over rows of four words (the same bytes)."""
    return np.ascontiguousarray(counter, dtype=np.uint32).view(BLOCK_ITEM)[:, 0]


def _stepped(items: np.ndarray, step: int, steps: int) -> np.ndarray:
    """``blocks[:, None, :] | _STEP_TAGS[step : step + steps]`` of the blocks ``items``
    (``_items``), (len(items), steps, 4): each block copied once a step and the step OR-ed
    into its word 0 (the same bytes)."""
    out = np.empty((len(items), steps, 4), dtype=np.uint32)
    whole = out.view(BLOCK_ITEM)[..., 0]  # (entries, steps) of whole blocks
    for k in range(steps):
        whole[:, k] = items
        out[:, k, 0] |= _STEP_TAGS[step + k, 0]
    return out


def _more(key: Key, counter: np.ndarray, dim: int) -> ziggurat.More:
    """``ziggurat.More`` of the entries drawn from ``counter`` (entry e: position e % dim of
    row e // dim): blocks step .. step + steps - 1 of each entry's retry counters."""
    pairs = (dim + 1) // 2
    items = _items(counter)

    def more(entries: np.ndarray, step: int, steps: int) -> np.ndarray:
        if step + steps > STEPS:  # each step ends an entry with probability > 1/2: never
            raise RuntimeError(f"a ziggurat draw took {STEPS} steps")
        if len(entries) <= ziggurat.SCALAR:  # a few: the same blocks, packed in Python
            if dim == 1:
                return _few_blocks(key, counter[entries].tolist(), [0] * len(entries), step, steps)
            places = [divmod(e, dim) for e in entries.tolist()]  # (owner, position)
            at = [owner * pairs + position // 2 for owner, position in places]
            slots = [(position % 2) << PAIR_BITS for _, position in places]
            return _few_blocks(key, counter[at].tolist(), slots, step, steps)
        # each entry's block, with the step in word 0 (``_STEP_TAGS``): (entries, steps, 4)
        if dim == 1:  # an entry a block, in slot 0
            blocks = _stepped(items[entries], step, steps)
        else:
            owner, position = np.divmod(entries, dim)
            blocks = _stepped(items[owner * pairs + position // 2], step, steps)
            blocks[..., 0] |= ((position % 2).astype(np.uint32) << PAIR_BITS)[:, None]
        return keystream_words(blocks.reshape(-1, 4), key).view(np.uint64).reshape(-1, steps, 2)

    return more


_BLOCK = struct.Struct("<4I")


def _few_blocks(
    key: Key, blocks: list[list[int]], slots: list[int], step: int, steps: int
) -> np.ndarray:
    """The keystream of steps ``step`` .. ``step + steps - 1`` of a few entries, each from its
    pair's counter block (``blocks``) and its slot's tag (``slots``: 0, or 2^20 for the
    second entry of a pair), packed in Python (fewer numpy calls than the array path, the
    same bytes): (len(blocks), steps, 2) uint64."""
    tags = [k << (PAIR_BITS + 1) for k in range(step, step + steps)]
    data = b"".join(
        [
            _BLOCK.pack(w | slot | tag, x, y, z)
            for (w, x, y, z), slot in zip(blocks, slots, strict=True)
            for tag in tags
        ]
    )
    out = _encryptor(key, threading.get_ident()).update(data)
    return np.frombuffer(out, dtype="<u8").reshape(-1, steps, 2)


SCALE = 1.0 / 2.0**53
TWO_PI = 2.0 * np.pi


def _uniform53(high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """(high >> 5) 2^26 + (low >> 6) of two uint32 word columns, as float64 (exact: the
    integer is below 2^53)."""
    out = (high >> 5).astype(np.float64)
    out *= float(1 << 26)
    out += low >> 6
    return out


def _entries(words: np.ndarray, count: int, dim: int) -> np.ndarray:
    """``count`` rows of ``dim`` standard normals from (count * pairs, 4) keystream words:
    Box-Muller on two 53-bit uniforms per block, the block's cosine normal at an even
    position and its sine normal at the next (the sine of a block whose second normal falls
    past ``dim`` is not computed)."""
    pairs = (dim + 1) // 2
    blocks = words.reshape(count, pairs, 4)
    radius = _uniform53(blocks[..., 0], blocks[..., 1])
    radius *= -SCALE
    np.log1p(radius, out=radius)
    radius *= -2.0
    np.sqrt(radius, out=radius)
    angle = _uniform53(blocks[..., 2], blocks[..., 3])
    np.multiply(TWO_PI, angle, out=angle)
    angle *= SCALE
    if dim == 1:  # one normal a block: the cosine's, computed in place (the same numbers)
        np.cos(angle, out=angle)
        angle *= radius
        return angle.reshape(count, 1)
    out = np.empty((count, dim))
    first = np.cos(angle)
    first *= radius
    out[:, 0::2] = first
    second = dim // 2
    if second:
        sine = np.sin(angle[:, :second])
        sine *= radius[:, :second]
        out[:, 1::2] = sine
    return out


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
    now, before = _decomposed(t), _decomposed(since)
    signed = [(*n, 1.0) for n in now if n not in before]
    signed += [(*n, -1.0) for n in before if n not in now]
    if not signed:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    terms = [_signed_terms(*node) for node in signed]
    return (
        np.concatenate([t[0] for t in terms]),
        np.concatenate([t[1] for t in terms]),
        np.concatenate([t[2] for t in terms]),
    )


@functools.lru_cache(maxsize=4096)
def _decomposed(t: int) -> tuple[tuple[int, int], ...]:
    """``decomposition(t)``, kept (a round's rows ask for the same few)."""
    return tuple(decomposition(t))


@functools.lru_cache(maxsize=4096)
def _signed_terms(level: int, index: int, sign: float) -> tuple[np.ndarray, ...]:
    """``node_terms`` with the weights times ``sign`` (+-1: exact), kept per node."""
    levels, nodes, weights = node_terms(level, index)
    return levels, nodes, sign * weights


@functools.lru_cache(maxsize=4096)
def _distinct_terms(t: int, since: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (level, node) entries of ``difference_terms(t, since)`` and where each of
    its terms is among them: a node both decompositions hold under a node of the other (a
    subtree's estimate and the estimates under it) comes in twice, with either sign, and a
    row's entry is one number however often it is read."""
    levels, nodes, _ = difference_terms(t, since)
    keys = levels.astype(np.int64) * (1 << 40) + nodes
    _, first, where = np.unique(keys, return_index=True, return_inverse=True)
    return levels[first], nodes[first], where.reshape(-1)


def _spread(counts: np.ndarray, inverse: np.ndarray) -> tuple[np.ndarray, ...]:
    """Row r takes list ``inverse[r]`` of lists of lengths ``counts``: each flat entry's row,
    its position in the lists concatenated, and each row's first flat entry."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    per_row = counts[inverse]
    owner = np.repeat(np.arange(len(inverse), dtype=np.int64), per_row)
    first = np.cumsum(per_row) - per_row
    at = np.repeat(starts[inverse] - first, per_row) + np.arange(len(owner))
    return owner, at, first


def prefix_difference(
    key: Key, rows: np.ndarray, t: int, since: np.ndarray, dim: int
) -> np.ndarray:
    """(N_r(t) - N_r(since_r)) / sigma for each of ``rows`` in one vectorized draw (the same
    numbers as ``honaker_prefix``'s; since_r = 0: N_r(t)). A row updated in the previous
    round draws only the nodes round t completes (O(1) amortized); O(t) otherwise. Each
    distinct entry of a row is drawn once (``_distinct_terms``) and read by each of its
    terms: the same numbers as a draw per term."""
    out = np.zeros((len(rows), dim))
    if not len(rows):
        return out
    since = np.asarray(since, dtype=np.int64)
    if (since == since[0]).all():  # one last round (a window's rows): ``_uniform_difference``
        return _uniform_difference(key, rows, t, int(since[0]), dim)
    # the terms of each distinct last round once; each row's terms in their order
    values, inverse = np.unique(since, return_inverse=True)
    terms = [difference_terms(t, int(v)) for v in values]
    distinct = [_distinct_terms(t, int(v)) for v in values]
    owner, at, _ = _spread(np.array([len(x[0]) for x in terms], dtype=np.int64), inverse)
    if len(owner):
        drawn_owner, drawn_at, drawn_first = _spread(
            np.array([len(d[0]) for d in distinct], dtype=np.int64), inverse
        )
        levels = np.concatenate([d[0] for d in distinct])[drawn_at]
        nodes = np.concatenate([d[1] for d in distinct])[drawn_at]
        drawn = entry_noise(key, rows[drawn_owner], levels, nodes, dim)
        index = drawn_first[owner] + np.concatenate([d[2] for d in distinct])[at]
        weights = np.concatenate([x[2] for x in terms])[at]
        noise = drawn[index] * weights[:, None]
        # each row's terms added in their order, one entry column at a time: ``np.add.at`` on
        # 1-d arrays (its fast path), the same sums as over the rows of ``out``
        columns, by_entry = np.zeros((dim, len(rows))), np.ascontiguousarray(noise.T)
        for j in range(dim):
            np.add.at(columns[j], owner, by_entry[j])
        out = np.ascontiguousarray(columns.T)
    return out


def _uniform_difference(key: Key, rows: np.ndarray, t: int, since: int, dim: int) -> np.ndarray:
    """``prefix_difference`` when every row's last round is ``since`` (a window's selection,
    noised round after round): the distinct entries of every row in one call, and each row's
    terms (each entry's noise times its weight) added in their order from +0.0
    (``np.add.accumulate`` over the terms, never reordered: the sums of ``np.add.at``), without
    the per-row bookkeeping of rows with different last rounds. The same numbers."""
    levels, nodes, where = _distinct_terms(t, since)
    weights = difference_terms(t, since)[2]
    if not len(where):  # since = t: nothing
        return np.zeros((len(rows), dim))
    pairs = list(zip(levels.tolist(), nodes.tolist(), strict=True))
    drawn = every_node_noise(key, rows, pairs, dim)  # (distinct, rows, dim)
    terms = np.empty((len(where) + 1, len(rows), dim))
    terms[0] = 0.0
    np.multiply(drawn[where], weights[:, None, None], out=terms[1:])
    return np.add.accumulate(terms, axis=0)[-1]


def decomposition(t: int) -> list[tuple[int, int]]:
    """The complete dyadic nodes (level, index) whose union is the first ``t`` rounds, the
    highest first (one per bit of t)."""
    nodes, start = [], 0
    for level in reversed(range(max(t.bit_length(), 1))):
        if t >> level & 1:
            nodes.append((level, start >> level))
            start += 1 << level
    return nodes


def subtree_sum(key: Key, rows: np.ndarray, level: int, index: int, dim: int) -> np.ndarray:
    """Honaker's b(level, index) of each row (module docstring): (len(rows), dim), from the
    2^(level + 1) - 1 node noises of its subtree."""
    total = np.zeros((len(rows), dim))
    for m in range(level + 1):
        width = 1 << (level - m)
        nodes = np.arange(index * width, (index + 1) * width)
        total += node_noise(key, rows, m, nodes, dim).sum(axis=1) * 2.0 ** -(level - m)
    return total


def honaker_prefix(key: Key, rows: np.ndarray, t: int, dim: int) -> np.ndarray:
    """N(t) / sigma for each row: the sum of Honaker's estimates of the nodes of t's
    decomposition (module docstring); zeros for t = 0. O(t) node draws per row."""
    total = np.zeros((len(rows), dim))
    for level, index in decomposition(t):
        total += subtree_sum(key, rows, level, index, dim) / (2.0 - 2.0**-level)
    return total


VERSION_STAGE = "dp_noise_stream"  # the checkpoint stage of a DP-FTRL run's stream version


class Versioned(Protocol):
    """A DP-FTRL mechanism as ``StreamVersionRecord`` sees it (dp/ftrl.py's, dp/ftrl_blt.py's):
    the version its keys draw, and what it derived from the keys."""

    noise_version: int
    keys: dict[int, Key]
    trees: dict


@dataclass
class StreamVersionRecord:
    """The noise stream version a DP-FTRL run draws its tree or BLT noise with, as a
    checkpoint stage (``dp_noise_stream``): a resumed run continues with the version it
    started with. A tree node (or a BLT round's z) released before a resume is part of the
    noise every later release carries (the prefix sums, C^-1 z): drawing the rest of the run
    from another version would release those nodes again with other noise, which the
    accounting (one release of each node) does not cover. So a checkpoint written before
    versions (no such stage: ``load_absent``) resumes with version 1, bit for bit, and a
    version this fedsub does not know is refused."""

    owner: Versioned

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"version": torch.tensor(self.owner.noise_version, dtype=torch.int64)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if set(tensors) != {"version"}:
            raise ValueError(
                f"{VERSION_STAGE}.safetensors holds {sorted(tensors)}, expected one 'version'"
            )
        version = int(tensors["version"])
        if version not in STREAM_VERSIONS:
            raise ValueError(
                f"{VERSION_STAGE}.safetensors's 'version' is {version}: this fedsub draws the "
                f"noise stream versions {', '.join(map(str, STREAM_VERSIONS))}; resume the run "
                "with the fedsub that wrote it"
            )
        self.use(version)

    def load_absent(self) -> None:
        """A checkpoint of a run started before versions: it drew version 1."""
        self.use(1)

    def use(self, version: int) -> None:
        """Draw ``version`` from now on (before the run's first round: keys derived with
        another version, and the streams built with them, are dropped)."""
        if self.owner.noise_version != version:
            self.owner.noise_version = version
            self.owner.keys.clear()
            self.owner.trees.clear()
            getattr(self.owner, "row_buffers", {}).clear()
