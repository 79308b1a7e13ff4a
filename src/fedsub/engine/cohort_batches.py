"""A round's training data for a whole cohort, gathered with torch ops on the run's device.

For K members running ``steps`` local steps of ``batch`` samples each, everything the batched
backend feeds the model: the members' S(k) rows (concatenated, member after member), every
visited sample's ids rewritten as positions in those concatenated rows, labels and dense
features, step-major (step i is samples ``i * K * B : (i + 1) * K * B``). Only the cohort's
clients come from the host (the seeded draw); the rest reads ``DeviceData``.

Host syncs: the sizes of the schedules and of the members' rows are known on the host from
the clients' ids (``DeviceData.host``); how many ids the round's visited samples hold is not,
nor how many distinct rows the members share, so each field's per-step id counts and each
table's union size (``PendingUnion``, for the aggregation) are computed on the device and read
together: the one host read of ``cohort_batches`` (on the CPU the step bounds come from the
taken ids' offsets, and RowUnion finds the unions later).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from fedsub import device as device_lib
from fedsub.algorithms.aggregation import PendingUnion
from fedsub.data.torch_ragged import TorchRagged
from fedsub.engine.shuffle import cohort_schedules
from fedsub.submodel.device_data import DeviceData


@dataclass(frozen=True)
class CohortBatches:
    clients: torch.Tensor  # [K] int64
    counts: torch.Tensor  # [K] the members' sample counts w_k (int64)
    rows: dict[str, TorchRagged]  # per table, over members: S(c_j), global row ids
    row_owner: dict[str, torch.Tensor]  # per table, the member owning each of those rows
    ids: dict[str, TorchRagged]  # per field, over the steps * K * B visits: cohort row positions
    labels: torch.Tensor  # [steps, K, B]
    dense: torch.Tensor | None  # [steps, K, B, d]
    step_bounds: dict[str, list[int]]  # per field, where each step's ids start (steps + 1)
    # per field, for each id, which of its step's K * B samples it is in (closed-form models)
    sample_of_id: dict[str, torch.Tensor] | None = None
    # per table, the union of the members' rows as torch.unique(..., return_inverse=True)
    # gives it; computed here off the CPU, where it costs no host read of its own
    unions: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def samples_per_step(self) -> int:
        return self.labels.shape[1] * self.labels.shape[2]

    def step_ids(self, step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Step ``step``'s ids per field as (values, offsets) of its K * B samples."""
        per_step, ids = self.samples_per_step, {}
        for name, ragged in self.ids.items():
            a, b = self.step_bounds[name][step], self.step_bounds[name][step + 1]
            offsets = ragged.offsets[step * per_step : (step + 1) * per_step + 1] - a
            ids[name] = (ragged.values[a:b], offsets)
        return ids

    def samples_by_step(self) -> list[dict[str, torch.Tensor]]:
        """Per step, for each of its ids, which of the step's K * B samples it is in."""
        if self.sample_of_id is None:
            raise ValueError("cohort_batches(..., sample_of_id=True) gives each id's sample")
        return self.by_step(self.sample_of_id)

    def by_step(self, per_id: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Per step, each field's slice of ``per_id`` (one value per id, all steps): one
        split per field, not a slice per field and step (a sparse model's step is short
        enough for that to show)."""
        steps = self.labels.shape[0]
        pieces = {}
        for name, values in per_id.items():
            bounds = self.step_bounds[name]
            pieces[name] = values.split([b - a for a, b in itertools.pairwise(bounds)])
        return [{n: parts[step] for n, parts in pieces.items()} for step in range(steps)]

    def ids_values(self) -> dict[str, torch.Tensor]:
        return {n: r.values for n, r in self.ids.items()}


def cohort_batches(
    data: DeviceData,
    clients: torch.Tensor,
    seed: int,
    round_index: int,
    steps: int,
    batch: int,
    sample_of_id: bool = False,
    host_clients: np.ndarray | None = None,
) -> CohortBatches:
    """The cohort's rows and batches (``clients`` int64 on ``data.device``); each member's
    sample order is ``cohort_schedules`` of (seed, round, client), as on every backend.
    ``sample_of_id``: also say which sample of its step every id belongs to.
    ``host_clients``: the same clients as a numpy array (the draw's), else read from
    ``clients``."""
    k = len(clients)
    if host_clients is None:
        host_clients = clients.cpu().numpy()
    counts = data.counts.index_select(0, clients)
    rows, row_owner = _member_rows(data, clients, host_clients)
    visits = _visits(data, clients, counts, host_clients, (seed, round_index), steps, batch)
    per_step = k * batch
    member_of_visit, in_step = _visit_layout(k, steps, batch, data.device)
    on_host = device_lib.on_host(clients)
    # Off the CPU: the rows' union for the aggregation (on the CPU RowUnion's slot array is
    # faster), and the steps' id bounds read before the take (which then needs no read). On
    # the CPU the take computes the ids' offsets anyway: each step starts at every
    # ``per_step``-th of them.
    step_bounds: dict[str, list[int]] = {}
    unions: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if not on_host:
        step_bounds, unions = _bounds_and_unions(data, rows, visits, steps, per_step)
    ids, samples = {}, {}
    for name, local_ids in data.local_ids.items():
        total = None if on_host else step_bounds[name][-1]
        local, visit_of_id = local_ids.take_with_owners(visits, total)
        if on_host:
            step_bounds[name] = _step_starts(local.offsets, steps, per_step)
        row_start = rows[data.field_tables[name]].offsets[:-1].index_select(0, member_of_visit)
        ids[name] = TorchRagged(
            local.values + row_start.index_select(0, visit_of_id), local.offsets
        )
        if sample_of_id:
            samples[name] = in_step.index_select(0, visit_of_id)
    labels, dense = _labels_and_dense(data, visits, steps, k, batch)
    return CohortBatches(
        clients=clients,
        counts=counts,
        rows=rows,
        row_owner=row_owner,
        ids=ids,
        labels=labels,
        dense=dense,
        step_bounds=step_bounds,
        sample_of_id=samples if sample_of_id else None,
        unions=unions or None,
    )


def _visits(
    data: DeviceData,
    clients: torch.Tensor,
    counts: torch.Tensor,
    host_clients: np.ndarray,
    draw: tuple[int, int],
    steps: int,
    batch: int,
) -> torch.Tensor:
    """The samples the members visit, as positions among all training samples, step-major
    ([steps, K, B] flattened); each member's order is ``cohort_schedules`` of (seed, round,
    client), ``draw`` the (seed, round)."""
    seed, round_index = draw
    local_order = cohort_schedules(
        seed, round_index, clients, counts, steps, batch, data.host.samples[host_clients]
    )
    visits = local_order + data.client_offsets.index_select(0, clients)[:, None, None]
    return visits.transpose(0, 1).reshape(-1)


def _labels_and_dense(
    data: DeviceData, visits: torch.Tensor, steps: int, k: int, batch: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The visited samples' labels [steps, K, B] and dense features [steps, K, B, d]."""
    labels = data.labels.index_select(0, visits).reshape(steps, k, batch)
    if data.dense is None:
        return labels, None
    return labels, data.dense.index_select(0, visits).reshape(steps, k, batch, -1)


def _member_rows(
    data: DeviceData, clients: torch.Tensor, host_clients: np.ndarray
) -> tuple[dict[str, TorchRagged], dict[str, torch.Tensor]]:
    """Per table the members' S(k) rows, member after member, and each row's member; sized
    from the host's |S(k)| (no device read)."""
    rows, row_owner = {}, {}
    for table, all_rows in data.rows.items():
        total_rows = int(data.host.rows[table][host_clients].sum())
        rows[table], row_owner[table] = all_rows.take_with_owners(clients, total_rows)
    return rows, row_owner


def _bounds_and_unions(
    data: DeviceData,
    rows: dict[str, TorchRagged],
    visits: torch.Tensor,
    steps: int,
    per_step: int,
) -> tuple[dict[str, list[int]], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Off the CPU: each field's step bounds and each table's union of the members' rows,
    their sizes read from the device together (the round's one host read)."""
    pending = {t: PendingUnion(r.values) for t, r in rows.items()}
    step_bounds, union_sizes = _read_sizes(data, visits, steps, per_step, pending)
    return step_bounds, {t: u.finish(union_sizes[t]) for t, u in pending.items()}


def _step_starts(offsets: torch.Tensor, steps: int, per_step: int) -> list[int]:
    """Where each step's ids start (and the last ends), from the visited samples' offsets."""
    if per_step == 0:
        return [0] * (steps + 1)
    return offsets[::per_step].tolist()


def _read_sizes(
    data: DeviceData,
    visits: torch.Tensor,
    steps: int,
    per_step: int,
    unions: dict[str, PendingUnion],
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Per field, where each step's ids start among the visited samples' ids (steps + 1
    values, the last the field's total), and per table the size of the rows' union: computed
    on the device, read in one transfer (the round's one read here)."""
    per_field = []
    for local_ids in data.local_ids.values():
        offsets = local_ids.offsets
        lengths = offsets.index_select(0, visits + 1) - offsets.index_select(0, visits)
        ends = lengths.reshape(steps, per_step).sum(1).cumsum(0)
        per_field.append(torch.cat([torch.zeros_like(ends[:1]), ends]))
    sizes = [u.size.reshape(1) for u in unions.values()]
    if not per_field and not sizes:
        return {}, {}
    values = torch.cat([*per_field, *sizes]).tolist()  # the one read
    width = steps + 1
    bounds = {n: values[i * width : (i + 1) * width] for i, n in enumerate(data.local_ids)}
    tail = values[len(per_field) * width :]
    return bounds, dict(zip(unions, tail, strict=True))


@functools.lru_cache(maxsize=8)
def _visit_layout(
    k: int, steps: int, batch: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the step-major visits [steps, K, B]: each visit's member and its sample's position
    in its step. The same every round of a run, so built once (never written to)."""
    member = torch.arange(k, device=device).repeat_interleave(batch).repeat(steps)
    in_step = torch.arange(k * batch, device=device).repeat(steps)
    return member, in_step
