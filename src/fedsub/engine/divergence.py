"""When a run counts as diverged: the rule checked at every evaluation.

A run diverges at the first evaluation whose train loss is not finite (NaN or Inf), or,
with ``factor`` > 0, is more than ``factor`` times the round-0 train loss (the loss of the
initial model, when that is positive). A diverged curve never yields rounds-to-target.
"""

from __future__ import annotations

import math


def divergence_reason(train_loss: float, initial_loss: float | None, factor: float) -> str | None:
    """Why a train loss of ``train_loss`` means divergence, or None when it does not."""
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
