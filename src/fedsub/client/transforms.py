"""A client's local rule as a chain of small gradient transforms (in the style of Optax).

Each transform is a frozen dataclass of its options with two methods::

    init(params, members) -> state                        at the start of the round
    update(grads, state, params, members) -> (updates, state)   at every local step

``state`` is a dict of named tensors (lists of tensors, one per parameter tensor), owned by
the transform and reset every round. ``updates`` are what the next transform receives as its
``grads``; the last transform of a chain returns the change to add to the parameters
(``apply_updates``). ``members`` (``Members``) says whose entries are where (a ``Layout``: one
client, or a whole cohort in the batched backend's layout), each member's learning rate and
SCAFFOLD's corrections, so every transform runs unchanged on every backend.

A round's chain (``client/work.py: round_chain``) puts the pieces in this order, which is the
order of operations fedsub has always used::

    g = grad(batch-mean loss) + mu * (x - x0)            prox       FedProx (x0: pulled model)
    g = g * min(1, clip_norm / (||g|| + 1e-6))           clip       per member
    g = g + weight_decay * x                              decay      as torch.optim.SGD
    g = g + (c - c_i)                                     scaffold   SCAFFOLD's correction
    b = momentum * b + g  (b = 0 at the round's start)    momentum   as torch.optim.SGD
    x = x - lr_k * b                                      sgd        lr_k: member k's lr
                                               (or adam:  torch.optim.Adam, moments per member)

A new client rule is one new transform here plus ``@register``; its options become keys of
``[algorithms.<name>]`` when it is named in ``client = [...]``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, cast, runtime_checkable

import numpy as np
import torch

from fedsub import plugins
from fedsub.client.layout import Layout

CLIP_EPS = 1e-6
SPREAD = "spread"  # a Scaling's state key: its round-fixed factor spread onto each tensor
Tensors = Sequence[torch.Tensor]
State = dict[str, Any]
Out = tuple[list[torch.Tensor], State]  # (updates, new state)

# Where a transform goes in a round's chain (client/work.py sorts the pieces by it).
Stage = Literal["gradient", "clip", "decay", "correction", "direction", "step"]
STAGES: tuple[Stage, ...] = ("gradient", "clip", "decay", "correction", "direction", "step")


@dataclass(frozen=True)
class Members:
    """What a transform may read about the members training together: where their entries are
    (``layout``), their learning rates (float64, one per member) and SCAFFOLD's ``c - c_i``
    in the parameters' layout (None when the algorithm keeps no control variates)."""

    layout: Layout
    lr: np.ndarray
    corrections: list[torch.Tensor] | None = None


class Transform(Protocol):
    name: ClassVar[str]  # its name in configs and Flower messages
    stage: ClassVar[Stage]  # where it goes in a round's chain
    keeps_client_state: ClassVar[bool]  # state kept on the client across rounds (SCAFFOLD)
    __dataclass_fields__: ClassVar[dict[str, Any]]  # a dataclass: its fields are its options

    def init(self, params: Tensors, members: Members) -> State: ...

    def update(
        self, grads: Tensors, state: State, params: Tensors, members: Members
    ) -> tuple[list[torch.Tensor], State]: ...


@runtime_checkable
class PullsWholeModel(Protocol):
    """A transform that, with its options, needs every client to train the whole model (every
    row of every table), not its submodel S(k): the engine then gives each client every row."""

    @property
    def whole_model(self) -> bool: ...


@runtime_checkable
class Scaling(Protocol):
    """A transform whose update multiplies every tensor by a factor per member and leaves its
    state as it is: ``update`` is ``g * factor`` (the factor spread onto each tensor).
    ``Chain.step`` folds a chain's trailing scalings into the parameter update: the members'
    factors multiply once (a [K] vector), then ``x += g * f`` is one pass over each tensor,
    instead of one pass per scaling and one more for the add (the dense parameters of a cohort
    of DIN clients are 17.5 MB, and each pass reads and writes them) and a few small ops per
    tensor per scaling. ``reads_grads``: the factor depends on the incoming values
    (clipping's norm), so a scaling before it in the run is applied first."""

    reads_grads: ClassVar[bool]
    # A scaling whose factor is fixed for the round (sgd's learning rates) may keep it spread
    # onto the tensors in its state under SPREAD; a chain whose only trailing scaling it is
    # then uses those instead of spreading the factor at every step.

    def member_factors(
        self, grads: Tensors, state: State, params: Tensors, members: Members
    ) -> torch.Tensor | float:
        """Each member's factor (a float for all, a 0-d tensor for one client, or [K])."""
        ...


# --- the registry --------------------------------------------------------------------------
def is_transform(value: object) -> bool:
    """A transform class: a dataclass with a ``name``, a known ``stage``, the
    ``keeps_client_state`` declaration, ``init`` and ``update`` (as ``Transform`` says)."""
    if not (isinstance(value, type) and dataclasses.is_dataclass(value)):
        return False
    declared = all(hasattr(value, a) for a in ("name", "keeps_client_state", "init", "update"))
    return declared and getattr(value, "stage", None) in STAGES


# A plugin package adds a transform by giving its class (fedsub/plugins.py).
TRANSFORMS: plugins.Registry[type] = plugins.Registry(
    "client transform", {}, is_transform, lambda cls: str(cls.__dict__.get("name", ""))
)


def register(cls: type) -> type:
    """Make a transform class known by its ``name`` (config, Flower messages, ``fedsub list``);
    its dataclass fields are its options (config keys of the same name)."""
    TRANSFORMS.add_built_in(cls.__dict__["name"], cls)
    return cls


def transform_names() -> list[str]:
    return TRANSFORMS.names()


# --- the transforms ------------------------------------------------------------------------
@register
@dataclass(frozen=True)
class Prox:
    """FedProx's proximal term: the gradient of ``(mu / 2) ||x - x0||^2``, x0 the pulled model."""

    name: ClassVar[str] = "prox"
    stage: ClassVar[Stage] = "gradient"
    keeps_client_state: ClassVar[bool] = False
    mu: float = field(default=0.01, metadata={"min": 0.0})
    """The proximal term's weight: (mu / 2) ||x - x_global||^2."""

    def init(self, params: Tensors, members: Members) -> State:
        return {"anchor": [x.detach().clone() for x in params]} if self.mu else {}

    def update(self, grads: Tensors, state: State, params: Tensors, members: Members) -> Out:
        if not self.mu:  # mu = 0 is plain SGD, exactly
            return list(grads), state
        anchor = state["anchor"]
        # (x - a) * mu + g, in place on the one temporary: the same numbers as g + mu * (x - a)
        # (a sum is commutative) with one allocation instead of three per tensor
        return [
            torch.sub(x, a).mul_(self.mu).add_(g)
            for g, x, a in zip(grads, params, anchor, strict=True)
        ], state


def clip_scale(squared_norm: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s factor, for one norm or a vector of per-member norms."""
    return (clip_norm / (squared_norm.sqrt() + CLIP_EPS)).clamp(max=1.0)


@register
@dataclass(frozen=True)
class Clip:
    """Scale each member's whole gradient to norm at most ``clip_norm`` (as
    torch.nn.utils.clip_grad_norm_ over that member's parameters)."""

    name: ClassVar[str] = "clip"
    stage: ClassVar[Stage] = "clip"
    keeps_client_state: ClassVar[bool] = False
    reads_grads: ClassVar[bool] = True  # a Scaling (its factor comes from the norm)
    clip_norm: float = field(default=1.0, metadata={"min_exclusive": 0.0})

    def init(self, params: Tensors, members: Members) -> State:
        return {}

    def member_factors(
        self, grads: Tensors, state: State, params: Tensors, members: Members
    ) -> torch.Tensor | float:
        return clip_scale(members.layout.squared_norms(grads), self.clip_norm)

    def update(self, grads: Tensors, state: State, params: Tensors, members: Members) -> Out:
        factor = self.member_factors(grads, state, params, members)
        factors = members.layout.spread_all(factor, grads)
        return [g * f for g, f in zip(grads, factors, strict=True)], state


@register
@dataclass(frozen=True)
class WeightDecay:
    """L2 regularization added to the gradient, as torch.optim.SGD(weight_decay)."""

    name: ClassVar[str] = "weight-decay"
    stage: ClassVar[Stage] = "decay"
    keeps_client_state: ClassVar[bool] = False
    weight_decay: float = field(default=0.0, metadata={"min": 0.0})

    def init(self, params: Tensors, members: Members) -> State:
        return {}

    def update(self, grads: Tensors, state: State, params: Tensors, members: Members) -> Out:
        wd = self.weight_decay
        return [torch.mul(x, wd).add_(g) for g, x in zip(grads, params, strict=True)], state


@register
@dataclass(frozen=True)
class ScaffoldCorrection:
    """SCAFFOLD's drift correction ``c - c_i`` added to every gradient (option II variates).

    The client keeps c_i across rounds (``keeps_client_state``): the algorithm then keeps
    control variates (fedsub.algorithms.scaffold), which give the corrections and update c_i
    after the round. ``whole_model`` (Karimireddy et al.'s algorithm): the correction is added
    on every coordinate, so each client trains the whole model and moves the rows it does not
    hold by ``-lr (c - c_i)`` per step; false: fedsub's submodel form, S(k) and the dense
    parameters only (``PullsWholeModel``)."""

    name: ClassVar[str] = "scaffold"
    stage: ClassVar[Stage] = "correction"
    keeps_client_state: ClassVar[bool] = True
    whole_model: bool = True
    """true: Karimireddy et al.'s SCAFFOLD (every client trains the whole model); false: fedsub's
    submodel form (c - c_i on S(k) and the dense layers)."""

    def init(self, params: Tensors, members: Members) -> State:
        if members.corrections is None:
            raise ValueError("the scaffold transform needs the round's corrections c - c_i")
        return {"correction": members.corrections}

    def update(self, grads: Tensors, state: State, params: Tensors, members: Members) -> Out:
        return [g + c for g, c in zip(grads, state["correction"], strict=True)], state


@register
@dataclass(frozen=True)
class Momentum:
    """Heavy-ball momentum, as torch.optim.SGD(momentum): ``b = momentum * b + g``, b = 0 at
    the round's start (client state is not kept between rounds)."""

    name: ClassVar[str] = "momentum"
    stage: ClassVar[Stage] = "direction"
    keeps_client_state: ClassVar[bool] = False
    momentum: float = field(default=0.9, metadata={"min": 0.0, "max": 1.0})

    def init(self, params: Tensors, members: Members) -> State:
        return {"buffer": [torch.zeros_like(x) for x in params]}

    def update(self, grads: Tensors, state: State, params: Tensors, members: Members) -> Out:
        m = self.momentum
        buffers = [b * m + g for b, g in zip(state["buffer"], grads, strict=True)]
        return buffers, {"buffer": buffers}


@register
@dataclass(frozen=True)
class Sgd:
    """The step ``-lr_k * g``, with each member's learning rate."""

    name: ClassVar[str] = "sgd"
    stage: ClassVar[Stage] = "step"
    keeps_client_state: ClassVar[bool] = False
    reads_grads: ClassVar[bool] = False  # a Scaling by -lr_k

    def init(self, params: Tensors, members: Members) -> State:
        negative_lr = -members.layout.per_member(members.lr, params[0])
        # fixed for the round: spread onto the tensors once (Chain.step reads SPREAD)
        return {"negative_lr": negative_lr, SPREAD: members.layout.spread_all(negative_lr, params)}

    def member_factors(
        self, grads: Tensors, state: State, params: Tensors, members: Members
    ) -> torch.Tensor | float:
        return state["negative_lr"]

    def update(self, grads: Tensors, state: State, params: Tensors, members: Members) -> Out:
        return [g * lr for g, lr in zip(grads, state[SPREAD], strict=True)], state


@register
@dataclass(frozen=True)
class Adam:
    """Client Adam, as torch.optim.Adam(lr_k, (client_beta1, client_beta2), client_eps).

    Moments per entry (so per member) and one step count, all reset at every round's start."""

    name: ClassVar[str] = "adam"
    stage: ClassVar[Stage] = "step"
    keeps_client_state: ClassVar[bool] = False
    client_beta1: float = field(default=0.9, metadata={"min": 0.0, "max_exclusive": 1.0})
    """Client Adam's first-moment decay."""
    client_beta2: float = field(default=0.999, metadata={"min": 0.0, "max_exclusive": 1.0})
    """Client Adam's second-moment decay."""
    client_eps: float = field(default=1e-8, metadata={"min_exclusive": 0.0})
    """Client Adam's epsilon."""

    def init(self, params: Tensors, members: Members) -> State:
        return {
            "lr": members.layout.per_tensor(members.lr, params),
            "m": [torch.zeros_like(x) for x in params],
            "v": [torch.zeros_like(x) for x in params],
            "count": 0,
        }

    def update(self, grads: Tensors, state: State, params: Tensors, members: Members) -> Out:
        b1, b2 = self.client_beta1, self.client_beta2
        count = state["count"] + 1
        m = [b1 * m + (1 - b1) * g for m, g in zip(state["m"], grads, strict=True)]
        v = [b2 * v + (1 - b2) * g * g for v, g in zip(state["v"], grads, strict=True)]
        first, second = 1 - b1**count, math.sqrt(1 - b2**count)
        updates = [
            mi * (-lr / first) / (vi.sqrt() / second + self.client_eps)
            for mi, vi, lr in zip(m, v, state["lr"], strict=True)
        ]
        return updates, {**state, "m": m, "v": v, "count": count}


# --- composition ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Chain:
    """Transforms applied one after another; its state is one state per transform."""

    transforms: tuple[Transform, ...]

    def init(self, params: Tensors, members: Members) -> tuple[State, ...]:
        return tuple(t.init(params, members) for t in self.transforms)

    def update(
        self, grads: Tensors, state: tuple[State, ...], params: Tensors, members: Members
    ) -> tuple[list[torch.Tensor], tuple[State, ...]]:
        updates, new_state = list(grads), []
        for transform, own in zip(self.transforms, state, strict=True):
            updates, own = transform.update(updates, own, params, members)
            new_state.append(own)
        return updates, tuple(new_state)

    @functools.cached_property
    def _scaling_from(self) -> int:
        """Where the chain's trailing run of ``Scaling`` transforms starts (found once: a
        Protocol ``isinstance`` costs microseconds, which a sparse model's step notices)."""
        start = len(self.transforms)
        while start and isinstance(self.transforms[start - 1], Scaling):
            start -= 1
        return start

    @property
    def scalings_only(self) -> bool:
        """Whether every transform only multiplies the gradient by a factor per member (clip,
        sgd): a parameter then moves by its gradient times a factor, so a weight whose
        gradient is low-rank moves by a low-rank change (models/low_rank.py)."""
        return self._scaling_from == 0

    def step(
        self, grads: Tensors, state: tuple[State, ...], params: Tensors, members: Members
    ) -> tuple[State, ...]:
        """``update`` and ``apply_updates`` in one: the parameters move in place by the
        chain's updates, with its trailing ``Scaling`` transforms folded into one multiply-add
        per tensor (the same update up to the rounding of the factors' product). The
        backends' eager steps and Flower's ClientApp step with it; the captured step
        (engine/captured_step.py) keeps the pure ``update``."""
        scaling_from = self._scaling_from
        updates, new_state = list(grads), []
        layout = members.layout
        factor: torch.Tensor | float | None = None  # the trailing scalings' product per member
        spread: list | None = None  # that factor spread onto the tensors, when a lone
        # scaling keeps it spread in its state (SPREAD)
        for position, (transform, own) in enumerate(zip(self.transforms, state, strict=True)):
            if position >= scaling_from:
                # a Scaling: _scaling_from checked it once (isinstance on a Protocol is slow)
                scaling = cast(Scaling, transform)
                if factor is not None and scaling.reads_grads:  # it needs the values
                    spread = spread or layout.spread_all(factor, updates)
                    updates = [u * f for u, f in zip(updates, spread, strict=True)]
                    factor = None
                more = scaling.member_factors(updates, own, params, members)
                spread = own.get(SPREAD) if factor is None else None
                factor = more if factor is None else factor * more
            else:
                updates, own = transform.update(updates, own, params, members)
            new_state.append(own)
        if factor is None:
            apply_updates(params, updates)
        else:
            factors = spread or layout.spread_all(factor, updates)
            for x, u, f in zip(params, updates, factors, strict=True):
                if isinstance(f, torch.Tensor):
                    x.addcmul_(u, f)
                else:
                    x.add_(u, alpha=f)
        return tuple(new_state)

    @property
    def needs_corrections(self) -> bool:
        """Whether a piece keeps state on the client across rounds (SCAFFOLD's c_i)."""
        return any(t.keeps_client_state for t in self.transforms)

    def describe(self) -> list[dict[str, Any]]:
        """Plain data (names and options) that ``from_description`` turns back into the chain:
        how the Flower runtime tells a ClientApp its local rule."""
        return [{"name": t.name, **dataclasses.asdict(t)} for t in self.transforms]

    @staticmethod
    def from_description(description: list[dict[str, Any]]) -> Chain:
        pieces = []
        for entry in description:
            options = dict(entry)
            name = options.pop("name")
            if name not in TRANSFORMS:
                raise ValueError(
                    f"unknown client transform {name!r}; known: {', '.join(transform_names())}"
                )
            pieces.append(TRANSFORMS[name](**options))
        return Chain(tuple(pieces))


def chain(*transforms: Transform) -> Chain:
    return Chain(tuple(transforms))


def apply_updates(params: Tensors, updates: Tensors) -> None:
    """``x += u`` in place (the parameters are the backend's autograd leaves)."""
    for x, u in zip(params, updates, strict=True):
        x.add_(u)
