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
