"""``execution.compile = "cuda-graphs"``: a round's local steps replayed as one CUDA graph,
without the compiler.

On a GPU a round of a sparse model is host-bound: each of the I local steps launches dozens
(embedding LR) to hundreds (DIN) of small kernels, and the launches, not the arithmetic, set
the round's time (benchmarks/README.md, ``gpu.py --profile``). Here the batched backend's eager
steps (``batched._eager_steps``: the same ops, autograd, ``Chain.step`` in place) are recorded
once with ``torch.cuda.graph`` on static buffers and replayed every round: one launch for the
I steps. No dynamo is involved, so it runs on the torch releases whose compiler cannot capture
the step (torch 2.11, ``captured_step.py``).

A graph has fixed shapes and addresses; a round's shapes change (the cohort's rows, the ids
of every step). So the pulled rows are padded to a size class per table (``PaddedCohort``) and
every step's ids to one size class per field (the round's largest step), and the padding
belongs to a **phantom member**: one more client after the K real ones, with B samples, its
own copy of the dense parameters, the tables' padding rows, a learning rate of 0 and no
correction. Its samples hold the padding ids (the last one all of them), its outputs are left
out of the loss, so every gradient it gets is zero and it changes no real member's number. A
whole member, not a phantom sample: a model that packs ragged lists per member (DIN's
histories, ``PackedFeatures``) lays the padding out as it lays out any member's rows.

One graph is recorded per combination of size classes (``RoundKey``), each with its own static
buffers; the graphs share one memory pool, which is safe because nothing a graph allocates is
read after its replay (its results live in the static buffers, allocated outside the pool).

The numbers: the same kernels as the eager steps on one more member, so the model agrees with
the eager backend up to the order of the GPU's atomic adds and the kernels a larger batch may
pick; on the CPU, where ``capture_eagerly`` stands in for the recording, it is bit for bit
(``tests/test_cuda_graphs.py``). Dense weights keep their dense form (the eager backend may
train a wide weight as low-rank changes, ``models/low_rank.py``: the same update up to
rounding).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import torch

from fedsub import device as device_lib
from fedsub.client.layout import CohortLayout, LearningRate
from fedsub.client.transforms import Chain, Members
from fedsub.client.work import CohortWork
from fedsub.engine.captured_step import PaddedCohort, size_class
from fedsub.engine.cohort_batches import CohortBatches
from fedsub.engine.execution import CudaGraphs
from fedsub.models.base import Model, cohort_features, packed_names

Tensors = dict[str, torch.Tensor]
HeadFn = Callable[[Tensors, dict[str, torch.Tensor], torch.Tensor | None], torch.Tensor]


class Replayable(Protocol):
    def replay(self) -> None: ...


Capture = Callable[[Callable[[], None]], Replayable]


def capture_cuda(fn: Callable[[], None]) -> Replayable:
    """``fn`` captured as a CUDA graph, after the warm-up runs on a side stream that
    ``torch.cuda.graph`` asks for (lazy initialisation of cuBLAS and friends must not happen
    inside a capture). The warm-up runs move ``fn``'s static buffers: the caller fills them
    again before the first replay (``graphed_steps``). The graph shares the memory pool of a
    graph still cached (a pool whose graphs are all freed is gone: torch asserts when it is
    named again)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    live = [r.graph for r in _ROUNDS.values() if isinstance(r.graph, torch.cuda.CUDAGraph)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=live[0].pool() if live else None):
        fn()
    return graph


@dataclass
class _Eager:
    fn: Callable[[], None]

    def replay(self) -> None:
        self.fn()


def capture_eagerly(fn: Callable[[], None]) -> Replayable:
    """The stand-in for a capture off the GPU: each replay calls ``fn`` (the same static buffers
    and ops as a graph, so the CPU tests check everything but the capture itself)."""
    return _Eager(fn)


@dataclass(frozen=True)
class StaticRates:
    """A cohort layout whose per-member learning rates come from a static device buffer: a graph
    cannot copy a host array to the device, so the round's rates are written into ``rates``
    before each replay. Only the learning rates pass through ``per_member`` (``Sgd``,
    ``Adam``), which the capture checks (``source``)."""

    layout: CohortLayout
    rates: torch.Tensor
    source: np.ndarray  # the rates' host array at capture time

    @property
    def members(self) -> int:
        return self.layout.members

    def squared_norms(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.layout.squared_norms(tensors)

    def spread(self, values: torch.Tensor, position: int, like: torch.Tensor) -> torch.Tensor:
        return self.layout.spread(values, position, like)

    def spread_all(
        self, values: LearningRate, tensors: Sequence[torch.Tensor]
    ) -> list[LearningRate]:
        return self.layout.spread_all(values, tensors)

    def per_member(self, values: np.ndarray, like: torch.Tensor) -> LearningRate:
        if values is not self.source:
            raise ValueError("a captured round's per-member values must be its learning rates")
        return self.rates.to(like.dtype)

    def per_tensor(self, values: np.ndarray, tensors: Sequence[torch.Tensor]) -> list[LearningRate]:
        return self.spread_all(self.per_member(values, tensors[0]), tensors)


@dataclass(frozen=True)
class SizeClasses:
    """The padded sizes a captured round's buffers take: rows per table, ids per field, the
    dense parameters' and inputs' shapes."""

    rows: tuple[tuple[str, int], ...]
    ids: tuple[tuple[str, int], ...]
    dense: tuple[tuple[str, tuple[int, ...]], ...]
    dense_inputs: tuple[int, ...] | None


@dataclass(frozen=True)
class RoundKey:
    """What fixes a captured round's shapes: the model and rule, the cohort's shape, its
    ``SizeClasses``, the dtype and device."""

    model: int  # id(model): the cache keeps the model alive (``_Round.model``)
    chain: Chain
    k: int
    batch: int
    steps: int
    sizes: SizeClasses
    corrections: bool
    dtype: torch.dtype
    device: torch.device


@dataclass
class _Round:
    """One captured round: its static buffers and its graph."""

    model: Model
    tables: Tensors  # padded rows, leaves that the steps move in place
    dense: Tensors  # [K, ...], leaves
    owners: Tensors
    rates: torch.Tensor
    corrections: list[torch.Tensor] | None
    ids: dict[str, tuple[torch.Tensor, torch.Tensor]]  # [I, S] values, [I, K*B + 2] offsets
    labels: torch.Tensor
    dense_inputs: torch.Tensor | None
    graph: Replayable | None = None


_ROUNDS: dict[RoundKey, _Round] = {}
_KEEP = 16  # rounds captured at once (size-class combinations times a comparison's algorithms)


def padded_ids(
    batches: CohortBatches, padding: PaddedCohort
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every step's ids, each field padded to one size class S (the round's largest step):
    values [I, S] (the padding ids point at the table's first padding row) and offsets
    [I, (K + 1) * B + 1] over the K members' samples and the phantom member's B, whose last
    sample holds the padding ids and the others none."""
    steps, k, batch = batches.labels.shape
    per_step = k * batch
    out = {}
    for name, ragged in batches.ids.items():
        bounds = np.asarray(batches.step_bounds[name], dtype=np.int64)
        counts = np.diff(bounds)
        size = size_class(int(counts.max()) if len(counts) else 0)
        device = ragged.values.device
        starts = device_lib.from_host(bounds[:-1], device)
        lengths = device_lib.from_host(counts, device)
        position = torch.arange(size, device=device)
        inside = position[None, :] < lengths[:, None]
        pad = padding.real_rows[padding.field_tables.get(name, name)]
        if len(ragged.values):
            where = (starts[:, None] + position[None, :]).clamp_(max=len(ragged.values) - 1)
            values = ragged.values.index_select(0, where.reshape(-1)).reshape(steps, size)
            values = torch.where(inside, values, pad)
        else:
            values = torch.full((steps, size), pad, dtype=torch.int64, device=device)
        real = ragged.offsets[: steps * per_step].reshape(steps, per_step) - starts[:, None]
        ends = lengths[:, None].expand(steps, batch)  # the phantom's samples but its last
        phantom_end = torch.full((steps, 1), size, dtype=real.dtype, device=device)
        out[name] = (values, torch.cat([real, ends, phantom_end], dim=1))
    return out


def _key(
    model: Model,
    work: CohortWork,
    pulled_tables: Tensors,
    padding: PaddedCohort,
    ids: dict[str, tuple[torch.Tensor, torch.Tensor]],
    pulled_dense: Tensors,
    batches: CohortBatches,
) -> RoundKey:
    steps, k, batch = batches.labels.shape
    return RoundKey(
        model=id(model),
        chain=work.chain,
        k=k,
        batch=batch,
        steps=steps,
        sizes=SizeClasses(
            rows=tuple(padding.padded_rows.items()),
            ids=tuple((n, v.shape[1]) for n, (v, _) in ids.items()),
            dense=tuple((n, tuple(v.shape)) for n, v in pulled_dense.items()),
            dense_inputs=None if batches.dense is None else tuple(batches.dense.shape),
        ),
        corrections=work.corrections is not None,
        dtype=[*pulled_tables.values(), *pulled_dense.values()][0].dtype,
        device=batches.labels.device,
    )


def _with_phantom(values: torch.Tensor, axis: int = 0) -> torch.Tensor:
    """Zeros shaped as ``values`` with one more member on ``axis``."""
    shape = list(values.shape)
    shape[axis] += 1
    return values.new_zeros(shape)


def _static_round(
    model: Model,
    key: RoundKey,
    pulled_tables: Tensors,
    pulled_dense: Tensors,
    ids: dict[str, tuple[torch.Tensor, torch.Tensor]],
    batches: CohortBatches,
    work: CohortWork,
) -> _Round:
    """Zeroed static buffers of ``key``'s shapes, with the phantom member's places."""
    rows = dict(key.sizes.rows)
    device = key.device
    corrections = None
    if work.corrections is not None:
        corrections = [
            *(
                torch.zeros(rows[t], *c.shape[1:], dtype=c.dtype, device=device)
                for t, c in work.corrections.tables.items()
            ),
            *(_with_phantom(c) for c in work.corrections.dense.values()),
        ]
    dense_inputs = None if batches.dense is None else _with_phantom(batches.dense, axis=1)
    return _Round(
        model=model,
        tables={
            t: torch.zeros(rows[t], *v.shape[1:], dtype=v.dtype, device=device).requires_grad_()
            for t, v in pulled_tables.items()
        },
        dense={n: _with_phantom(v).requires_grad_() for n, v in pulled_dense.items()},
        owners={t: torch.zeros(rows[t], dtype=torch.int64, device=device) for t in pulled_tables},
        rates=torch.zeros(key.k + 1, dtype=key.dtype, device=device),
        corrections=corrections,
        ids={n: (torch.zeros_like(v), torch.zeros_like(o)) for n, (v, o) in ids.items()},
        labels=torch.zeros_like(batches.labels),
        dense_inputs=dense_inputs,
    )


def _fill(
    static: _Round,
    pulled_tables: Tensors,
    pulled_dense: Tensors,
    ids: dict[str, tuple[torch.Tensor, torch.Tensor]],
    batches: CohortBatches,
    work: CohortWork,
) -> None:
    """This round's inputs into the static buffers: the padding rows zero and the phantom's,
    its dense parameters the global ones, its learning rate and corrections zero."""
    k = static.labels.shape[1]
    with torch.no_grad():
        for t, values in pulled_tables.items():
            real = len(values)
            static.tables[t][:real].copy_(values)
            static.tables[t][real:].zero_()
            static.owners[t][:real].copy_(batches.row_owner[t])
            static.owners[t][real:].fill_(k)
        for n, values in pulled_dense.items():
            static.dense[n][:k].copy_(values)
            static.dense[n][k:].copy_(values[:1])
        static.rates[:k].copy_(device_lib.from_host(work.lr, static.rates.device))
        if static.corrections is not None and work.corrections is not None:
            given = [*work.corrections.tables.values(), *work.corrections.dense.values()]
            for target, c in zip(static.corrections, given, strict=True):
                target[: len(c)].copy_(c)
        for n, (values, offsets) in ids.items():
            static.ids[n][0].copy_(values)
            static.ids[n][1].copy_(offsets)
        static.labels.copy_(batches.labels)
        if static.dense_inputs is not None and batches.dense is not None:
            static.dense_inputs[:, :k].copy_(batches.dense)


def _steps(static: _Round, head: HeadFn, chain: Chain, lr: np.ndarray) -> Callable[[], None]:
    """The round's I local steps on the static buffers, as ``batched._eager_steps`` takes
    them, for the K members and the phantom; the phantom's outputs are left out of the loss."""
    model, tables, dense = static.model, static.tables, static.dense
    steps, k, batch = static.labels.shape
    layout = CohortLayout((*(static.owners[t] for t in tables), *(None for _ in dense)), k + 1)
    members = Members(StaticRates(layout, static.rates, lr), lr, static.corrections)
    params = [*tables.values(), *dense.values()]
    packed = packed_names(model)

    def run() -> None:
        with torch.no_grad():
            state = chain.init(params, members)
        for step in range(steps):
            ids = {n: (v[step], o[step]) for n, (v, o) in static.ids.items()}
            inputs = None if static.dense_inputs is None else static.dense_inputs[step]
            features = cohort_features(model.embed(tables, ids), k + 1, packed)
            outputs = head(dense, features, inputs)[:k]
            flat = outputs.reshape(k * batch, *outputs.shape[2:])
            total = model.loss(flat, static.labels[step].reshape(-1)) * k
            grads = list(torch.autograd.grad(total, params))
            with torch.no_grad():
                state = chain.step(grads, state, params, members)

    return run


def graphed_steps(
    model: Model,
    head: HeadFn,
    pulled_tables: Tensors,
    pulled_dense: Tensors,
    batches: CohortBatches,
    work: CohortWork,
    padding: PaddedCohort,
    graphs: CudaGraphs,
) -> tuple[Tensors, Tensors]:
    """The cohort's local steps as one replay of the round recorded for its size classes
    (recorded at its first use): the members' tables (real rows) and dense parameters after
    the last step, views of the static buffers (read them before the next round)."""
    ids = padded_ids(batches, padding)
    key = _key(model, work, pulled_tables, padding, ids, pulled_dense, batches)
    static = _ROUNDS.get(key)
    if static is None or static.model is not model:
        static = _static_round(model, key, pulled_tables, pulled_dense, ids, batches, work)
        _fill(static, pulled_tables, pulled_dense, ids, batches, work)
        capture = cast(Capture, graphs.capture) if graphs.capture is not None else capture_cuda
        static.graph = capture(_steps(static, head, work.chain, work.lr))
        if len(_ROUNDS) >= _KEEP:
            _ROUNDS.pop(next(iter(_ROUNDS)))
        _ROUNDS[key] = static
    _fill(static, pulled_tables, pulled_dense, ids, batches, work)
    assert static.graph is not None
    static.graph.replay()
    k = batches.labels.shape[1]
    tables = {t: v.detach()[: padding.real_rows[t]] for t, v in static.tables.items()}
    return tables, {n: v.detach()[:k] for n, v in static.dense.items()}
