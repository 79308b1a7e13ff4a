"""Averaging the slices of a round back into the full model (seed 003, HeteroFL, FedRolex).

With ``a_j`` the members' aggregation weights (sample-weighted or uniform, as for FedAvg) and
``m_j`` the indicator of the entries member j trained::

    trainers:  delta[e] = sum_j a_j m_j[e] delta_j[e] / sum_j a_j m_j[e]  (0 if no one trained e)
    all:       delta[e] = sum_j a_j m_j[e] delta_j[e] / sum_j a_j

``trainers`` is HeteroFL / FedRolex's per-entry mean; ``all`` is seed 003's Algorithms 1-2
(untrained entries count as the old value in a mean over every client). Either way an entry no
client trained keeps its value. Members that trained the same slice are summed first, then
scattered into the full shapes once: one full-size accumulator per round, never one per client.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedsub.algorithms.aggregation import ServerUpdate
from fedsub.masking.schemes import AverageOver
from fedsub.models.width import CoordinateMask, SubmodelSlice
from fedsub.submodel.transfer import CohortUpdate


@dataclass(frozen=True)
class SliceGroup:
    """Cohort members (positions) that trained one slice, and their sub-shaped deltas."""

    members: list[int]
    slice: SubmodelSlice
    update: CohortUpdate


@dataclass(frozen=True)
class MaskedCohortUpdate:
    """A round's slices; ``clients``, ``weights`` and ``multiplicity`` in cohort order."""

    clients: torch.Tensor
    weights: torch.Tensor
    multiplicity: torch.Tensor
    groups: list[SliceGroup]

    def __len__(self) -> int:
        return len(self.clients)

    def squared_norms(self) -> torch.Tensor:
        norms = torch.zeros(len(self), dtype=torch.float64, device=self.clients.device)
        for group in self.groups:
            norms[group.members] = group.update.squared_norms()
        return norms

    def nonfinite(self) -> torch.Tensor:
        """A 0-d bool tensor: whether any member's slice holds NaN or Inf (no host read)."""
        flags = [group.update.nonfinite() for group in self.groups]
        if not flags:
            return torch.tensor(False, device=self.clients.device)
        return torch.stack(flags).any()

    def select(self, members: list[int]) -> MaskedCohortUpdate:
        """The updates of a subset of the members, renumbered in the given order."""
        position = {old: new for new, old in enumerate(members)}
        groups = []
        for group in self.groups:
            keep = [i for i, j in enumerate(group.members) if j in position]
            if keep:
                renumbered = [position[group.members[i]] for i in keep]
                groups.append(SliceGroup(renumbered, group.slice, group.update.select(keep)))
        index = torch.tensor(members, dtype=torch.int64, device=self.clients.device)
        return MaskedCohortUpdate(
            self.clients[index], self.weights[index], self.multiplicity[index], groups
        )


def aggregate_slices(
    update: MaskedCohortUpdate,
    weights: torch.Tensor,
    like: dict[str, torch.Tensor],
    average_over: AverageOver = "trainers",
) -> ServerUpdate:
    """The server's dense update from a round's slices; ``weights`` are the members' a_j."""
    total = {n: torch.zeros_like(p) for n, p in like.items()}
    trained = {n: torch.zeros_like(p) for n, p in like.items()}
    for group in update.groups:
        a = weights[group.members]
        summed = {
            n: (a.to(d.dtype).reshape(-1, *([1] * (d.dim() - 1))) * d).sum(0)
            for n, d in group.update.dense_deltas.items()
        }
        group.slice.add(total, summed)
        group.slice.add_constant(trained, a.sum())  # a 0-d tensor: no read on the host
    if average_over == "all":
        scale = weights.sum()
        return ServerUpdate({}, {n: t / scale.to(t.dtype) for n, t in total.items()})
    if average_over != "trainers":
        raise ValueError(f"unknown average_over {average_over!r}")
    means = {}
    for n, t in total.items():
        weight = trained[n].clamp_min(torch.finfo(t.dtype).tiny)
        means[n] = torch.where(trained[n] > 0, t / weight, 0.0)
    return ServerUpdate({}, means)


def masked_deltas(mask: CoordinateMask, deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked deltas [K, ...] with the entries outside the mask zeroed."""
    return {n: d * mask.masks[n].to(d.dtype) for n, d in deltas.items()}
