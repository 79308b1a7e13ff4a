"""Screening of client updates before aggregation: a bad client must not poison the model.

A member whose update holds NaN or Inf, or whose norm exceeds ``max_update_norm`` (when set),
is dropped from the round; the round goes on with the rest (``kept``: their update, or the
empty one). After the server step, ``touched_nonfinite`` checks the rows it changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedsub.algorithms.aggregation import ServerUpdate
from fedsub.numerics.finite import any_nonfinite
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import Updates, empty_update


@dataclass(frozen=True)
class Rejection:
    client: int
    round: int
    reason: str

    def as_json(self) -> dict:
        return {"round": self.round, "client": self.client, "reason": self.reason}


def needs_screening(update: Updates, max_update_norm: float) -> torch.Tensor:
    """A 0-d bool tensor on the update's device: whether ``screen`` would reject a member
    (an update with NaN or Inf, or a norm over ``max_update_norm``), computed without a host
    read so a round can read it together with its other checks."""
    if not max_update_norm:  # only NaN / Inf to look for: no norms needed
        return update.nonfinite()
    norms = update.squared_norms().sqrt()
    return any_nonfinite([norms]) | (norms > max_update_norm).any()


def screen(
    update: Updates, round_index: int, max_update_norm: float
) -> tuple[list[int], list[Rejection]]:
    """Cohort positions to keep, and why the others were rejected."""
    if not bool(needs_screening(update, max_update_norm)):
        return list(range(len(update))), []  # the usual round: nothing to reject
    norms = update.squared_norms().sqrt()
    kept, rejected = [], []
    for j, (client, norm) in enumerate(zip(update.clients.tolist(), norms.tolist(), strict=True)):
        if not math.isfinite(norm):
            rejected.append(Rejection(client, round_index, "update contains NaN or Inf"))
        elif max_update_norm and norm > max_update_norm:
            rejected.append(
                Rejection(client, round_index, f"update norm {norm:.4g} > {max_update_norm:g}")
            )
        else:
            kept.append(j)
    return kept, rejected


def kept(update: Updates, members: list[int], params: Params) -> Updates:
    """The update of the ``members`` kept by screening, or (none kept) the empty update of
    the model ``params``: a round without members may still combine (a mechanism's noise)."""
    return update.select(members) if members else nobody(params)


def nobody(params: Params) -> Updates:
    """The update of a round none of whose members' work is there."""
    return empty_update(params)


def touched_nonfinite(params: Params, update: ServerUpdate) -> torch.Tensor:
    """A 0-d bool tensor on the model's device: whether a row this round changed, or a dense
    parameter, is NaN or Inf. O(touched), no host read."""
    touched = [params.tables[t].index_select(0, u.rows) for t, u in update.tables.items()]
    return any_nonfinite([*touched, *params.dense.values()])
