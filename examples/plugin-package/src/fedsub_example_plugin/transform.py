"""A client transform: sign descent, each gradient entry replaced by ``step * sign(g)``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from fedsub.client.transforms import Members, Stage, State, Tensors


@dataclass(frozen=True)
class Sign:
    """Sign descent: the step follows only the sign of each gradient entry (zero stays zero)."""

    name: ClassVar[str] = "sign"
    stage: ClassVar[Stage] = "direction"
    keeps_client_state: ClassVar[bool] = False
    step: float = field(default=1.0, metadata={"min_exclusive": 0.0})

    def init(self, params: Tensors, members: Members) -> State:
        return {}

    def update(
        self, grads: Tensors, state: State, params: Tensors, members: Members
    ) -> tuple[list[torch.Tensor], State]:
        return [torch.sign(g) * self.step for g in grads], state
