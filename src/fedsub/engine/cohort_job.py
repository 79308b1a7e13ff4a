"""One round's client work, as one frozen value: what a runtime is asked to do.

Every backend (batched, sequential), every stage wrapper (split across processes, masked
width slices, private rounds, host-resident tables) and every runtime (in process, Flower)
takes the same job and returns the cohort's update, so a wrapper is a function from a
``RunCohort`` to a ``RunCohort`` and the round loop never re-lists what a round needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from fedsub.algorithms.sampling import Cohort
from fedsub.client.work import CohortWork
from fedsub.data.federated import FederatedDataset
from fedsub.engine.schedule import Schedule
from fedsub.models.base import Model
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params


@dataclass(frozen=True)
class CohortJob:
    """The cohort's local work of round ``round``: each member of ``cohort`` trains its
    submodel of ``params`` (the global model, or the rows staged for this round) on its data,
    as ``work`` says (learning rate, client transforms, control variates)."""

    model: Model
    params: Params
    dataset: FederatedDataset
    index: SubmodelIndex
    cohort: Cohort
    round: int
    schedule: Schedule
    work: CohortWork

    def with_members(self, cohort: Cohort, params: Params | None = None) -> CohortJob:
        """The same job for another set of members (a process's share, a slice group)."""
        return replace(self, cohort=cohort, params=self.params if params is None else params)

    def of_members(self, members: list[int]) -> CohortJob:
        """The same job for the members at positions ``members`` of the cohort (their
        draws, learning rates and corrections)."""
        cohort = Cohort(self.cohort.clients[members], self.cohort.multiplicity[members])
        return replace(self, cohort=cohort, work=self.work.select(members))


RunCohort = Callable[[CohortJob], Any]
"""A cohort's work: a ``CohortJob`` in, the cohort's update out (a ``CohortUpdate``, or a
``MaskedCohortUpdate`` for width slices)."""

Stage = Callable[[RunCohort], RunCohort]
"""A stage of the round's client work: the work it is given, run its own way (split across
processes, on width slices, through the members' requests, on the rows staged on the device)."""


def composed(run_cohort: RunCohort, stages: Iterable[Stage | None]) -> RunCohort:
    """``run_cohort`` inside each of ``stages`` in turn (None: a stage this run does not use);
    the last stage given is the outermost, the one the round loop calls."""
    for stage in stages:
        if stage is not None:
            run_cohort = stage(run_cohort)
    return run_cohort
