"""Whether tensors hold NaN or Inf, as a 0-d bool tensor on their device (no host read), so a
round can read it together with its other checks.

Through each tensor's extremes (``torch.aminmax``, one vectorised pass that propagates NaN):
every entry is finite exactly when the smallest and the largest are. ``torch.isfinite(x).all()``
says the same but, on the CPU, writes a bool tensor in several passes first, ~7x slower on a
round's table rows; the round checks three times (the updates, the aggregate, the model)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def any_nonfinite(
    tensors: Iterable[torch.Tensor], device: torch.device | None = None
) -> torch.Tensor:
    """True when some entry of ``tensors`` is NaN, Inf or -Inf (``device``: where the answer
    lives when there are no tensors; else on the accelerator if any tensor is on one, so that
    host-resident tables beside device-resident dense parameters (execution.table_placement =
    "host") are checked without reading the device from the host)."""
    extremes = [torch.stack(torch.aminmax(t)).to(torch.float64) for t in tensors if t.numel()]
    if not extremes:
        return torch.tensor(False, device=device)
    target = next((e.device for e in extremes if e.device.type != "cpu"), extremes[0].device)
    together = torch.cat([e.to(target, non_blocking=True) for e in extremes])
    return ~torch.isfinite(together).all()
