"""Each client's local sample order: fresh shuffles of its data, concatenated (cycling) until
``steps * batch_size`` indices are drawn.

The shuffle of client k in round r depends only on (seed, r, k), never on who else is in the
cohort, on the backend or on the device, and is computed for a whole cohort at once: every
(client, pass, sample) gets a counter-based pseudo-random key (SplitMix64), and sorting by key
within each (client, pass) gives independent uniform permutations. No generator object per
client.

SplitMix64 is uint64 arithmetic; torch has no uint64 add or multiply, so the keys are int64
tensors holding the same 64 bits: addition, multiplication and xor wrap identically in two's
complement, and a logical right shift is an arithmetic one with the sign bits masked off.
``tests/test_shuffle.py`` checks the result bit for bit against a numpy uint64 reference.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsub import device as device_lib

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """The int64 holding the bits of a uint64."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 bit patterns."""
    return (z >> bits).bitwise_and_(_LOW_BITS[bits])


# 0-d CPU constants broadcast to tensors on any device, without wrapping a Python int per op.
_LOW_BITS = {b: torch.tensor((1 << (64 - b)) - 1) for b in (27, 30, 31, 32)}
_GOLDEN_T, _MUL1_T, _MUL2_T = (torch.tensor(_signed(c)) for c in (_GOLDEN, _MUL1, _MUL2))


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The SplitMix64 finaliser, element-wise on int64 tensors read as uint64 (wrapping)."""
    z = x + _GOLDEN_T
    z.bitwise_xor_(_shift_right(z, 30)).mul_(_MUL1_T)
    z.bitwise_xor_(_shift_right(z, 27)).mul_(_MUL2_T)
    return z.bitwise_xor_(_shift_right(z, 31))


def splitmix64_int(x: int) -> int:
    """``splitmix64`` of one Python int (uint64 semantics), for scalar key prefixes."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def cohort_schedules(
    seed: int,
    round_index: int,
    clients: torch.Tensor,
    counts: torch.Tensor,
    steps: int,
    batch_size: int,
    host_counts: np.ndarray | None = None,
) -> torch.Tensor:
    """[K, steps, batch_size] local sample indices (int64) for each client of a cohort, on the
    device of ``clients`` (``counts``: each client's number of samples, same device); a view
    of step-major [steps, K, batch_size] storage, the layout the batched backend reads.
    ``host_counts``: the same counts as host numbers, when the caller has them: the torch
    kernel then sizes its tensors without reading the device.

    Two kernels give the same bits: torch ops on any device, and on the CPU numpy on
    zero-copy views, where a cohort's ~40 small ops cost about 1.6x less than torch's."""
    if device_lib.on_host(clients):
        return numpy_schedules(seed, round_index, clients, counts, steps, batch_size)
    return torch_schedules(seed, round_index, clients, counts, steps, batch_size, host_counts)


def schedule_sizes(counts: np.ndarray, steps: int, batch_size: int) -> tuple[int, int]:
    """(blocks, entries) of ``torch_schedules``' layout for members with ``counts`` samples:
    one block per (member, pass over its data), ``count`` entries per block."""
    counts = counts.astype(np.int64)
    passes = -(-(steps * batch_size) // counts)  # ceil
    return int(passes.sum()), int((passes * counts).sum())


def torch_schedules(
    seed: int,
    round_index: int,
    clients: torch.Tensor,
    counts: torch.Tensor,
    steps: int,
    batch_size: int,
    host_counts: np.ndarray | None = None,
) -> torch.Tensor:
    """``cohort_schedules`` in torch int64 ops, on the tensors' device. Its two sizes come
    from ``host_counts`` when given (no host sync), else from one read of ``counts``."""
    device = clients.device
    k, needed = len(clients), steps * batch_size
    if host_counts is None:
        host_counts = counts.cpu().numpy()  # a host read: callers on a GPU pass host_counts
    num_blocks, total = schedule_sizes(host_counts, steps, batch_size)
    passes = torch.div(needed + counts - 1, counts, rounding_mode="floor")  # ceil
    # Blocks: one per (client, pass) of the client's `count` samples, client after client.
    block_sizes = torch.repeat_interleave(counts, passes, output_size=num_blocks)
    block_ends = torch.cumsum(block_sizes, 0)
    block = torch.repeat_interleave(
        torch.arange(num_blocks, device=device), block_sizes, output_size=total
    )
    sample = torch.arange(total, device=device) - (block_ends - block_sizes).index_select(0, block)
    pass_ends = torch.cumsum(passes, 0)
    block_client = torch.repeat_interleave(
        torch.arange(k, device=device), passes, output_size=num_blocks
    )
    pass_starts = (pass_ends - passes).index_select(0, block_client)
    pass_index = torch.arange(num_blocks, device=device) - pass_starts
    # mix(seed, round, client, pass, sample): the (seed, round) prefix once, on the host; the
    # client part once per client and the pass part once per block.
    prefix = splitmix64_int(splitmix64_int(seed & _MASK64) ^ (round_index & _MASK64))
    client_keys = splitmix64(clients.to(torch.int64) ^ _signed(prefix))
    block_keys = splitmix64(client_keys.index_select(0, block_client) ^ pass_index)
    keys = splitmix64(block_keys.index_select(0, block) ^ sample)
    # One sort of (block, high 32 key bits): blocks stay in place, shuffled inside. Ties of
    # the 32-bit keys inside a block (probability ~ n^2 / 2^33) keep their sample order.
    order = torch.sort((block << 32) | _shift_right(keys, 32), stable=True).indices
    shuffled = sample.index_select(0, order)
    client_starts = (block_ends - block_sizes).index_select(0, pass_ends - passes)
    within = torch.arange(needed, device=device).reshape(steps, 1, batch_size)
    take = (client_starts[None, :, None] + within).reshape(-1)
    return shuffled.index_select(0, take).reshape(steps, k, batch_size).permute(1, 0, 2)


_GOLDEN_NP, _MUL1_NP, _MUL2_NP = (np.uint64(c) for c in (_GOLDEN, _MUL1, _MUL2))


def _numpy_splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN_NP
        z = (z ^ (z >> np.uint64(30))) * _MUL1_NP
        z = (z ^ (z >> np.uint64(27))) * _MUL2_NP
        return z ^ (z >> np.uint64(31))


def sorted_within_blocks(
    block: np.ndarray, high_keys: np.ndarray, sample: np.ndarray, largest: int
) -> np.ndarray:
    """The samples ordered by (block, 32-bit key), ties in sample order: what a stable argsort
    of ``block << 32 | key`` gives (``block``: nondecreasing block numbers; each block's
    samples in order, all below ``largest``). When block, key and sample fit in 64 bits
    together (the usual case), one sort of those values does it, ~4x faster than the stable
    argsort."""
    sample_bits = max(largest - 1, 1).bit_length()
    block_bits = max(int(block[-1]) if len(block) else 0, 1).bit_length()
    if block_bits + 32 + sample_bits > 64:
        order = np.argsort((block.astype(np.uint64) << np.uint64(32)) | high_keys, kind="stable")
        return sample[order]
    packed = (block.astype(np.uint64) << np.uint64(32 + sample_bits)) | (
        high_keys << np.uint64(sample_bits)
    )
    packed |= sample.astype(np.uint64)
    packed.sort()
    return (packed & np.uint64((1 << sample_bits) - 1)).astype(np.int64)


def numpy_schedules(
    seed: int,
    round_index: int,
    clients: torch.Tensor,
    counts: torch.Tensor,
    steps: int,
    batch_size: int,
) -> torch.Tensor:
    """``cohort_schedules`` for CPU tensors, in numpy uint64 arithmetic on their views."""
    client_ids, sizes = clients.numpy().astype(np.int64), counts.numpy().astype(np.int64)
    needed = steps * batch_size
    passes = -(-needed // sizes)  # ceil
    block = passes * sizes  # elements per client over all its passes
    member = np.repeat(np.arange(len(client_ids)), block)
    start = np.repeat(np.cumsum(block) - block, block)
    position = np.arange(block.sum()) - start  # index within the client's block
    if (passes == 1).all():  # one pass each (the usual case): no divisions needed
        sample, pass_index = position, np.zeros_like(position)
    else:
        sample, pass_index = position % sizes[member], position // sizes[member]
    prefix = np.uint64(splitmix64_int(splitmix64_int(seed & _MASK64) ^ (round_index & _MASK64)))
    client_keys = _numpy_splitmix64(prefix ^ client_ids.astype(np.uint64))
    keys = _numpy_splitmix64(
        _numpy_splitmix64(client_keys[member] ^ pass_index.astype(np.uint64))
        ^ sample.astype(np.uint64)
    )
    pass_block = np.cumsum(passes)[member] - passes[member] + pass_index
    shuffled = sorted_within_blocks(
        pass_block, keys >> np.uint64(32), sample, int(sizes.max(initial=1))
    )
    client_starts = np.cumsum(block) - block
    take = client_starts[None, :, None] + np.arange(needed).reshape(steps, 1, batch_size)
    return torch.from_numpy(shuffled[take]).permute(1, 0, 2)
