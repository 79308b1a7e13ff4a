"""Which channels (or coordinates) a client of capacity beta trains in round t (1-based).

For a channel group of C channels a sub-model keeps L = ceil(beta * C):

- ``static``   (HeteroFL): channels [0, L), always.
- ``rolling``  (FedRolex): the window {(t - 1 + i) mod C : i < L}, moving by one per round.
- ``shuffled`` (seed 003, Algorithm 2): the channels are cut once into P = ceil(C / L) pieces
  of L consecutive channels (the last wraps around); each epoch of P rounds visits the pieces
  in a fresh random order, so every piece is trained exactly once per epoch. Groups with the
  same P share the order, keeping the slice one coherent sub-network.
- ``random``   a fresh uniformly random set of L channels per client, group and round.
- ``bernoulli`` (seed 003, Algorithm 1): every coordinate kept with probability beta.
- ``none``     the full model (FedAvg).

Clients of equal capacity get the same slice under static, rolling and shuffled masking (the
engine then trains them together); random and Bernoulli slices are per client.

The schemes are a registry (``SCHEMES``, a ``plugins.Registry`` of ``MaskingSchemeSpec``): each
is a name, its paper's aggregation rule and how it plans a client's slice; a channel scheme
gives only its channel choice (``channel_scheme``). A new scheme is one entry here (or a
plugin's): docs/develop/extending.md, "A masking scheme".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from fedsub.masking.capacity import Capacities
from fedsub.models.width import ChannelSlice, CoordinateMask, Slicing, SubmodelSlice, full_slice
from fedsub.numerics import seeding
from fedsub.plugins import Registry

MaskingScheme = str  # a name in ``SCHEMES``
SHUFFLE, RANDOM, BERNOULLI = 7, 8, 9  # seeding purposes
AverageOver = Literal["trainers", "all"]

WorkShare = Callable[[int, np.ndarray], np.ndarray]
"""(round, the members' client numbers) -> each member's share of the full model's work."""

PlanSlice = Callable[[Slicing, dict[str, torch.Size], float, int, int, int], SubmodelSlice]
"""A scheme's slice for a client of capacity < 1: (slicing, the dense parameters' shapes,
capacity, round, seed, client) -> the slice it trains."""


@dataclass(frozen=True)
class MaskingSchemeSpec:
    """A masking scheme: its name, how its own paper averages the slices (``average``: over
    the clients that trained an entry, ``"trainers"``, or over all the round's clients with the
    untrained entries at their old value, ``"all"``), and how it plans a client's slice."""

    name: str
    average: AverageOver
    plan: PlanSlice


@dataclass(frozen=True)
class Masking:
    """``masking.scheme`` and its companions: scheme, capacities, how slices are averaged
    (see fedsub.masking.aggregate; None: the scheme's own paper's rule, ``PAPER_AVERAGE``)."""

    scheme: MaskingScheme = "none"
    capacities: Capacities = field(default_factory=Capacities)
    average_over: AverageOver | None = None

    @property
    def aggregation(self) -> AverageOver:
        """How the round's slices are averaged: the one chosen, else the scheme's paper's."""
        return self.average_over or SCHEMES[self.scheme].average

    def work_share(self, seed: int, num_clients: int) -> WorkShare | None:
        """The share of the full model's work and bytes of a member of capacity beta in round
        r (the virtual clock scales its time by it; None: the full model, scheme ``none``):
        beta^2 for channel slices (a width-beta slice keeps about beta^2 of a layer's weights,
        and of its multiply-adds), beta for ``bernoulli``'s coordinate masks (fedsub's
        approximation: first and last layers shrink by beta only)."""
        if self.scheme == "none":
            return None
        power = 1.0 if self.scheme == "bernoulli" else 2.0

        def share(round_index: int, clients: np.ndarray) -> np.ndarray:
            beta = self.capacities.of(seed, round_index, clients, num_clients)
            return np.asarray(beta, dtype=np.float64) ** power

        return share


def shuffled_piece(seed: int, round_index: int, pieces: int) -> int:
    """The piece trained in round ``round_index`` when an epoch is ``pieces`` rounds long."""
    epoch, position = divmod(round_index - 1, pieces)
    return int(seeding.rng(seed, SHUFFLE, epoch, pieces).permutation(pieces)[position])


ChooseChannels = Callable[[int, int, int, int, int, int], np.ndarray]
"""A channel scheme's choice: (channels in the group, kept L < C, round, seed, client, the
group's number) -> the sorted kept channels."""


def static_channels(count: int, kept: int, round_index: int, seed: int, client: int, group: int):
    return np.arange(kept)


def rolling_channels(count: int, kept: int, round_index: int, seed: int, client: int, group: int):
    return np.sort((round_index - 1 + np.arange(kept)) % count)


def shuffled_channels(
    count: int, kept: int, round_index: int, seed: int, client: int, group: int
) -> np.ndarray:
    pieces = math.ceil(count / kept)
    start = shuffled_piece(seed, round_index, pieces) * kept
    return np.sort((start + np.arange(kept)) % count)


def random_channels(count: int, kept: int, round_index: int, seed: int, client: int, group: int):
    generator = seeding.rng(seed, RANDOM, round_index, client, group)
    return np.sort(generator.choice(count, size=kept, replace=False))


def channel_scheme(name: str, average: AverageOver, choose: ChooseChannels) -> MaskingSchemeSpec:
    """A scheme that keeps L = ceil(beta * C) channels of each group, chosen by ``choose``
    (every channel when L = C)."""

    def plan_channels(
        slicing: Slicing,
        shapes: dict[str, torch.Size],
        capacity: float,
        round_index: int,
        seed: int,
        client: int,
    ) -> SubmodelSlice:
        kept = slicing.kept(capacity)
        selected = {
            name: torch.from_numpy(
                np.arange(kept[name])
                if kept[name] == count
                else choose(count, kept[name], round_index, seed, client, position)
            )
            for position, (name, count) in enumerate(slicing.groups.items())
        }
        return ChannelSlice(slicing, selected, capacity)

    return MaskingSchemeSpec(name, average, plan_channels)


def channels(
    scheme: MaskingScheme,
    channel_count: int,
    kept: int,
    round_index: int,
    seed: int,
    client: int,
    group: int,
) -> np.ndarray:
    """Sorted channel indices of one group (``group`` numbers the group, for ``random``)."""
    choose = CHANNEL_CHOICES.get(scheme)
    if choose is None:
        raise ValueError(f"masking {scheme!r} does not select channels")
    if kept == channel_count:
        return np.arange(kept)
    return choose(channel_count, kept, round_index, seed, client, group)


def bernoulli_mask(
    shapes: dict[str, torch.Size], p: float, seed: int, round_index: int, client: int
) -> CoordinateMask:
    generator = seeding.rng(seed, BERNOULLI, round_index, client)
    masks = {n: torch.from_numpy(generator.random(tuple(s)) < p) for n, s in shapes.items()}
    return CoordinateMask(masks, p)


def full_model(
    slicing: Slicing,
    shapes: dict[str, torch.Size],
    capacity: float,
    round_index: int,
    seed: int,
    client: int,
) -> SubmodelSlice:
    return full_slice(slicing)


def bernoulli_plan(
    slicing: Slicing,
    shapes: dict[str, torch.Size],
    capacity: float,
    round_index: int,
    seed: int,
    client: int,
) -> SubmodelSlice:
    return bernoulli_mask(shapes, capacity, seed, round_index, client)


# Each scheme's own paper's aggregation: seed 003's Algorithms 1 (Bernoulli) and 2 (shuffled)
# fill a client's untrained entries with the old value and average over all the round's
# clients; HeteroFL (static) and FedRolex (rolling), and fedsub's channel-level random masking,
# average each entry over the clients that trained it (their public code).
CHANNEL_CHOICES: dict[str, ChooseChannels] = {
    "static": static_channels,
    "rolling": rolling_channels,
    "shuffled": shuffled_channels,
    "random": random_channels,
}
SCHEMES: Registry[MaskingSchemeSpec] = Registry(
    "masking scheme",
    {
        "none": MaskingSchemeSpec("none", "trainers", full_model),
        "static": channel_scheme("static", "trainers", static_channels),
        "rolling": channel_scheme("rolling", "trainers", rolling_channels),
        "shuffled": channel_scheme("shuffled", "all", shuffled_channels),
        "random": channel_scheme("random", "trainers", random_channels),
        "bernoulli": MaskingSchemeSpec("bernoulli", "all", bernoulli_plan),
    },
    MaskingSchemeSpec,
    lambda spec: spec.name,
)
"""Every masking scheme by name (``masking.scheme``): the built-in ones, then plugins'."""


def plan(
    scheme: MaskingScheme,
    slicing: Slicing,
    shapes: dict[str, torch.Size],
    capacity: float,
    round_index: int,
    seed: int,
    client: int,
) -> SubmodelSlice:
    """The slice client ``client`` of capacity ``capacity`` trains in round ``round_index``."""
    if capacity >= 1.0:
        return full_slice(slicing)
    spec = SCHEMES.get_or_refuse(scheme)
    return spec.plan(slicing, shapes, capacity, round_index, seed, client)
