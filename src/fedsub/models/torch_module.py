"""A user's own ``torch.nn.Module`` as a fedsub model (``wrap``).

The module's ``forward(batch)`` reads ``batch.ids[field]`` as ``(values, offsets)`` (fedsub's
CSR layout: offsets of length n + 1; ``bag(values, offsets)`` works on an ``nn.EmbeddingBag``
of either convention, ``include_last_offset=True`` reading them whole and the default given
the bags' starts by a hook, bag_offsets.py; ``nn.Embedding(values)`` for a field with one id
per sample) and ``batch.dense`` ([n, d] or None), and returns per-sample outputs: logits [n]
for a binary task, [n, C] for C classes, anything with the samples first given a ``loss``.
It never sees the labels: fedsub computes the loss from the outputs.

Its embedding modules are the row tables (``module_tables.py``); every other trainable
parameter is dense. Buffers are constants: kept as the module has them, never trained or
averaged, so a forward that changes its module's state (a buffer it counts or keeps
statistics in, a parameter written through ``.data``) is refused, naming what changed; so is
BatchNorm, whose running statistics are such buffers (and whose batch statistics differ
between a client's batch and evaluation: use LayerNorm or GroupNorm). The module runs in eval
mode (dropout off: its random draws would not be keyed by seed, round and client, so runs
would neither repeat nor resume). ``wrap`` refuses, before anything trains, naming the
module and what to change: a module Python cannot deep-copy (a lock among its attributes),
one on the meta device, a complex parameter, and a forward through which no gradient flows
(``torch.no_grad``, detached outputs).

How it runs. ``forward`` is split at the tables: ``embed`` computes what each table module
returns for the ids it reads, recorded once by a dry run (``module_trace.py``), with its
``weight`` replaced by the rows given (the global table, a client's S(k) rows, or a whole
cohort's concatenated rows); ``head`` runs the user's ``forward`` with
``torch.func.functional_call`` on the dense parameters given, the table modules replaced by
stubs that return those lookups. Both backends run this one code path; the batched backend
vmaps ``head`` over its clients' dense parameters. ``wrap`` checks on a few real samples that
the split gives the module's own outputs and that ``vmap(head)`` gives the per-client heads; a
module that fails the first (it computes with the ids outside its tables) runs whole on the
sequential backend, one that fails the second (data-dependent control flow, ``.item()``,
in-place writes to its inputs, random ops ...) runs split on the sequential backend: either way
with a warning that says why (``batchable = False``). ``execution.compile`` captures the split step
like a built-in model's (the stubs are plain Python the tracer follows).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from fedsub.data.federated import FederatedDataset
from fedsub.errors import ArgumentError, ConfigError
from fedsub.models.bag_offsets import BatchOffsets, adapt_default_bags
from fedsub.models.base import Batch, Features, Ids, Task
from fedsub.models.module_tables import TableModule, TableSpec, table_module, table_paths
from fedsub.models.module_trace import Lookup, Trace, trace
from fedsub.models.pooling import sum_pool
from fedsub.submodel.params import Params

LOG = logging.getLogger("fedsub")

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PROBE_SAMPLES = 8  # the dry run's batch: real training samples, an even number (two clients)


@dataclass(frozen=True)
class Inputs:
    """What a module's ``forward`` gets: per field ``(values, offsets)`` and the dense
    features. No labels: the loss is computed from the outputs."""

    ids: Ids
    dense: torch.Tensor | None


class TorchModuleModel:
    """A wrapped ``nn.Module`` (build it with ``wrap``): a fedsub ``Model`` whose tables are
    the module's embedding modules and whose dense parameters are all its other parameters,
    starting from the module's own weights."""

    batchable: bool = True  # a class-level default (``DeclaresBatchable``); wrap may clear it

    def __init__(
        self,
        module: nn.Module,
        paths: dict[str, str],
        fields: tuple[str, ...],
        lookups: tuple[Lookup, ...] | None,
        task: Task,
        loss: Loss,
    ) -> None:
        self.template = module  # the user's module as wrapped (a copy, in eval mode)
        self.paths = paths  # table -> attribute path of its module
        self.fields = fields
        self.lookups = lookups  # None: the forward runs whole (it cannot be split)
        self.task: Task = task
        self._loss = loss
        self.batchable = lookups is not None
        self._feed = _Feed()
        self._offsets = BatchOffsets()
        self._tables = {t: copy.deepcopy(table_module(module, p)) for t, p in paths.items()}
        # what ``head`` runs: the module with stubs for its tables, or the whole module
        self._forward = (
            _with_bag_hooks(module, paths, self._offsets)
            if lookups is None
            else _with_stubs(module, paths, self._feed)
        )
        self._copies: dict[tuple[str, torch.dtype], nn.Module] = {}
        tables = {f"{p}.weight" for p in paths.values()}
        self.dense_names = tuple(
            n for n, p in module.named_parameters() if p.requires_grad and n not in tables
        )

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        """The module's own weights (``generator`` is not used: the module drew them)."""
        named = dict(self.template.named_parameters())

        def value(p: torch.Tensor) -> torch.Tensor:
            return p.detach().to("cpu", dtype).clone()

        tables = {t: value(m.weight) for t, m in self._tables.items()}
        return Params(tables, {n: value(named[n]) for n in self.dense_names})

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features:
        if self.lookups is None:  # the whole forward runs in head
            features = {f"table.{t}": rows for t, rows in tables.items()}
            for field, (values, offsets) in ids.items():
                features[f"values.{field}"], features[f"offsets.{field}"] = values, offsets
            return features
        return {
            f"lookup{i}": _look_up(self._tables[lookup.table], tables[lookup.table], lookup, ids)
            for i, lookup in enumerate(self.lookups)
        }

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        # a copy: an in-place op of the forward must not write into the dataset's memory
        inputs = None if dense_inputs is None else dense_inputs.clone()
        candidates = [*dense.values(), *features.values(), *([] if inputs is None else [inputs])]
        floating = [t for t in candidates if t.is_floating_point()]
        if not floating:
            raise ValueError("the module has no dense parameters and reads no rows or features")
        module = self._forward_module(floating[0])
        if self.lookups is None:
            weights = {f"{p}.weight": features[f"table.{t}"] for t, p in self.paths.items()}
            ids = {f: (features[f"values.{f}"], features[f"offsets.{f}"]) for f in self.fields}
            self._offsets.hold(offsets for _, offsets in ids.values())
            return functional_call(module, {**dense, **weights}, (Inputs(ids, inputs),))
        samples = next(iter(features.values()), inputs)
        if samples is None:
            raise ValueError("the module reads neither ids nor dense features")
        with self._feed.serving(features, self.lookups):
            placeholders = _placeholder_ids(self.fields, samples.shape[0], samples.device)
            return functional_call(module, dense, (Inputs(placeholders, inputs),))

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._loss(outputs, labels)

    def to_module(self, params: Params) -> nn.Module:
        """A copy of the wrapped module holding ``params`` (e.g. a run's trained model): the
        same class, in the module's own dtypes, on the CPU, in train mode."""
        module = copy.deepcopy(self.template)
        own = dict(module.named_parameters())
        values = {f"{p}.weight": params.tables[t] for t, p in self.paths.items()}
        values.update(params.dense)
        with torch.no_grad():
            for name, value in values.items():
                own[name].copy_(value.to(own[name].device, own[name].dtype))
        return module.train()

    def _forward_module(self, reference: torch.Tensor) -> nn.Module:
        """What ``head`` runs, with its constants (frozen parameters, buffers) in the dtype
        and on the device of ``reference``: one copy per (device, dtype), made on first use."""
        key = (str(reference.device), reference.dtype)
        module = self._copies.get(key)
        if module is None:
            module = copy.deepcopy(self._forward).to(reference.device, reference.dtype)
            self._copies[key] = module
        return module


class _Feed:
    """What the stubs of the table modules return during one ``head`` call: the j-th call
    of a table module gets the features of its j-th recorded lookup."""

    def __init__(self) -> None:
        self.queues: dict[str, list[torch.Tensor]] = {}

    def __deepcopy__(self, memo: dict) -> _Feed:
        """Copies of the stubbed module (one per device and dtype) share the model's feed."""
        return self

    @contextmanager
    def serving(self, features: Features, lookups: tuple[Lookup, ...]) -> Iterator[None]:
        self.queues = {}
        for i, lookup in enumerate(lookups):
            self.queues.setdefault(lookup.path, []).append(features[f"lookup{i}"])
        try:
            yield
        finally:
            self.queues = {}

    def next(self, path: str) -> torch.Tensor:
        queue = self.queues.get(path)
        if not queue:
            raise RuntimeError(
                f"table module {path!r} was called more often than in the dry run at wrap "
                "time; fedsub needs the same table calls for every batch"
            )
        return queue.pop(0)


class _Stub(nn.Module):
    """Stands in for a table module inside ``head``: returns the precomputed lookup."""

    def __init__(self, feed: _Feed, path: str) -> None:
        super().__init__()
        self.feed, self.path = feed, path

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.feed.next(self.path)


def _with_stubs(module: nn.Module, paths: dict[str, str], feed: _Feed) -> nn.Module:
    """A copy of ``module`` whose table modules are stubs: its parameters are the dense ones."""
    head = copy.deepcopy(module)
    for path in paths.values():
        parent_path, _, name = path.rpartition(".")
        if not name:
            raise ConfigError("the module itself is an embedding: it has nothing but a table")
        setattr(head.get_submodule(parent_path), name, _Stub(feed, path))
    return head


def _with_bag_hooks(module: nn.Module, paths: dict[str, str], offsets: BatchOffsets) -> nn.Module:
    """A copy of ``module`` whose default ``nn.EmbeddingBag`` tables take fedsub's offsets
    (bag_offsets.py); the user's module keeps no hook."""
    whole = copy.deepcopy(module)
    adapt_default_bags(whole, paths.values(), offsets)
    return whole


def _look_up(module: TableModule, rows: torch.Tensor, lookup: Lookup, ids: Ids) -> torch.Tensor:
    """What table ``module`` returns for ``lookup`` with its weight replaced by ``rows``.
    A plain ``nn.EmbeddingBag`` summing or averaging, or ``nn.Embedding``, is computed by
    fedsub's gather and segment sum (models/pooling.py: the same numbers up to rounding, a
    faster backward on the CPU); any other table module is called as it is."""
    values, offsets = ids[lookup.field]
    plain = not module.scale_grad_by_freq
    if type(module) is nn.EmbeddingBag and plain and module.mode in ("sum", "mean"):
        # the trace admits only calls giving one bag per sample: the samples' own bags
        pooled = sum_pool(rows, values, offsets)
        if module.mode == "sum":
            return pooled
        counts = (offsets[1:] - offsets[:-1]).clamp(min=1).unsqueeze(-1)
        return pooled / counts.to(pooled.dtype)
    if type(module) is nn.Embedding and plain:
        return rows.index_select(0, values)
    if lookup.offsets == "none":
        arguments: tuple = (values,)
    else:
        arguments = (values, offsets if lookup.offsets == "whole" else offsets[:-1])
    return functional_call(module, {"weight": rows}, arguments)


def _placeholder_ids(fields: tuple[str, ...], samples: int, device: torch.device) -> Ids:
    """Ids the split forward passes to the stubs (which ignore them): one id per sample."""
    values = torch.zeros(samples, dtype=torch.int64, device=device)
    offsets = torch.arange(samples + 1, dtype=torch.int64, device=device)
    return {f: (values, offsets) for f in fields}


# -- wrapping ---------------------------------------------------------------------------------


def wrap(
    module: nn.Module,
    dataset: FederatedDataset,
    *,
    tables: TableSpec | None = None,
    loss: Loss | None = None,
    task: Task | None = None,
    dtype: str | None = None,
) -> TorchModuleModel:
    """``module`` as a fedsub model for ``dataset``: its tables found and checked, its
    forward traced on a few training samples, split and checked (see the module docstring).
    ``loss(outputs, labels)``: the batch mean of a per-sample loss; by default the module's
    ``loss`` method if it has one, else binary cross-entropy on logits [n] or cross-entropy
    on [n, C] class logits. ``task``: inferred from the outputs' shape when not given.
    ``dtype`` (``execution.dtype``, when known): the forward is checked to run in it.

    The contract is checked here, once, before anything trains: outputs finite, one row per
    sample, matching the labels and the task (C columns need class labels 0..C-1; 0/1 labels
    under more than two columns are refused unless ``task="multiclass"`` says so), every
    table and the dense features read (unread dense features are warned about)."""
    if not isinstance(module, nn.Module):
        raise ArgumentError(f"expected a torch.nn.Module, got a {type(module).__name__}")
    _check_contract_arguments(loss, task, dtype)
    _check_layers(module)
    _check_tensors(module)
    paths = table_paths(module, dataset, tables)
    template = _copied(module).cpu().eval()
    batch, traced = _traced(template, paths, dataset)
    outputs = traced.outputs
    _check_outputs(outputs, len(batch.labels), traced.unsplittable)
    _check_fields(traced, dataset)
    labels = torch.from_numpy(np.asarray(dataset.train.labels, dtype=np.float64))
    task = task or _task_of(outputs, labels)
    _check_labels(task, outputs, labels)
    loss = _loss_for(template, task, loss, outputs)
    _check_mean_loss(loss, outputs, batch.labels)
    model, reason = _split(template, paths, dataset, traced, task, loss, batch)
    _leave_out_unused(model, batch)
    if dtype is not None:
        check_runs_in(model, dataset, dtype)
    _say_how_it_runs(model, type(module).__name__, reason, batch)
    return model


def _traced(
    template: nn.Module, paths: dict[str, str], dataset: FederatedDataset
) -> tuple[Batch, Trace]:
    """The probe (the first few training samples, an even number of them, in float64) and
    the module's forward traced on it, its bags' offsets held for the embedding hooks."""
    probe = dataset.train.slice(0, min(PROBE_SAMPLES, len(dataset.train) // 2 * 2))
    batch = Batch.from_samples(probe, torch.float64)
    ids = {f: (v.clone(), o.clone()) for f, (v, o) in batch.ids.items()}
    probe_offsets = BatchOffsets()
    probe_offsets.hold(offsets for _, offsets in ids.values())
    probe_module = _with_bag_hooks(template, paths, probe_offsets).double()
    traced = _dry_run(
        probe_module, paths, ids, batch.dense, f"{len(probe)} samples of {dataset.name}"
    )
    return batch, traced


def _split(
    template: nn.Module,
    paths: dict[str, str],
    dataset: FederatedDataset,
    traced: Trace,
    task: Task,
    loss: Loss,
    batch: Batch,
) -> tuple[TorchModuleModel, str | None]:
    """The model split at its tables' lookups when the trace allows it and the split forward
    gives the whole one's outputs; else the model that runs whole, with the reason."""
    reason = traced.unsplittable or _single_id_fields(traced, dataset)
    fields = tuple(dataset.train.ids)
    model = TorchModuleModel(
        template, paths, fields, None if reason else traced.lookups, task, loss
    )
    params = model.init(torch.Generator(), torch.float64)
    if reason is None:
        reason = _split_differs(model, params, batch, traced.outputs)
        if reason is not None:
            model = TorchModuleModel(template, paths, fields, None, task, loss)
    return model, reason


def _say_how_it_runs(model: TorchModuleModel, name: str, reason: str | None, batch: Batch) -> None:
    """Warn when the module runs one client at a time: its forward does not split at the
    tables (``reason``), or does but cannot run for a whole cohort under vmap (then it is
    marked not ``batchable``)."""
    if reason is not None:
        LOG.warning(
            "module %s: fedsub cannot split its forward at the tables (%s); it runs whole, "
            "one client at a time (the sequential backend)",
            name,
            reason,
        )
        return
    why = _not_vmappable(model, model.init(torch.Generator(), torch.float64), batch)
    if why is not None:
        model.batchable = False
        LOG.warning(
            "module %s: its forward cannot run for a whole cohort under torch.func.vmap (%s); "
            "the batched backend runs it one client at a time (the sequential backend)",
            name,
            why,
        )


TASKS = ("binary", "multiclass", "regression")


def _check_contract_arguments(loss: object, task: object, dtype: object) -> None:
    if loss is not None and not callable(loss):
        raise ArgumentError(
            f"loss must be a function (outputs, labels) -> the batch mean, got {loss!r}"
        )
    if task is not None and task not in TASKS:
        raise ArgumentError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if dtype is not None and dtype not in ("float32", "float64"):
        raise ArgumentError(f"dtype must be 'float32' or 'float64', got {dtype!r}")


def _check_labels(task: Task, outputs: torch.Tensor, labels: torch.Tensor) -> None:
    """The labels fit the task the outputs (or ``task=``) say: class indices 0..C-1 for C
    columns, 0/1 for one logit; 0/1 labels under more than two columns are refused unless
    ``task="multiclass"`` was given (a 3-column forward on 0/1 labels is a mistake far more
    often than a 3-class model that has seen two classes)."""
    if task == "multiclass" and outputs.dim() == 2:
        classes = outputs.shape[1]
        whole = bool((labels == labels.round()).all())
        if not whole or bool((labels < 0).any()) or bool((labels >= classes).any()):
            raise ConfigError(
                f"the module's forward returns {classes} class columns per sample, so the "
                f"labels must be class indices 0..{classes - 1}; the training labels range over "
                f"{float(labels.min()):g}..{float(labels.max()):g}"
            )
    if task == "binary" and not bool(((labels == 0) | (labels == 1)).all()):
        raise ConfigError(
            "task 'binary' needs 0/1 labels; the training labels range over "
            f"{float(labels.min()):g}..{float(labels.max()):g}"
        )


def check_runs_in(model: TorchModuleModel, dataset: FederatedDataset, dtype: str) -> None:
    """The split (or whole) forward runs with fedsub's parameters in ``dtype`` (``execution.dtype``)
    on a few training samples: a module whose forward mixes in another dtype (a float64
    submodule fed float64 inputs) is refused before any round, naming what to change."""
    torch_dtype = torch.float64 if dtype == "float64" else torch.float32
    probe = dataset.train.slice(0, min(PROBE_SAMPLES, len(dataset.train) // 2 * 2))
    batch = Batch.from_samples(probe, torch_dtype)
    params = model.init(torch.Generator(), torch_dtype)
    try:
        with torch.no_grad():
            model.head(params.dense, model.embed(params.tables, batch.ids), batch.dense)
    except Exception as error:
        others = sorted(
            {
                str(p.dtype).removeprefix("torch.")
                for p in model.template.parameters()
                if p.is_floating_point() and p.dtype != torch_dtype
            }
        )
        hint = (
            f"its own parameters are {', '.join(others)}: build the module in {dtype}, or "
            f"train in {others[0]} (execution.dtype = {others[0]!r})"
            if others
            else "make the forward compute in the parameters' dtype"
        )
        raise ConfigError(
            f"the module's forward fails when fedsub trains it in {dtype} (execution.dtype = "
            f"{dtype!r}): {type(error).__name__}: {str(error).splitlines()[0]}; {hint}"
        ) from error


def _leave_out_unused(model: TorchModuleModel, batch: Batch) -> None:
    """Dense parameters the forward does not use on the probe batch are left out of training
    (kept as the module has them, with a warning: autograd gives them no gradient); a table
    it does not read is refused (every table of the dataset is pulled and trained)."""
    params = model.init(torch.Generator(), torch.float64)
    tensors = [t.requires_grad_(True) for t in params.tensors()]
    dense = None if batch.dense is None else batch.dense.clone().requires_grad_(True)
    outputs = model.head(params.dense, model.embed(params.tables, batch.ids), dense)
    inputs = [*tensors, *([] if dense is None else [dense])]
    loss = model.loss(outputs, batch.labels)
    if not loss.requires_grad:
        raise ConfigError(
            f"module {type(model.template).__name__}: no gradient flows from the loss back "
            "to its parameters (the forward ran under torch.no_grad(), or detached its "
            "outputs: .detach(), .item(), numpy); fedsub trains by backpropagating the loss "
            "through the outputs, so compute them with autograd on"
        )
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    used = [g is not None for g in grads[: len(tensors)]]
    if dense is not None and grads[-1] is None:
        LOG.warning(
            "the module's forward reads no dense features: the dataset's %d per sample "
            "(batch.dense) are not used",
            dense.shape[1],
        )
    for table, reads in zip(params.tables, used[: len(params.tables)], strict=True):
        if not reads:
            path = model.paths[table]
            raise ConfigError(
                f"module {path!r} (table {table!r}) is not used by the forward pass (or "
                "what it returns is detached: no gradient reaches it); every table of the "
                "dataset must be read (leave the fields you do not need out of the dataset)"
            )
    names = list(params.dense)
    unused = [n for n, reads in zip(names, used[len(params.tables) :], strict=True) if not reads]
    if unused:
        LOG.warning(
            "the forward pass does not use parameter(s) %s; fedsub leaves them as they are "
            "(not trained)",
            ", ".join(unused),
        )
        model.dense_names = tuple(n for n in model.dense_names if n not in unused)


def _check_layers(module: nn.Module) -> None:
    for path, layer in module.named_modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            raise ConfigError(
                f"module {path or type(module).__name__!r} is a {type(layer).__name__}: its "
                "running statistics are buffers its forward writes, and fedsub's buffers are "
                "constants (what one client writes there is never averaged), while batch "
                "statistics differ between a client's batch and evaluation; use nn.LayerNorm "
                "or nn.GroupNorm"
            )
        if isinstance(layer, nn.modules.dropout._DropoutNd) and layer.p > 0:
            LOG.warning(
                "module %r is a %s: fedsub runs the module in eval mode, so it is inactive "
                "(its random draws would not be keyed by seed, round and client)",
                path,
                type(layer).__name__,
            )


def _dry_run(
    module: nn.Module, paths: dict[str, str], ids: Ids, dense: torch.Tensor | None, what: str
) -> Trace:
    """The forward traced once on ``what`` (a few training samples), refused when it fails
    or changes the module's own state."""
    state = _state_of(module)
    try:
        traced = trace(module, paths, ids, lambda m: m(Inputs(ids, dense)))
    except Exception as error:
        raise ConfigError(
            f"the module's forward failed on {what} ({type(error).__name__}: {error})"
        ) from error
    _check_state_kept(type(module).__name__, state, _state_of(module))
    return traced


def _check_tensors(module: nn.Module) -> None:
    """Every parameter and buffer holds data (not on the meta device) and every parameter is
    real floating point (fedsub trains in float32 or float64: a complex parameter would lose
    its imaginary part)."""
    for kind, named in (
        ("parameter", module.named_parameters()),
        ("buffer", module.named_buffers()),
    ):
        for name, tensor in named:
            if tensor.is_meta:
                raise ConfigError(
                    f"{kind} {name!r} of module {type(module).__name__} is on the meta device "
                    "(a shape without data): fedsub trains from the module's own weights; "
                    "materialize it first (module.to_empty(device='cpu') and initialise its "
                    "weights, or build it outside torch.device('meta'))"
                )
            if kind == "parameter" and tensor.requires_grad and not tensor.is_floating_point():
                raise ConfigError(
                    f"parameter {name!r} of module {type(module).__name__} is {tensor.dtype}: "
                    "fedsub trains real floating-point parameters (execution.dtype float32 or "
                    "float64), so a complex one would lose its imaginary part; hold its real "
                    "and imaginary parts as two real parameters (torch.complex(re, im) in the "
                    "forward)"
                )


def _copied(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` (fedsub trains copies: one per algorithm and client);
    refused, naming the attribute that cannot be copied, when Python cannot copy it."""
    try:
        return copy.deepcopy(module)
    except Exception as error:
        culprit = _uncopyable_attribute(module)
        raise ConfigError(
            f"module {type(module).__name__} cannot be copied (copy.deepcopy: "
            f"{type(error).__name__}: {error}){culprit}; fedsub trains copies of the module, "
            "so keep locks, open files, threads and other handles outside it (or give its "
            "class a __deepcopy__)"
        ) from None


def _uncopyable_attribute(module: nn.Module) -> str:
    """``: attribute 'path.name' (a type)`` for the first plain attribute of ``module`` or its
    submodules that deepcopy refuses, or ""."""
    torch_own = set(vars(nn.Module()))  # its parameters, buffers, submodules and hooks
    for path, layer in module.named_modules():
        for name, value in vars(layer).items():
            if name in torch_own:
                continue
            try:
                copy.deepcopy(value)
            except Exception:
                where = f"{path}.{name}" if path else name
                return f": attribute {where!r} (a {type(value).__name__})"
    return ""


def _state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's and buffer's values, by name."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return {name: tensor.detach().clone() for name, tensor in named}


def _check_state_kept(
    name: str, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]
) -> None:
    """The forward changed no parameter or buffer of the module (the buffers' policy: they
    are constants, see the module docstring): a forward that counts, keeps running statistics
    or writes rows through ``.data`` is refused, naming what it changed."""
    changed = sorted(set(before) ^ set(after))
    changed += [
        n
        for n in sorted(set(before) & set(after))
        if before[n].shape != after[n].shape
        or not torch.equal(before[n].isnan(), after[n].isnan())
        or not torch.equal(before[n].nan_to_num(), after[n].nan_to_num())
    ]
    if changed:
        raise ConfigError(
            f"module {name}'s forward changed its own state ({', '.join(map(repr, changed))}): "
            "fedsub trains parameters only through their gradients, and buffers are constants "
            "(what a forward writes there would be one client's, never averaged); compute "
            "without writing to parameters, .data or buffers (keep counters and statistics "
            "outside the module)"
        )


def _check_outputs(outputs: object, samples: int, why: str | None = None) -> None:
    """One finite output row per sample (``why``: the trace's remark, which may say what
    returned a wrong number of rows)."""
    if not isinstance(outputs, torch.Tensor) or outputs.dim() == 0:
        raise ConfigError(
            f"the module's forward must return a tensor with the samples first; got "
            f"{type(outputs).__name__}"
            + (f" of shape {tuple(outputs.shape)}" if isinstance(outputs, torch.Tensor) else "")
        )
    if outputs.shape[0] != samples:
        raise ConfigError(
            f"the module's forward returned shape {tuple(outputs.shape)} for {samples} samples; "
            "the outputs must have one row per sample" + (f" ({why})" if why else "")
        )
    if not outputs.is_floating_point():
        raise ConfigError(
            f"the module's forward returned {outputs.dtype} outputs; it must return "
            "floating-point logits or predictions"
        )
    if not bool(torch.isfinite(outputs).all()):
        bad = "NaN" if bool(torch.isnan(outputs).any()) else "Inf"
        raise ConfigError(
            f"the module's forward returned {bad} outputs on {samples} training samples with "
            "its initial weights; fedsub can train only finite outputs (check the weights' "
            "initialisation and the forward's divisions, logs and square roots)"
        )


def _check_fields(traced: Trace, dataset: FederatedDataset) -> None:
    """Each table module reads only fields of its table (the dataset's field_tables)."""
    for lookup in traced.lookups:
        table = dataset.table_of(lookup.field)
        if table != lookup.table:
            raise ConfigError(
                f"module {lookup.path!r} holds table {lookup.table!r} but reads field "
                f"{lookup.field!r}, whose ids index table {table!r} (the dataset's field_tables)"
            )
    unread = [f for f in dataset.train.ids if f not in {x.field for x in traced.lookups}]
    if unread and traced.unsplittable is None:
        LOG.warning("the module's forward reads no ids of field(s) %s", ", ".join(unread))


def _single_id_fields(traced: Trace, dataset: FederatedDataset) -> str | None:
    """Why the split fails when an nn.Embedding reads a field with other than one id per
    sample (its rows would not be one per sample), or None."""
    for lookup in traced.lookups:
        if lookup.offsets != "none":
            continue
        for split, samples in (("train", dataset.train), ("test", dataset.test)):
            if np.any(np.diff(samples.ids[lookup.field].offsets) != 1):
                return (
                    f"nn.Embedding {lookup.path!r} reads field {lookup.field!r}, whose {split} "
                    "samples do not all hold exactly one id (use an nn.EmbeddingBag)"
                )
    return None


def _task_of(outputs: torch.Tensor, labels: torch.Tensor) -> Task:
    """The task the outputs' shape says, checked against the training labels."""
    binary = bool(((labels == 0) | (labels == 1)).all())
    if outputs.dim() == 2 and outputs.shape[1] > 2 and binary:
        raise ConfigError(
            f"the module's forward returns {outputs.shape[1]} columns per sample, but every "
            "training label is 0 or 1: return one logit per sample (shape [n]) for a binary "
            f"task, or give fedsub.train / fedsub.compare task='multiclass' to train "
            f"{outputs.shape[1]} classes"
        )
    if outputs.dim() == 2 and outputs.shape[1] > 1:
        return "multiclass"
    if outputs.dim() == 1:
        return "binary" if binary else "regression"
    raise ConfigError(
        f"cannot tell the task from outputs of shape {tuple(outputs.shape)}: return logits "
        "[n] (binary) or [n, C] (C classes), or give fedsub.train / fedsub.compare task= and "
        "loss="
    )


def _loss_for(template: nn.Module, task: Task, given: Loss | None, outputs: torch.Tensor) -> Loss:
    if given is not None:
        return given
    own = getattr(template, "loss", None)  # the user's module, not a fedsub capability
    if callable(own):
        return own
    if task == "binary" and outputs.dim() == 1:
        return F.binary_cross_entropy_with_logits
    if task == "multiclass" and outputs.dim() == 2:
        return _cross_entropy
    raise ConfigError(
        f"task {task!r} with outputs of shape {tuple(outputs.shape)} has no default loss: "
        "give fedsub.train / fedsub.compare loss=(outputs, labels) -> batch mean, or give "
        "the module a loss method"
    )


def _cross_entropy(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, labels.long())


def _check_mean_loss(loss: Loss, outputs: torch.Tensor, labels: torch.Tensor) -> None:
    """The loss must be a batch mean (the batched backend adds K client means as one)."""
    try:
        whole = loss(outputs, labels)
    except Exception as error:
        raise ConfigError(
            f"the loss failed on the module's outputs ({type(error).__name__}: {error})"
        ) from error
    if not isinstance(whole, torch.Tensor) or whole.dim() != 0:
        raise ConfigError("the loss must return a scalar tensor: the batch mean")
    if not bool(torch.isfinite(whole)):
        raise ConfigError(
            f"the loss is {float(whole)} on the module's (finite) outputs of "
            f"{len(outputs)} training samples; it must be a finite batch mean"
        )
    half = len(outputs) // 2
    if half == 0:
        return
    first = loss(outputs[:half], labels[:half])
    second = loss(outputs[half : 2 * half], labels[half : 2 * half])
    if len(outputs) % 2 == 0 and not torch.allclose(whole, (first + second) / 2, rtol=1e-6):
        raise ConfigError(
            "the loss must be the batch mean of a per-sample loss (reduction='mean'); on "
            f"{len(outputs)} samples it is {float(whole):.6g}, the mean of its halves' "
            f"{float((first + second) / 2):.6g}"
        )


def _split_differs(
    model: TorchModuleModel, params: Params, batch: Batch, expected: torch.Tensor
) -> str | None:
    """Why the split forward does not give the module's own outputs, or None."""
    try:
        with torch.no_grad():
            got = model.head(params.dense, model.embed(params.tables, batch.ids), batch.dense)
    except Exception as error:
        return f"split at its tables, it fails: {type(error).__name__}: {error}"
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-9, atol=1e-12):
        return "split at its tables, it gives other outputs: it uses the ids outside its tables"
    return None


def _not_vmappable(model: TorchModuleModel, params: Params, batch: Batch) -> str | None:
    """Why ``vmap(head)`` over two clients (different dense parameters) does not give their
    heads one by one, or None."""
    k, samples = 2, len(batch.labels)  # an even number (wrap's probe)
    generator = torch.Generator().manual_seed(0)
    dense = {
        n: torch.stack([p, p + 0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype)])
        for n, p in params.dense.items()
    }
    with torch.no_grad():
        flat = model.embed(params.tables, batch.ids)
    features = {n: f[:samples].reshape(k, samples // k, *f.shape[1:]) for n, f in flat.items()}
    inputs = None if batch.dense is None else batch.dense[:samples].reshape(k, samples // k, -1)
    try:
        with torch.no_grad():
            together = vmap(model.head, in_dims=(0, 0, None if inputs is None else 0))(
                dense, features, inputs
            )
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    with torch.no_grad():
        alone = torch.stack(
            [
                model.head(
                    {n: p[j] for n, p in dense.items()},
                    {n: f[j] for n, f in features.items()},
                    None if inputs is None else inputs[j],
                )
                for j in range(k)
            ]
        )
    if together.shape != alone.shape or not torch.allclose(together, alone, rtol=1e-9, atol=1e-12):
        return "vmapped, it gives other outputs than one client at a time"
    return None
