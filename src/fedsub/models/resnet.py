"""Pre-activation ResNet-18, width-sliceable as in HeteroFL / FedRolex (seed 003's model).

Stages of two pre-activation blocks with widths ``[64, 128, 256, 512]`` (times the capacity
for a sub-model: ceil(beta * width)), strides 1, 2, 2, 2; BatchNorm that always normalizes
with the batch's statistics and keeps no running statistics ("static BN": a sub-model's
statistics would not fit the full model); a scaler dividing each convolution's output by the
capacity while training. Channel groups: the residual stream of each stage (``stage<i>``: the
stem or stage's shortcut output, every block's output and BatchNorm on it) and each block's
inner width (``stage<i>.block<j>``); the classifier keeps every class.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedsub.models.base import Features, Ids, Task
from fedsub.models.width import Axes, Slicing
from fedsub.submodel.params import Params

STRIDES = (1, 2, 2, 2)


def batch_norm_written_out(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """``F.batch_norm(x, None, None, weight, bias, training=True)`` as its formula: each channel
    normalised by its batch mean and biased variance, then scaled and shifted. On CUDA, torch's
    batch norm under vmap refuses a width-sliced cohort's input ("Expected input->is_contiguous",
    seen on an H200 with torch 2.11, also after ``.contiguous()``); the CPU keeps torch's kernel,
    so CPU results stay bit for bit."""
    mean = x.mean(dim=(0, 2, 3), keepdim=True)
    var = x.var(dim=(0, 2, 3), correction=0, keepdim=True)
    shape = (1, -1, 1, 1)
    return (x - mean) * torch.rsqrt(var + eps) * weight.reshape(shape) + bias.reshape(shape)


@dataclass(frozen=True)
class PreActResNet18:
    classes: int = 10
    side: int = 32
    in_channels: int = 3
    widths: tuple[int, int, int, int] = (64, 128, 256, 512)
    capacity: float = 1.0
    scaler: bool = True
    eval_batch: int = 256  # evaluation batches (BatchNorm uses each batch's statistics)
    task: Task = "multiclass"

    def _blocks(self):
        """(prefix, input group, inner group, output group, stride, has shortcut conv)."""
        previous = "stage0"
        for stage, stride in enumerate(STRIDES):
            group = f"stage{stage}"
            for block in range(2):
                prefix = f"stage{stage}.block{block}"
                step = stride if block == 0 else 1
                shortcut = block == 0 and (step != 1 or previous != group)
                yield prefix, previous, prefix, group, step, shortcut
                previous = group

    @property
    def slicing(self) -> Slicing:
        groups = {f"stage{i}": w for i, w in enumerate(self.widths)}
        axes: dict[str, Axes] = {"stem.weight": ("stage0", None, None, None)}
        for prefix, given, inner, out, _, shortcut in self._blocks():
            groups[inner] = self.widths[int(out[len("stage") :])]
            axes[f"{prefix}.bn1.weight"] = (given,)
            axes[f"{prefix}.bn1.bias"] = (given,)
            axes[f"{prefix}.conv1.weight"] = (inner, given, None, None)
            axes[f"{prefix}.bn2.weight"] = (inner,)
            axes[f"{prefix}.bn2.bias"] = (inner,)
            axes[f"{prefix}.conv2.weight"] = (out, inner, None, None)
            if shortcut:
                axes[f"{prefix}.shortcut.weight"] = (out, given, None, None)
        axes["bn.weight"] = ("stage3",)
        axes["bn.bias"] = ("stage3",)
        axes["fc.weight"] = (None, "stage3")
        axes["fc.bias"] = (None,)
        return Slicing(groups, axes)

    def at_capacity(self, capacity: float) -> PreActResNet18:
        return dataclasses.replace(self, capacity=capacity)

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        slicing = self.slicing
        groups = dict(slicing.groups)

        def size(axis: str | None) -> int:
            """The width of a sliced axis; every leading axis initialized here is one."""
            if axis is None:
                raise ValueError("PreActResNet18.init: expected a sliced (named) axis")
            return groups[axis]

        def shape(name: str, kernel: int) -> tuple[int, ...]:
            out, given = slicing.axes[name][:2]
            return (size(out), self.in_channels if given is None else size(given), kernel, kernel)

        dense: dict[str, torch.Tensor] = {}
        for name, axes in slicing.axes.items():
            if name.endswith("bn1.weight") or name.endswith("bn2.weight") or name == "bn.weight":
                dense[name] = torch.ones(size(axes[0]), dtype=dtype)
            elif name.endswith(".bias") and name != "fc.bias":
                dense[name] = torch.zeros(size(axes[0]), dtype=dtype)
            elif name == "fc.weight":
                fan_in = size("stage3")
                weight = torch.randn(self.classes, fan_in, generator=generator, dtype=dtype)
                dense[name] = weight / fan_in**0.5
            elif name == "fc.bias":
                dense[name] = torch.zeros(self.classes, dtype=dtype)
            else:
                kernel = 1 if name.endswith("shortcut.weight") else 3
                dims = shape(name, kernel)
                fan_in = dims[1] * kernel * kernel
                weight = torch.randn(*dims, generator=generator, dtype=dtype)
                dense[name] = weight * (2 / fan_in) ** 0.5
        return Params({}, dense)

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features:
        return {}

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.capacity if self.scaler and self.capacity != 1.0 else x

    def _conv(self, x: torch.Tensor, weight: torch.Tensor, stride: int = 1) -> torch.Tensor:
        padding = weight.shape[-1] // 2
        return self._scale(F.conv2d(x, weight, stride=stride, padding=padding))

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        if dense_inputs is None:
            raise ValueError("the ResNet needs the pixels as dense features")

        def norm(x: torch.Tensor, name: str) -> torch.Tensor:
            weight, bias = dense[f"{name}.weight"], dense[f"{name}.bias"]
            if x.is_cuda:
                return batch_norm_written_out(x, weight, bias)
            return F.batch_norm(x, None, None, weight, bias, training=True)

        x = dense_inputs.reshape(-1, self.in_channels, self.side, self.side)
        x = self._conv(x, dense["stem.weight"])
        for prefix, _, _, _, stride, shortcut in self._blocks():
            out = F.relu(norm(x, f"{prefix}.bn1"))
            skip = self._conv(out, dense[f"{prefix}.shortcut.weight"], stride) if shortcut else x
            out = self._conv(out, dense[f"{prefix}.conv1.weight"], stride)
            out = self._conv(F.relu(norm(out, f"{prefix}.bn2")), dense[f"{prefix}.conv2.weight"])
            x = out + skip
        x = F.relu(norm(x, "bn")).mean(dim=(2, 3))
        return F.linear(x, dense["fc.weight"], dense["fc.bias"])

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, labels.long())
