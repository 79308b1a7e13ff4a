"""What keeps a run safe: screening of client updates before aggregation (a bad client must
not poison the model), and the rule that stops a run that diverged (``Diverged``).

A member whose update holds NaN or Inf, or whose norm exceeds ``max_update_norm`` (when set),
is dropped from the round; the round goes on with the rest (``kept``: their update, or the
empty one). After the server step, ``touched_nonfinite`` checks the rows it changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

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
    touched = [
        table if len(u.rows) == len(table) else table.index_select(0, u.rows)  # every row
        for table, u in ((params.tables[t], u) for t, u in update.tables.items())
    ]
    return any_nonfinite([*touched, *params.dense.values()])


def divergence_reason(train_loss: float, initial_loss: float | None, factor: float) -> str | None:
    """Why a train loss of ``train_loss`` means the run diverged, or None when it does not: the
    rule checked at every evaluation. A run diverges at the first evaluation whose train loss
    is not finite (NaN or Inf), or, with ``factor`` > 0, is more than ``factor`` times the
    round-0 train loss ``initial_loss`` (the initial model's, when that is positive). A
    diverged curve never yields rounds-to-target."""
    if math.isnan(train_loss):
        return "the train loss became NaN"
    if math.isinf(train_loss):
        return "the train loss became infinite"
    rising = factor > 0 and initial_loss is not None and initial_loss > 0
    if rising and initial_loss is not None and train_loss > factor * initial_loss:
        return (
            f"train loss {train_loss:.4g} > {factor:g} x the round-0 train loss "
            f"{initial_loss:.4g} (eval.divergence_factor)"
        )
    return None


class Diverged(Exception):
    """The run diverged (``divergence_reason``'s rule, or a model that stopped being finite);
    names the algorithm, the round, why, and the last good checkpoint."""

    def __init__(self, algorithm: str, round_index: int, what: str, last: Path | None) -> None:
        where = f"; last good checkpoint: {last}" if last else "; no checkpoint was written yet"
        super().__init__(
            f"{algorithm}: {what} at round {round_index}{where}. Try a smaller learning rate "
            "or set train.max_update_norm."
        )
        self.algorithm = algorithm
        self.round = round_index
        self.reason = what
        self.checkpoint = last
