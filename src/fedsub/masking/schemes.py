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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from fedsub.masking.capacity import Capacities
from fedsub.models.width import ChannelSlice, CoordinateMask, Slicing, SubmodelSlice, full_slice
from fedsub.numerics import seeding

MaskingScheme = Literal["none", "static", "rolling", "shuffled", "random", "bernoulli"]
SCHEMES: tuple[str, ...] = ("none", "static", "rolling", "shuffled", "random", "bernoulli")
SHUFFLE, RANDOM, BERNOULLI = 7, 8, 9  # seeding purposes
AverageOver = Literal["trainers", "all"]
# Each scheme's own paper's aggregation: seed 003's Algorithms 1 (Bernoulli) and 2 (shuffled)
# fill a client's untrained entries with the old value and average over all the round's
# clients; HeteroFL (static) and FedRolex (rolling), and fedsub's channel-level random masking,
# average each entry over the clients that trained it (their public code).
PAPER_AVERAGE: dict[str, AverageOver] = {
    "none": "trainers",
    "static": "trainers",
    "rolling": "trainers",
    "random": "trainers",
    "shuffled": "all",
    "bernoulli": "all",
}


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
        return self.average_over or PAPER_AVERAGE[self.scheme]


def shuffled_piece(seed: int, round_index: int, pieces: int) -> int:
    """The piece trained in round ``round_index`` when an epoch is ``pieces`` rounds long."""
    epoch, position = divmod(round_index - 1, pieces)
    return int(seeding.rng(seed, SHUFFLE, epoch, pieces).permutation(pieces)[position])


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
    if scheme == "static" or kept == channel_count:
        return np.arange(kept)
    if scheme == "rolling":
        return np.sort((round_index - 1 + np.arange(kept)) % channel_count)
    if scheme == "shuffled":
        pieces = math.ceil(channel_count / kept)
        start = shuffled_piece(seed, round_index, pieces) * kept
        return np.sort((start + np.arange(kept)) % channel_count)
    if scheme == "random":
        generator = seeding.rng(seed, RANDOM, round_index, client, group)
        return np.sort(generator.choice(channel_count, size=kept, replace=False))
    raise ValueError(f"masking {scheme!r} does not select channels")


def bernoulli_mask(
    shapes: dict[str, torch.Size], p: float, seed: int, round_index: int, client: int
) -> CoordinateMask:
    generator = seeding.rng(seed, BERNOULLI, round_index, client)
    masks = {n: torch.from_numpy(generator.random(tuple(s)) < p) for n, s in shapes.items()}
    return CoordinateMask(masks, p)


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
    if scheme == "none" or capacity >= 1.0:
        return full_slice(slicing)
    if scheme == "bernoulli":
        return bernoulli_mask(shapes, capacity, seed, round_index, client)
    kept = slicing.kept(capacity)
    selected = {
        name: torch.from_numpy(
            channels(scheme, count, kept[name], round_index, seed, client, position)
        )
        for position, (name, count) in enumerate(slicing.groups.items())
    }
    return ChannelSlice(slicing, selected, capacity)
