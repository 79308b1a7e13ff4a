"""A small width-sliceable CNN for square images (MNIST family): two 5x5 convolutions with
ReLU and 2x2 max pooling, then a linear classifier over the pooled maps.

The classifier's weight keeps the maps' layout ([classes, channels, h, w]) so that narrowing
the second convolution narrows its input by whole channels. With ``capacity`` < 1 and
``scaler`` on, each convolution's output is divided by the capacity while training (HeteroFL's
scaler); the global model is evaluated at capacity 1."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedsub.models.base import Features, Ids, Task
from fedsub.models.width import Slicing
from fedsub.submodel.params import Params


@dataclass(frozen=True)
class SmallCNN:
    classes: int = 10
    side: int = 28
    in_channels: int = 1
    channels: tuple[int, int] = (16, 32)
    capacity: float = 1.0
    scaler: bool = True
    task: Task = "multiclass"

    def __post_init__(self) -> None:
        if self._pooled_side < 1:
            raise ValueError(f"the CNN needs images of side >= 16, got {self.side}")

    @property
    def _pooled_side(self) -> int:
        return ((self.side - 4) // 2 - 4) // 2

    @property
    def slicing(self) -> Slicing:
        c1, c2 = self.channels
        return Slicing(
            groups={"conv1": c1, "conv2": c2},
            axes={
                "conv1.weight": ("conv1", None, None, None),
                "conv1.bias": ("conv1",),
                "conv2.weight": ("conv2", "conv1", None, None),
                "conv2.bias": ("conv2",),
                "fc.weight": (None, "conv2", None, None),
                "fc.bias": (None,),
            },
        )

    def at_capacity(self, capacity: float) -> SmallCNN:
        return dataclasses.replace(self, capacity=capacity)

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        def kaiming(*shape: int, fan_in: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator, dtype=dtype) * (2 / fan_in) ** 0.5

        c1, c2 = self.channels
        side = self._pooled_side
        return Params(
            {},
            {
                "conv1.weight": kaiming(c1, self.in_channels, 5, 5, fan_in=25 * self.in_channels),
                "conv1.bias": torch.zeros(c1, dtype=dtype),
                "conv2.weight": kaiming(c2, c1, 5, 5, fan_in=25 * c1),
                "conv2.bias": torch.zeros(c2, dtype=dtype),
                "fc.weight": kaiming(self.classes, c2, side, side, fan_in=c2 * side * side),
                "fc.bias": torch.zeros(self.classes, dtype=dtype),
            },
        )

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features:
        return {}

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.capacity if self.scaler and self.capacity != 1.0 else x

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        if dense_inputs is None:
            raise ValueError("the CNN needs the pixels as dense features")
        x = dense_inputs.reshape(-1, self.in_channels, self.side, self.side)
        x = F.conv2d(x, dense["conv1.weight"], dense["conv1.bias"])
        x = F.max_pool2d(F.relu(self._scale(x)), 2)
        x = F.conv2d(x, dense["conv2.weight"], dense["conv2.bias"])
        x = F.max_pool2d(F.relu(self._scale(x)), 2)
        return torch.einsum("bchw,kchw->bk", x, dense["fc.weight"]) + dense["fc.bias"]

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, labels.long())
