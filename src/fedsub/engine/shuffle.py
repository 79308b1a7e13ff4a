"""Each client's local sample order: fresh shuffles of its data, concatenated (cycling) until
``steps * batch_size`` indices are drawn.

The shuffle of client k in round r depends only on (seed, r, k), never on who else is in the
cohort or on the backend, and is computed for a whole cohort at once: every (client, pass,
sample) gets a counter-based pseudo-random key (SplitMix64), and sorting by key within each
(client, pass) gives independent uniform permutations. No generator object per client.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser, element-wise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MUL1
        z = (z ^ (z >> np.uint64(27))) * _MUL2
        return z ^ (z >> np.uint64(31))


def _mix(*parts: np.ndarray) -> np.ndarray:
    key = np.zeros(np.broadcast(*parts).shape, dtype=np.uint64)
    for part in parts:
        key = splitmix64(key ^ np.asarray(part).astype(np.uint64))
    return key


def cohort_schedules(
    seed: int,
    round_index: int,
    clients: np.ndarray,
    counts: np.ndarray,
    steps: int,
    batch_size: int,
) -> np.ndarray:
    """[K, steps, batch_size] local sample indices for each client of a cohort."""
    clients = np.asarray(clients, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    needed = steps * batch_size
    passes = -(-needed // counts)  # ceil
    block = passes * counts  # elements per client over all its passes
    member = np.repeat(np.arange(len(clients)), block)
    start = np.repeat(np.cumsum(block) - block, block)
    position = np.arange(block.sum()) - start  # index within the client's block
    if (passes == 1).all():  # one pass each (the usual case): no divisions needed
        sample, pass_index = position, np.zeros_like(position)
    else:
        sample, pass_index = position % counts[member], position // counts[member]
    # _mix(seed, round, client, pass, sample), with the per-client prefix mixed once per client.
    client_keys = _mix(np.uint64(seed), np.uint64(round_index), clients)
    keys = splitmix64(
        splitmix64(client_keys[member] ^ pass_index.astype(np.uint64)) ^ sample.astype(np.uint64)
    )
    # One sort of (block, high 32 key bits): blocks stay in place, shuffled inside. Ties of
    # the 32-bit keys inside a block (probability ~ n^2 / 2^33) keep their sample order.
    pass_block = np.cumsum(passes)[member] - passes[member] + pass_index
    order = np.argsort(
        (pass_block.astype(np.uint64) << np.uint64(32)) | (keys >> np.uint64(32)), kind="stable"
    )
    shuffled = sample[order]
    take = (np.cumsum(block) - block)[:, None] + np.arange(needed)[None, :]
    return shuffled[take].reshape(len(clients), steps, batch_size)
