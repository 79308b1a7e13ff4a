"""``execution.compile``: the batched backend's steady-state local step as one captured program.

A local step of the batched backend is many small kernels (embed -> head -> loss -> grads ->
client transform chain -> apply); for a small cohort their launches, not the arithmetic, set
the round's time. With ``execution.compile = "on"`` the step is one pure function,
``step(tables, dense, state, ids, dense_inputs, labels, members) -> (tables, dense, state)``
(gradients by ``torch.func.grad``, the same chain of transforms, ``x + u`` instead of the
in-place add), captured with ``torch.compile``: inductor's fused kernels on the CPU, and on a
GPU ``mode="reduce-overhead"``, which replays the step as a CUDA graph.

A captured program has fixed shapes, but a round's shapes change: the rows of the cohort's
S(k) (per table) every round, and the number of ids its samples hold (per field) every step.
So both are padded to size classes (``size_class``: four per doubling), and a run compiles at
most one program per class combination it meets (torch.compile's automatic dynamic shapes may fold
them into fewer). The padding changes no number:

- padding rows (at least one per table) are zeros owned by the last member; no real id
  points at them;
- padding ids point at the first padding row and belong to one extra "phantom" sample after
  the K * B real ones (its offsets end the ids); ``embed`` computes the phantom's features
  (every model's outputs have the samples on their leading axis), which are dropped before
  the head, so its rows get a zero gradient, every transform leaves a zero row at zero
  (prox, weight decay, momentum, Adam: 0 / (0 + eps)), and a member's gradient norm gains
  exact zeros;
- the rows are cut back to the real ones after the last step.

Not captured (run eagerly, with a warning): models whose shapes depend on the values
(``DeclaresCapturable.capturable = False``: LSTM pads to its longest sequence, read on the
host mid-step, which no CUDA graph can hold, and its ``range(longest)`` loop does not trace),
models with packed features (``PackedFeatures``, DIN: the phantom sample above would own
packed rows, which the head cannot drop by position) and closed-form gradients (sparse LR:
its CPU kernel works on numpy views).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from fedsub.client.layout import CohortLayout
from fedsub.client.transforms import Chain, Members
from fedsub.client.work import CohortWork
from fedsub.engine.cohort_batches import CohortBatches
from fedsub.engine.execution import Compile, CudaGraphs
from fedsub.models.base import DeclaresCapturable, Features, Ids, Model, PackedFeatures

LOG = logging.getLogger("fedsub")

SMALLEST_CLASS = 16  # the smallest size class: tiny tensors are not worth more programs
# Programs one run may compile for one step function (torch.compile's default is 8): one per
# size-class combination, times the algorithms of a comparison.
RECOMPILE_LIMIT = 64

Tensors = dict[str, torch.Tensor]
HeadFn = Callable[[Tensors, Features, torch.Tensor | None], torch.Tensor]


def size_class(n: int) -> int:
    """The padded size of ``n`` entries (at least ``SMALLEST_CLASS``): four classes per
    doubling (8, 10, 12, 14 times a power of two), so padding wastes under a quarter of a
    step's work and a size range [n, 2n] meets at most five classes."""
    n = max(n, SMALLEST_CLASS)
    step = 1 << max((n - 1).bit_length() - 3, 0)
    return -(-n // step) * step


def pad_rows(values: torch.Tensor, size: int, fill: float | int = 0) -> torch.Tensor:
    """``values`` with ``size - len(values)`` entries of ``fill`` appended on the first axis."""
    extra = values.new_full((size - len(values), *values.shape[1:]), fill)
    return torch.cat([values, extra])


@dataclass(frozen=True)
class PaddedCohort:
    """Where the padding goes: the real rows per table and the padded tables' sizes (a row
    class strictly above the real rows, so a padding row always exists)."""

    real_rows: dict[str, int]
    padded_rows: dict[str, int]
    field_tables: dict[str, str]

    @staticmethod
    def of(real_rows: dict[str, int], field_tables: dict[str, str]) -> PaddedCohort:
        return PaddedCohort(
            real_rows, {t: size_class(n + 1) for t, n in real_rows.items()}, field_tables
        )

    def tables(self, tables: Tensors) -> Tensors:
        return {t: pad_rows(v, self.padded_rows[t]) for t, v in tables.items()}

    def owners(self, owners: Tensors, members: int) -> Tensors:
        return {t: pad_rows(o, self.padded_rows[t], members - 1) for t, o in owners.items()}

    def ids(self, ids: Ids) -> Ids:
        """A step's ids padded to their class: padding ids point at the field's table's first
        padding row and form one phantom sample after the real ones."""
        padded = {}
        for field, (values, offsets) in ids.items():
            table = self.field_tables.get(field, field)
            size = size_class(len(values))
            padded[field] = (
                pad_rows(values, size, self.real_rows[table]),
                torch.cat([offsets, offsets.new_full((1,), size)]),
            )
        return padded

    def cut(self, tables: Tensors) -> Tensors:
        """The real rows of padded tables."""
        return {t: v[: self.real_rows[t]] for t, v in tables.items()}

    def key(self, ids: Ids) -> tuple[int, ...]:
        """The size classes a step runs at (rows per table, ids per field)."""
        return (*self.padded_rows.values(), *(len(v) for v, _ in ids.values()))


StepFn = Callable[..., tuple[Tensors, Tensors, Any]]

_TOLD: set[str] = set()  # models already told to run eagerly (one warning per process)


# The local step's capture (functorch's grad inside dynamo) fails on torch 2.11 with a PyTorch
# internal assert ("isIntList() INTERNAL ASSERT FAILED", seen on an H200 for every model and
# backend); 2.13 is the release fedsub's tests run on. 2.12 is untested, so it is refused too.
COMPILE_NEEDS_TORCH = (2, 13)


def compile_unavailable(version: str = torch.__version__) -> str | None:
    """Why this torch cannot capture the local step, or None when it can."""
    major_minor = re.match(r"(\d+)\.(\d+)", version)
    if major_minor and tuple(map(int, major_minor.groups())) >= COMPILE_NEEDS_TORCH:
        return None
    needed = ".".join(map(str, COMPILE_NEEDS_TORCH))
    return (
        f"it needs torch >= {needed} (this is torch {version}, whose compiler fails on the "
        "local step's gradients); upgrade torch or leave compile off"
    )


def _why_eager(model: Model, closed_form: bool, compiler: bool) -> str | None:
    if isinstance(model, DeclaresCapturable) and not model.capturable:
        return "its shapes depend on the values (it pads to the longest sequence)"
    if compiler and isinstance(model, PackedFeatures):  # cuda-graphs pads a phantom member
        return "it packs ragged lists (the padding's phantom sample would own packed rows)"
    if closed_form:
        return "it computes its gradients in closed form (kernels on host arrays)"
    return compile_unavailable() if compiler else None


def capture_for(
    model: Model, closed_form: bool, compile: Compile | CudaGraphs | None
) -> Compile | CudaGraphs | None:
    """How to capture ``model``'s local step, or None to run it eagerly: when
    ``execution.compile`` is off, or (with a warning) when the step cannot be captured."""
    if compile is None:
        return None
    reason = _why_eager(model, closed_form, isinstance(compile, Compile))
    if reason is None:
        return compile
    name = type(model).__name__
    if name not in _TOLD:
        _TOLD.add(name)
        LOG.warning("execution.compile: model %s runs its local steps eagerly: %s", name, reason)
    return None


def local_step(model: Model, head: HeadFn, chain: Chain, k: int, batch: int) -> StepFn:
    """The pure local step of a cohort of ``k`` members, ``batch`` samples each: the batched
    backend's loop body with the phantom sample's features dropped before the head."""
    samples = k * batch

    def loss(
        tables: Tensors,
        dense: Tensors,
        ids: Ids,
        dense_inputs: torch.Tensor | None,
        labels: torch.Tensor,
    ) -> torch.Tensor:
        features = {
            n: f[:samples].reshape(k, batch, *f.shape[1:])
            for n, f in model.embed(tables, ids).items()
        }
        outputs = head(dense, features, dense_inputs)
        flat = outputs.reshape(samples, *outputs.shape[2:])
        # the sum of the K client means (batched.py says why)
        return model.loss(flat, labels.reshape(-1)) * k

    gradients = torch.func.grad(loss, argnums=(0, 1))

    def step(
        tables: Tensors,
        dense: Tensors,
        state: Any,
        ids: Ids,
        dense_inputs: torch.Tensor | None,
        labels: torch.Tensor,
        members: Members,
    ) -> tuple[Tensors, Tensors, Any]:
        table_grads, dense_grads = gradients(tables, dense, ids, dense_inputs, labels)
        leaves = [*tables.values(), *dense.values()]
        grads = [*(table_grads[t] for t in tables), *(dense_grads[n] for n in dense)]
        updates, state = chain.update(grads, state, leaves, members)
        moved = [x + u for x, u in zip(leaves, updates, strict=True)]
        new_tables = dict(zip(tables, moved[: len(tables)], strict=True))
        new_dense = dict(zip(dense, moved[len(tables) :], strict=True))
        return new_tables, new_dense, state

    return step


@dataclass
class _Program:
    model: Model  # kept so that its id is not reused while cached
    compiled: StepFn


_PROGRAMS: dict[tuple[Any, ...], _Program] = {}
_KEEP = 8  # programs cached at once (a comparison's algorithms)


def captured_step(
    model: Model, head: HeadFn, chain: Chain, k: int, batch: int, compile: Compile
) -> StepFn:
    """``local_step`` compiled, built once per (model, chain, cohort shape, compile) and reused
    every round (torch.compile keeps a program per size-class combination it meets)."""
    key = (id(model), chain, k, batch, compile)
    program = _PROGRAMS.get(key)
    if program is None or program.model is not model:
        step = local_step(model, head, chain, k, batch)
        compiled = torch.compile(step, backend=compile.backend, mode=compile.mode, fullgraph=True)
        program = _Program(model, compiled)
        if len(_PROGRAMS) >= _KEEP:
            _PROGRAMS.pop(next(iter(_PROGRAMS)))
        _PROGRAMS[key] = program
    compiled = program.compiled

    # Imported here, not at the top: torch._dynamo costs 1.4 s to import, which every fedsub
    # process (a CLI call, a Flower ClientApp per message) would pay without compiling anything.
    from torch._dynamo import config as dynamo_config

    def call(*args: Any) -> tuple[Tensors, Tensors, Any]:
        with dynamo_config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(*args)

    return call


def run_steps(
    step: StepFn,
    padding: PaddedCohort,
    tables: Tensors,
    dense: Tensors,
    row_owner: Tensors,
    batches: CohortBatches,
    work: CohortWork,
    cuda_graphs: bool = False,
) -> tuple[Tensors, Tensors]:
    """The cohort's local steps with the captured ``step``, on tables padded by ``padding``:
    the members' tables (real rows) and dense parameters after the last step.
    ``cuda_graphs``: ``step`` replays CUDA graphs (``mode="reduce-overhead"``)."""
    k = len(batches.clients)
    tables = padding.tables(tables)
    owners = padding.owners(row_owner, k)
    layout = CohortLayout((*(owners[t] for t in tables), *(None for _ in dense)), k)
    corrections = None
    if work.corrections is not None:
        corrections = [
            *(pad_rows(c, len(owners[t])) for t, c in work.corrections.tables.items()),
            *work.corrections.dense.values(),
        ]
    members = Members(layout, work.lr, corrections)
    with torch.no_grad():
        state = work.chain.init([*tables.values(), *dense.values()], members)
    for i in range(len(batches.labels)):
        inputs = None if batches.dense is None else batches.dense[i]
        ids = padding.ids(batches.step_ids(i))
        if cuda_graphs:  # every step replays a graph of its size class from the tree's root
            torch.compiler.cudagraph_mark_step_begin()
        out = step(tables, dense, state, ids, inputs, batches.labels[i], members)
        if cuda_graphs:  # the next replay overwrites its outputs' memory: keep copies
            out = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out)
        tables, dense, state = out
    return padding.cut(tables), dense
