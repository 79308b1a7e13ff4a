"""Model parameters split the way federated submodel training sees them.

``tables`` are embedding tables (a client only ever sees the rows it touches); ``dense`` are the
parameters every client uses in full (biases, MLP weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Params:
    tables: dict[str, torch.Tensor]
    dense: dict[str, torch.Tensor]

    def gather_rows(self, table: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (global ids) of ``table``: what a client pulls. A round's staged
        slice of the model (engine/placement.py) holds only the cohort's rows."""
        return self.tables[table].index_select(0, rows)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.tables.values(), *self.dense.values()]

    def clone(self) -> Params:
        return Params(
            {k: v.clone() for k, v in self.tables.items()},
            {k: v.clone() for k, v in self.dense.items()},
        )

    def to(self, device: torch.device) -> Params:
        """The same parameters on ``device`` (no copy where they already are)."""
        return Params(
            {k: v.to(device) for k, v in self.tables.items()},
            {k: v.to(device) for k, v in self.dense.items()},
        )

    @property
    def device(self) -> torch.device:
        tensors = self.tensors()
        return tensors[0].device if tensors else torch.device("cpu")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat names (``table.<name>`` / ``dense.<name>``), e.g. for safetensors files."""
        return {
            **{f"table.{k}": v for k, v in self.tables.items()},
            **{f"dense.{k}": v for k, v in self.dense.items()},
        }

    @staticmethod
    def from_state_dict(flat: dict[str, torch.Tensor]) -> Params:
        tables = {k[len("table.") :]: v for k, v in flat.items() if k.startswith("table.")}
        dense = {k[len("dense.") :]: v for k, v in flat.items() if k.startswith("dense.")}
        return Params(tables, dense)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters as a stateful stage (fedsub.stateful): ``state_dict``'s names."""
        return self.state_dict()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy saved values into these tensors in place (optimizers and the server round
        hold references to them); the names and shapes must be exactly these parameters'."""
        own = self.state_dict()
        if set(tensors) != set(own):
            missing = sorted(set(own) - set(tensors))
            unexpected = sorted(set(tensors) - set(own))
            raise ValueError(
                f"the saved parameters do not match this model: missing {missing}, "
                f"unexpected {unexpected}"
            )
        for name, value in tensors.items():
            if value.shape != own[name].shape:
                raise ValueError(
                    f"saved parameter {name} has shape {tuple(value.shape)}, "
                    f"this model's has {tuple(own[name].shape)}"
                )
        for name, value in tensors.items():
            own[name].copy_(value)
