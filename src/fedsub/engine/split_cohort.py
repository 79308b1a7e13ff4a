"""A round's client work split across processes (torchrun): the one place it is split.

Each member's update depends only on its own data, the global model and its keyed random
streams, never on the other members (tests/test_backends.py), so the cohort can be cut into
contiguous shares: process i runs its share through the configured backend, the shares are
gathered and concatenated in member order, and every process holds the cohort update one
process would have computed. Screening, aggregation, the server step and the control variates
then run identically everywhere (``ServerRound.server_step``), so the processes' models stay equal
without a broadcast, and the combination order never depends on timing.

Masked rounds work the same way: ``engine/features/masking.py`` calls the split backend once
per slice group, and each group is split in turn.
"""

from __future__ import annotations

import dataclasses

import torch

from fedsub import distributed
from fedsub.distributed import Processes
from fedsub.engine.cohort_job import CohortJob, RunCohort
from fedsub.submodel.transfer import CohortUpdate


def moved(update: CohortUpdate, device: torch.device | str, copy: bool = False) -> CohortUpdate:
    """``update`` with every tensor on ``device`` (``copy``: each a compact copy, so pickling
    a view never sends the whole buffer it views)."""

    def to(value):
        if isinstance(value, dict):
            return {k: v.to(device, copy=copy) for k, v in value.items()}
        return value.to(device, copy=copy)

    fields = {
        f.name: to(getattr(update, f.name))
        for f in dataclasses.fields(update)
        if f.name != "unions"  # one share's pending row union is not the cohort's: dropped
    }
    return CohortUpdate(**fields)


def concatenated(parts: list[CohortUpdate]) -> CohortUpdate:
    """The cohort update of consecutive shares of members, in the order given: exactly the
    layout one backend call on all of them gives (rows member after member)."""
    if len(parts) == 1:
        return parts[0]
    offsets = [0]
    for part in parts[:-1]:
        offsets.append(offsets[-1] + len(part))
    first = parts[0]
    return CohortUpdate(
        clients=torch.cat([p.clients for p in parts]),
        weights=torch.cat([p.weights for p in parts]),
        multiplicity=torch.cat([p.multiplicity for p in parts]),
        rows={t: torch.cat([p.rows[t] for p in parts]) for t in first.rows},
        row_owner={
            t: torch.cat([p.row_owner[t] + o for p, o in zip(parts, offsets, strict=True)])
            for t in first.row_owner
        },
        table_deltas={t: torch.cat([p.table_deltas[t] for p in parts]) for t in first.rows},
        dense_deltas={n: torch.cat([p.dense_deltas[n] for p in parts]) for n in first.dense_deltas},
    )


def run_share(run_cohort: RunCohort, share: range, job: CohortJob) -> CohortUpdate | None:
    """The updates of the cohort members at positions ``share`` (None for no member: a cohort
    smaller than the number of processes leaves some idle)."""
    if not len(share):
        return None
    return run_cohort(job.of_members(list(share)))


def split_cohort(run_cohort: RunCohort, processes: Processes) -> RunCohort:
    """``run_cohort`` with its members split across ``processes``: same job, same result, in
    every process."""

    def run_split(job: CohortJob) -> CohortUpdate:
        part = run_share(run_cohort, processes.share(len(job.cohort)), job)
        sent = None if part is None else moved(part, "cpu", copy=True)
        what = f"gathering round {job.round}'s client updates"
        parts = [p for p in distributed.all_gather(sent, what) if p is not None]
        return moved(concatenated(parts), job.schedule.execution.device)

    return run_split
