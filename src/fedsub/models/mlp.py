"""A width-sliceable multilayer perceptron: dense inputs, ReLU hidden layers, class logits.

Each hidden layer's units form a channel group; the output layer keeps every class. With
``capacity`` < 1 and ``scaler`` on, hidden pre-activations are divided by the capacity while
training (HeteroFL's scaler)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedsub.models.base import Features, Ids, Task
from fedsub.models.width import Axes, Slicing
from fedsub.submodel.params import Params


@dataclass(frozen=True)
class MLP:
    inputs: int
    classes: int = 10
    hidden: tuple[int, ...] = (200, 200)
    capacity: float = 1.0
    scaler: bool = True
    task: Task = "multiclass"

    @property
    def slicing(self) -> Slicing:
        groups = {f"hidden{i}": width for i, width in enumerate(self.hidden)}
        axes: dict[str, Axes] = {}
        previous: str | None = None
        for i in range(len(self.hidden)):
            axes[f"layer{i}.weight"] = (f"hidden{i}", previous)
            axes[f"layer{i}.bias"] = (f"hidden{i}",)
            previous = f"hidden{i}"
        axes["out.weight"] = (None, previous)
        axes["out.bias"] = (None,)
        return Slicing(groups, axes)

    def at_capacity(self, capacity: float) -> MLP:
        return dataclasses.replace(self, capacity=capacity)

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        dense = {}
        fan_in = self.inputs
        for i, width in enumerate((*self.hidden, self.classes)):
            name = f"layer{i}" if i < len(self.hidden) else "out"
            weight = torch.randn(width, fan_in, generator=generator, dtype=dtype)
            dense[f"{name}.weight"] = weight * (2 / fan_in) ** 0.5
            dense[f"{name}.bias"] = torch.zeros(width, dtype=dtype)
            fan_in = width
        return Params({}, dense)

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features:
        return {}

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        if dense_inputs is None:
            raise ValueError("the MLP needs dense input features")
        x = dense_inputs
        for i in range(len(self.hidden)):
            x = F.linear(x, dense[f"layer{i}.weight"], dense[f"layer{i}.bias"])
            if self.scaler and self.capacity != 1.0:
                x = x / self.capacity
            x = F.relu(x)
        return F.linear(x, dense["out.weight"], dense["out.bias"])

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, labels.long())
