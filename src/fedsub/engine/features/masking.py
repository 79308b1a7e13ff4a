"""Width-slice masking as a feature: each member trains the slice its capacity and the masking
scheme give it (``run_cohort``, the client stage), and the round aggregates the slices
(masking/aggregate.py, the combine).

Members that train the same slice (equal capacity under static, rolling and shuffled masking)
form one group and run as one cohort of the inner backend, on a model narrowed to that slice;
random and Bernoulli slices are per member. The client transforms, the batch schedule of each client
and the aggregation weights are exactly those of full-model training.

Device-generic: the slices are drawn on the host from the run's seed (a few channel indices
per group, or a Bernoulli mask, with the same numbers on every device, like the cohort draw)
and moved once to ``schedule.execution.device``; extraction, training and aggregation run there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import torch

from fedsub.algorithms.aggregation import Aggregation, ServerUpdate, aggregation_weights
from fedsub.engine.cohort_job import CohortJob, RunCohort, Stage
from fedsub.engine.contribution import (
    Combine,
    Combining,
    Feature,
    RoundContribution,
    RoundSetup,
    taking,
)
from fedsub.masking.aggregate import (
    MaskedCohortUpdate,
    SliceGroup,
    aggregate_slices,
    masked_deltas,
)
from fedsub.masking.schemes import Masking, plan
from fedsub.models.base import Features, Ids, Model, SliceableModel, Task
from fedsub.models.width import CoordinateMask
from fedsub.submodel.params import Params

NAME = "masking"


def contribute(setup: RoundSetup) -> RoundContribution | None:
    masking, params = setup.schedule.setting(Masking), setup.params
    stage = on_slices(masking)
    if stage is None or masking is None or params is None:
        return None
    dense = params.dense

    def combine(aggregation: Aggregation) -> Combine:
        def combined(update: MaskedCohortUpdate) -> ServerUpdate:
            weights = aggregation_weights(update, aggregation)
            return aggregate_slices(update, weights, dense, masking.aggregation)

        return taking(MaskedCohortUpdate, combined)

    return RoundContribution(NAME, client_stage=stage, combining=Combining(combine=combine))


FEATURE = Feature(NAME, contribute)


@dataclass(frozen=True)
class MaskedForward:
    """A model evaluated at ``mask * x`` (Bernoulli masking), so gradients vanish off the mask."""

    model: Model
    masks: dict[str, torch.Tensor]

    @property
    def task(self) -> Task:
        return self.model.task

    def init(self, generator: torch.Generator, dtype: torch.dtype) -> Params:
        return self.model.init(generator, dtype)

    def embed(self, tables: dict[str, torch.Tensor], ids: Ids) -> Features:
        return self.model.embed(tables, ids)

    def head(
        self, dense: dict[str, torch.Tensor], features: Features, dense_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        masked = {n: p * self.masks[n].to(p.dtype) for n, p in dense.items()}
        return self.model.head(masked, features, dense_inputs)

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model.loss(outputs, labels)


def on_slices(masking: Masking | None) -> Stage | None:
    """The stage that runs a round's members on their width slices (None: no masking)."""
    if masking is None or masking.scheme == "none":
        return None
    return lambda inner: functools.partial(run_cohort, masking=masking, inner=inner)


def run_cohort(job: CohortJob, masking: Masking, inner: RunCohort) -> MaskedCohortUpdate:
    """Each group of members sharing a slice run by ``inner`` on the model narrowed to it."""
    model, global_params, cohort, schedule = job.model, job.params, job.cohort, job.schedule
    round_index, dataset = job.round, job.dataset
    if not isinstance(model, SliceableModel):
        raise TypeError(
            f"sub-model masking needs a width-sliceable model (slicing, at_capacity); "
            f"{type(model).__name__} is not one"
        )
    slicing = model.slicing
    shapes = {n: p.shape for n, p in global_params.dense.items()}
    if masking.scheme == "none":
        capacities = np.ones(len(cohort))
    else:
        capacities = masking.capacities.of(
            schedule.seed, round_index, cohort.clients, dataset.num_clients
        )
    slices = [
        plan(masking.scheme, slicing, shapes, float(c), round_index, schedule.seed, int(k))
        for k, c in zip(cohort.clients, capacities, strict=True)
    ]
    by_slice: dict[tuple, list[int]] = {}
    for position, piece in enumerate(slices):
        by_slice.setdefault(piece.key(), []).append(position)

    device = schedule.execution.device
    groups = []
    for members in by_slice.values():
        piece = slices[members[0]].to(device)
        if isinstance(piece, CoordinateMask):
            narrowed: Model = MaskedForward(model, piece.masks)
        else:
            narrowed = model.at_capacity(piece.capacity)
        sub_params = Params({}, piece.extract(global_params.dense))
        update = inner(replace(job.of_members(members), model=narrowed, params=sub_params))
        if isinstance(piece, CoordinateMask):
            update.dense_deltas = masked_deltas(piece, update.dense_deltas)
        groups.append(SliceGroup(members, piece, update))
    counts = dataset.sample_counts()[cohort.clients]
    return MaskedCohortUpdate(
        clients=torch.from_numpy(cohort.clients).to(device),
        weights=torch.from_numpy(counts.astype(np.float64)).to(device),
        multiplicity=torch.from_numpy(cohort.multiplicity).to(device),
        groups=groups,
    )
