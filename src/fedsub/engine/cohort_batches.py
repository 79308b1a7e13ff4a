"""A round's training data for a whole cohort, gathered with torch ops on the run's device.

For K members running ``steps`` local steps of ``batch`` samples each, everything the batched
backend feeds the model: the members' S(k) rows (concatenated, member after member), every
visited sample's ids rewritten as positions in those concatenated rows, labels and dense
features, step-major (step i is samples ``i * K * B : (i + 1) * K * B``). Only the cohort's
clients come from the host (the seeded draw); the rest reads ``DeviceData``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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

    def step_values(self, step: int) -> dict[str, torch.Tensor]:
        """Step ``step``'s ids per field, values only."""
        return self._step_slices(self.ids_values(), step)

    def step_samples(self, step: int) -> dict[str, torch.Tensor]:
        """For each of step ``step``'s ids, which of the step's K * B samples it is in."""
        if self.sample_of_id is None:
            raise ValueError("cohort_batches(..., sample_of_id=True) gives each id's sample")
        return self._step_slices(self.sample_of_id, step)

    def ids_values(self) -> dict[str, torch.Tensor]:
        return {n: r.values for n, r in self.ids.items()}

    def _step_slices(self, per_id: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        return {
            n: v[self.step_bounds[n][step] : self.step_bounds[n][step + 1]]
            for n, v in per_id.items()
        }


def cohort_batches(
    data: DeviceData,
    clients: torch.Tensor,
    seed: int,
    round_index: int,
    steps: int,
    batch: int,
    sample_of_id: bool = False,
) -> CohortBatches:
    """The cohort's rows and batches (``clients`` int64 on ``data.device``); each member's
    sample order is ``cohort_schedules`` of (seed, round, client), as on every backend.
    ``sample_of_id``: also say which sample of its step every id belongs to."""
    k, device = len(clients), data.device
    counts = data.counts.index_select(0, clients)
    rows = {t: r.take(clients) for t, r in data.rows.items()}
    local_order = cohort_schedules(seed, round_index, clients, counts, steps, batch)
    visits = local_order + data.client_offsets.index_select(0, clients)[:, None, None]
    visits = visits.transpose(0, 1).reshape(-1)  # step-major: [steps, K, B]
    member_of_visit = torch.arange(k, device=device).repeat_interleave(batch).repeat(steps)
    ids = {}
    for name, local_ids in data.local_ids.items():
        local = local_ids.take(visits)
        row_start = rows[data.field_tables[name]].offsets[:-1].index_select(0, member_of_visit)
        shift = torch.repeat_interleave(row_start, local.lengths(), output_size=len(local.values))
        ids[name] = TorchRagged(local.values + shift, local.offsets)
    per_step = k * batch
    labels = data.labels.index_select(0, visits).reshape(steps, k, batch)
    dense = None
    if data.dense is not None:
        dense = data.dense.index_select(0, visits).reshape(steps, k, batch, -1)
    return CohortBatches(
        clients=clients,
        counts=counts,
        rows=rows,
        row_owner={t: r.owners() for t, r in rows.items()},
        ids=ids,
        labels=labels,
        dense=dense,
        step_bounds={n: r.offsets[::per_step].tolist() for n, r in ids.items()},
        sample_of_id=_sample_of_id(ids, per_step, steps) if sample_of_id else None,
    )


def _sample_of_id(
    ids: dict[str, TorchRagged], per_step: int, steps: int
) -> dict[str, torch.Tensor]:
    """Per field, for each id, its sample's position in its step (0 .. K * B - 1)."""
    result = {}
    for name, ragged in ids.items():
        in_step = torch.arange(per_step, device=ragged.offsets.device).repeat(steps)
        result[name] = torch.repeat_interleave(
            in_step, ragged.lengths(), output_size=len(ragged.values)
        )
    return result
