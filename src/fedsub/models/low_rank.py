"""A cohort's per-client weights as the shared global weight plus each client's low-rank change.

Why: in a local step, the gradient of a linear layer ``y = x @ W + b`` is ``X^T D`` (X the
layer's inputs, D the gradient at its outputs, one row per sample): rank B at most. Under SGD
(with per-member scalings only: clipping, the learning rate), client k's weight after s steps
is ``W + sum_{t < s} X_t^T D_t`` (each D_t already scaled by -lr_k and the clip factor). For
DIN's output MLP (fc0: 90 x 200, fc1: 200 x 80) with B = 4 and I = 10 steps that change has
rank 40 at most, so the cohort keeps K x 40 x (in + out) numbers instead of K x in x out, and a
step never writes the K x in x out gradient, squares it for the clipping norm, reads it back
for the update, or reads the stacked weights in the forward and backward passes: the passes
over memory that bound the batched DIN step (17.5 MB of dense parameters for K = 100).

    forward      y = x @ W + (x @ U^T) @ V + b      (x @ W: one matmul for the whole cohort)
    backward     dx = D @ W^T + (D @ V^T) @ U,  db = sum of D;  the weight's gradient is
                 kept as its factors (X, D): ``LowRankGradient``
    clip norm    ||X^T D||^2 = sum((X X^T) * (D D^T))  (B x B Gram matrices)
    update       U, V grow by (X, f * D) for the step's per-member factor f

U [K, r, in] and V [K, r, out] hold the factors of the steps so far. The numbers are the dense
form's up to rounding (tests/test_low_rank.py checks both against a dense per-client loop).
The engine uses it when the client rule only scales the gradient per member
(``Chain.scalings_only``) and the factors are fewer numbers than the weight
(``worth_it``); FedProx's term, weight decay, momentum, Adam and SCAFFOLD's correction add
full-rank terms and keep the dense form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable


def worth_it(shape: tuple[int, ...], rows: int) -> bool:
    """Whether ``rows`` factor rows (local steps x rows per step) of a [in, out] weight are
    fewer numbers than the weight itself (otherwise the dense form is cheaper)."""
    fan_in, fan_out = shape
    return rows * (fan_in + fan_out) < fan_in * fan_out


@dataclass(frozen=True)
class LowRankGradient:
    """Each member's gradient ``left[k]^T @ right[k]`` ([in, out]), never formed."""

    left: torch.Tensor  # [K, n, in]: the layer's inputs
    right: torch.Tensor  # [K, n, out]: the gradient at its outputs (times the factors so far)

    def dim(self) -> int:  # as the [K, in, out] tensor it stands for (Layout.spread reads it)
        return 3

    def squared_norms(self) -> torch.Tensor:
        """[K]: each member's squared Frobenius norm, from the n x n Gram matrices."""
        inputs = torch.bmm(self.left, self.left.transpose(1, 2))
        outputs = torch.bmm(self.right, self.right.transpose(1, 2))
        return (inputs * outputs).sum((1, 2))

    def __mul__(self, factor: torch.Tensor | float) -> LowRankGradient:
        """Times a per-member factor ([K, 1, 1] or a float)."""
        return LowRankGradient(self.left, self.right * factor)

    def __add__(self, other: LowRankGradient) -> LowRankGradient:
        """The sum: both sets of factors (a weight used twice in one step)."""
        return LowRankGradient(
            torch.cat([self.left, other.left], dim=1), torch.cat([self.right, other.right], dim=1)
        )

    def dense(self) -> torch.Tensor:
        """[K, in, out]: the gradient written out (the tests' reference)."""
        return torch.bmm(self.left.transpose(1, 2), self.right)


class LowRankWeight:
    """The [K, in, out] weights of a cohort as ``base`` [in, out] plus ``U^T V`` per member.

    ``probe`` [K] is the autograd leaf that stands for the weight in a step's gradient list:
    its gradient is zero, and the weight's real gradient is taken with ``take_gradient`` after
    the backward pass. The parameter update is ``addcmul_`` / ``add_`` (what ``Chain.step``
    calls on a parameter), which appends the step's factors."""

    def __init__(self, base: torch.Tensor, members: int, capacity: int) -> None:
        """``capacity``: the factor rows the round will add (local steps x rows per step)."""
        fan_in, fan_out = base.shape
        self.base = base
        self._left = base.new_zeros(members, capacity, fan_in)
        self._right = base.new_zeros(members, capacity, fan_out)
        self._used = 0
        self.probe = base.new_zeros(members).requires_grad_(True)
        self._pending: LowRankGradient | None = None

    @property
    def left(self) -> torch.Tensor:
        """[K, r, in]: the factors U so far."""
        return self._left[:, : self._used]

    @property
    def right(self) -> torch.Tensor:
        """[K, r, out]: the factors V so far."""
        return self._right[:, : self._used]

    # as the [K, in, out] tensor it stands for, where a client transform's init reads it
    def dim(self) -> int:
        return 3

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    def linear(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Per-member affine map: x [K, ..., in] -> [K, ..., out], bias [K, out]."""
        k = x.shape[0]
        flat = x.reshape(k, -1, x.shape[-1])
        out = _LowRankLinear.apply(flat, bias, self.probe, self)
        return out.reshape(*x.shape[:-1], self.base.shape[1])

    def take_gradient(self) -> LowRankGradient:
        """The gradient of the backward pass that just ran (once)."""
        if self._pending is None:
            raise RuntimeError("no backward pass has reached this low-rank weight")
        gradient, self._pending = self._pending, None
        return gradient

    def addcmul_(self, update: LowRankGradient, factor: torch.Tensor) -> LowRankWeight:
        """``W += update * factor`` (factor per member, [K, 1, 1])."""
        return self.add_(update * factor)

    def add_(self, update: LowRankGradient, alpha: float = 1.0) -> LowRankWeight:
        """``W += alpha * update``."""
        scaled = update if alpha == 1.0 else update * alpha
        start, rows = self._used, scaled.left.shape[1]
        if start + rows > self._left.shape[1]:
            raise ValueError(
                f"a low-rank weight holds {self._left.shape[1]} factor rows (local steps x batch"
                f" size); this update would make {start + rows}: a model's low_rank_weights"
                " must see one row per sample, once per step"
            )
        self._left[:, start : start + rows] = scaled.left
        self._right[:, start : start + rows] = scaled.right
        self._used = start + rows
        return self

    def change(self) -> torch.Tensor:
        """[K, in, out]: each member's weight minus ``base`` (its update over the round)."""
        return torch.bmm(self.left.transpose(1, 2), self.right)

    def dense(self) -> torch.Tensor:
        """[K, in, out]: each member's weight written out."""
        return torch.baddbmm(self.base, self.left.transpose(1, 2), self.right)


class _LowRankLinear(torch.autograd.Function):
    """``x @ (base + U^T V) + bias`` per member; the weight's gradient goes to the weight's
    ``_pending`` as factors, its probe gets zeros."""

    @staticmethod
    def forward(
        x: torch.Tensor, bias: torch.Tensor, probe: torch.Tensor, weight: LowRankWeight
    ) -> torch.Tensor:
        k, n, fan_in = x.shape
        out = torch.addmm(
            bias.repeat_interleave(n, dim=0), x.reshape(k * n, fan_in), weight.base
        ).reshape(k, n, -1)
        if weight.left.shape[1]:
            out = out.baddbmm_(torch.bmm(x, weight.left.transpose(1, 2)), weight.right)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, _, _, weight = inputs
        ctx.save_for_backward(x)
        # the factors of the steps before this one (views: the update writes rows after them)
        ctx.left, ctx.right, ctx.weight = weight.left, weight.right, weight

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        left, right = ctx.left, ctx.right
        weight: LowRankWeight = ctx.weight
        k, n, fan_out = grad.shape
        grad = grad.contiguous()
        gradient = LowRankGradient(x, grad)
        pending = weight._pending  # set already if the step used the weight more than once
        weight._pending = gradient if pending is None else pending + gradient
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad.reshape(k * n, fan_out) @ weight.base.T).reshape(k, n, -1)
            if left.shape[1]:
                grad_x = grad_x.baddbmm_(torch.bmm(grad, right.transpose(1, 2)), left)
        return grad_x, grad.sum(1), torch.zeros_like(ctx.weight.probe), None
