"""Which table module reads which field: recorded by running a module's forward once.

fedsub splits a user's module at its tables (``embed`` looks rows up for a whole cohort at
once, ``head`` runs the rest per client), so it must know, for every call of a table module
in ``forward``, which field's ids it reads and how it gets the offsets. Hooks on the table
modules record that on a small batch of real samples; a call whose ids are not one field's
``batch.ids`` as given (or a view of its offsets), or whose result is not one row per sample,
makes the forward unsplittable, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from fedsub.models.bag_offsets import same_view
from fedsub.models.base import Ids

# How a lookup gets its offsets: fedsub's whole offsets (n + 1 entries, for an EmbeddingBag
# with include_last_offset=True), their first n (the bags' starts: offsets[:-1]), or none
# (an nn.Embedding on a field with one id per sample).
OffsetsUse = Literal["whole", "starts", "none"]


@dataclass(frozen=True)
class Lookup:
    """One call of a table module in the forward pass."""

    path: str  # the table module's attribute path
    table: str
    field: str
    offsets: OffsetsUse


@dataclass(frozen=True)
class Trace:
    lookups: tuple[Lookup, ...]  # in call order
    outputs: torch.Tensor  # the forward's outputs on the batch
    unsplittable: str | None  # why the forward cannot be split at its tables (None: it can)


def trace(
    module: nn.Module,
    paths: dict[str, str],
    ids: Ids,
    call: Callable[[nn.Module], torch.Tensor],
) -> Trace:
    """Run ``call(module)`` (the forward on a batch whose ids are ``ids``) with hooks on the
    table modules (``paths``: table -> attribute path) and record their calls."""
    samples = len(next(iter(ids.values()))[1]) - 1 if ids else 0
    lookups: list[Lookup] = []
    reasons: list[str] = []
    handles = []
    for table, path in paths.items():
        table_module = module.get_submodule(path)

        def before(_m: nn.Module, args: tuple, kwargs: dict, table=table, path=path) -> None:
            lookup, reason = _lookup_of(path, table, args, kwargs, ids)
            if reason is not None:
                reasons.append(reason)
            elif lookup is not None:
                lookups.append(lookup)

        def after(_m: nn.Module, _args: tuple, _kwargs: dict, output: Any, path=path) -> None:
            rows = output.shape[0] if isinstance(output, torch.Tensor) else None
            if rows != samples:
                reasons.append(
                    f"{path!r} returns {rows} rows for a batch of {samples} samples; one row "
                    f"per sample is needed: {_one_row_per_sample(_m)}"
                )

        handles.append(table_module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(table_module.register_forward_hook(after, with_kwargs=True))
    try:
        with torch.no_grad():
            outputs = call(module)
    finally:
        for handle in handles:
            handle.remove()
    return Trace(tuple(lookups), outputs, reasons[0] if reasons else None)


def _lookup_of(
    path: str, table: str, args: tuple, kwargs: dict, ids: Ids
) -> tuple[Lookup | None, str | None]:
    """The lookup a call of table module ``path`` makes, or why it cannot be split off."""
    arguments = dict(zip(("input", "offsets", "per_sample_weights"), args, strict=False))
    arguments.update(kwargs)
    extra = sorted(
        k for k, v in arguments.items() if k not in ("input", "offsets") and v is not None
    )
    if extra or len(args) > 2:
        return None, f"{path!r} is called with more than ids and offsets ({', '.join(extra)})"
    values, offsets = arguments.get("input"), arguments.get("offsets")
    field = next((f for f, (v, _) in ids.items() if values is v), None)
    if field is None:
        field = next((f for f, (v, _) in ids.items() if same_view(values, v)), None)
    if field is None:
        return None, (
            f"{path!r} reads ids that are not a field's batch.ids values as given (computed "
            "from them, or from elsewhere)"
        )
    whole = ids[field][1]
    if offsets is None:
        return Lookup(path, table, field, "none"), None
    if offsets is whole or same_view(offsets, whole):
        return Lookup(path, table, field, "whole"), None
    if same_view(offsets, whole[:-1]):
        return Lookup(path, table, field, "starts"), None
    return None, (
        f"{path!r} reads field {field!r} with offsets computed from (or other than) its "
        "batch.ids offsets; pass them whole (include_last_offset=True) or as offsets[:-1]"
    )


def _one_row_per_sample(table_module: nn.Module) -> str:
    """What to change so that a table module returns one row per sample."""
    if isinstance(table_module, nn.EmbeddingBag) and table_module.include_last_offset:
        return (
            "it is built with include_last_offset=True, which reads n + 1 offsets: pass it the "
            "field's offsets whole, bag(values, offsets) with values, offsets = batch.ids[field]"
        )
    if isinstance(table_module, nn.EmbeddingBag):
        return (
            "pass it the field's offsets as given, bag(values, offsets) with values, offsets = "
            "batch.ids[field] (fedsub hands a default bag their n starts)"
        )
    return "call it on a field with one id per sample, or use an nn.EmbeddingBag"
