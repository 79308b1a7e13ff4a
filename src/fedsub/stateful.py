"""State as data: every stateful piece of a round (the model's parameters, the server
optimizer, SCAFFOLD's control variates, any later one) shows its state as one dict of named
tensors, so checkpoints (engine/checkpoint.py) save and restore every piece the same way and a
new stateful piece needs no checkpoint code (the named-state idea of Optax's chains and TFF's
composers)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Stateful(Protocol):
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything needed to resume, as named tensors (one safetensors file)."""
        ...

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what ``state_tensors`` returned; raise ``ValueError`` (or ``FedsubError``)
        naming what does not fit when the tensors are not this piece's."""
        ...


def kept_from_the_start(stage: object) -> bool:
    """Whether ``stage`` holds what a restart must reuse to repeat the run's releases (a
    guarantee's secret key: numerics/secret_streams.py): a run checkpoints it before round 1,
    so that an attempt stopped before its first checkpoint does not restart on a fresh secret
    and release the same rounds again under other noise. A stage says so by its class
    attribute ``KEPT_FROM_THE_START = True``."""
    return bool(getattr(stage, "KEPT_FROM_THE_START", False))
