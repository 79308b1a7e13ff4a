"""A small CNN for 28 x 28 grey images (MNIST family): two 5x5 convolutions (16, 32
channels) with ReLU and 2x2 max pooling, then a linear classifier. Dense only: every client
trains the whole model; the batched engine vmaps its head over the cohort."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedsub.models.base import Features, Ids, Task
from fedsub.submodel.params import Params


@dataclass(frozen=True)
class SmallCNN:
    classes: int = 10
    side: int = 28
    channels: tuple[int, int] = (16, 32)
    task: Task = "multiclass"

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        def kaiming(*shape: int, fan_in: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator, dtype=dtype) * (2 / fan_in) ** 0.5

        c1, c2 = self.channels
        flat = c2 * (((self.side - 4) // 2 - 4) // 2) ** 2
        return Params(
            {},
            {
                "conv1.weight": kaiming(c1, 1, 5, 5, fan_in=25),
                "conv1.bias": torch.zeros(c1, dtype=dtype),
                "conv2.weight": kaiming(c2, c1, 5, 5, fan_in=25 * c1),
                "conv2.bias": torch.zeros(c2, dtype=dtype),
                "fc.weight": kaiming(flat, self.classes, fan_in=flat),
                "fc.bias": torch.zeros(self.classes, dtype=dtype),
            },
        )

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features:
        return {}

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        if dense_inputs is None:
            raise ValueError("the CNN needs the pixels as dense features")
        x = dense_inputs.reshape(-1, 1, self.side, self.side)
        x = F.max_pool2d(F.relu(F.conv2d(x, dense["conv1.weight"], dense["conv1.bias"])), 2)
        x = F.max_pool2d(F.relu(F.conv2d(x, dense["conv2.weight"], dense["conv2.bias"])), 2)
        return x.flatten(1) @ dense["fc.weight"] + dense["fc.bias"]

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, labels.long())
