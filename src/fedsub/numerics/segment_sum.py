"""The round's scatter-adds, written once: ``out[index[i]] += source[i]``
(``execution.deterministic``).

On a GPU, ``index_add_`` / ``bincount`` add colliding entries with atomics, in whatever order
the threads arrive: float sums then differ in the last bits from run to run, and a run killed
and resumed drifts from an uninterrupted one. A deterministic run (``execution.deterministic =
true``, which turns on ``torch.use_deterministic_algorithms`` for the run: ``deterministic_run``)
sums each destination's entries in a fixed order instead: a stable sort of the destination
index, then a segment sum per distinct destination (``torch.segment_reduce``, one ordered
reduction per segment, no atomics), written with one copy per destination. Otherwise the fast
path (``index_add``) runs. Both give the same sum up to rounding; the deterministic one is
bit-identical from run to run on any device.

Every scatter-add of the round (aggregation, the server steps, SCAFFOLD's variates, per-member
norms, sum pooling, sparse LR's closed-form gradients) goes through ``index_add`` or
``segment_sum`` here. Sums over runs of consecutive entries (DIN's packed histories, whose
rows come sample after sample) are ``run_sums``: one ordered reduction per run
(``torch.segment_reduce``), deterministic on every device and path, with no sort and no host
read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def deterministic() -> bool:
    """Whether this run sums in a fixed order (``torch.use_deterministic_algorithms`` is on)."""
    return torch.are_deterministic_algorithms_enabled()


@contextmanager
def deterministic_run(enabled: bool) -> Iterator[None]:
    """Run a block with ``torch.use_deterministic_algorithms(True)`` when ``enabled``,
    restoring the previous setting afterwards (a run's setting never leaks into the next
    run); with ``enabled`` False the block runs under whatever the caller set."""
    if not enabled:
        yield
        return
    # cuBLAS's fixed-order workspace: torch refuses CUDA matmuls in deterministic mode without
    # it. cuBLAS reads it when torch creates its handle, so set it before a run's first matmul.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def sorted_segment_sums(
    index: torch.Tensor, source: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct destinations of ``index`` (sorted) and the sum of ``source``'s entries
    for each, every sum taken in the entries' original order (a stable sort): no atomics."""
    if len(index) == 0:
        return index.clone(), source.new_zeros((0, *source.shape[1:]))
    order = torch.argsort(index, stable=True)
    keys = index.index_select(0, order)
    destinations, lengths = torch.unique_consecutive(keys, return_counts=True)
    sums = torch.segment_reduce(source.index_select(0, order), "sum", lengths=lengths, axis=0)
    return destinations, sums


def index_add(target: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``target`` with ``source[i]`` added to row ``index[i]`` (a new tensor; differentiable).
    Sorted segment sums on a deterministic run, ``Tensor.index_add`` otherwise."""
    source = source.to(target.dtype)
    if not deterministic():
        return target.index_add(0, index, source)
    destinations, sums = sorted_segment_sums(index, source)
    return target.index_copy(0, destinations, target.index_select(0, destinations) + sums)


def index_add_(target: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """In place: ``target[index[i]] += source[i]``, rows of ``index`` may repeat."""
    source = source.to(target.dtype)
    if not deterministic():
        return target.index_add_(0, index, source)
    destinations, sums = sorted_segment_sums(index, source)
    return target.index_copy_(0, destinations, target.index_select(0, destinations) + sums)


def segment_sum(index: torch.Tensor, source: torch.Tensor, size: int) -> torch.Tensor:
    """[size, *source.shape[1:]]: row m the sum of ``source``'s entries with ``index == m``
    (``torch.bincount(index, weights, size)`` for 1-D ``source``)."""
    zeros = source.new_zeros((size, *source.shape[1:]))
    return index_add(zeros, index, source)


def run_sums(source: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[len(lengths), *source.shape[1:]]: row m the sum of the ``lengths[m]`` consecutive
    entries of ``source`` after those of the runs before it (zero for an empty run), summed in
    order (no atomics: the same numbers on every run and path). ``lengths`` must add up to
    ``len(source)``; that is not checked (the check would read the device)."""
    return torch.segment_reduce(source, "sum", lengths=lengths, axis=0, unsafe=True)
