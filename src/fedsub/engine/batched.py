"""The batched backend: the whole cohort takes each local step together, as one program.

Layout of a round with K clients (positions j = 0..K-1)::

    table rows   [ S(c_0) rows | S(c_1) rows | ... | S(c_K-1) rows ]   one leaf tensor
    ids of c_j   positions in S(c_j) + row offset of block j            one embedding call
    dense        [K, *shape] per dense parameter                         vmap over clients
    samples      step i: [K, B] (every client runs I steps of B samples)

The clients' parameters are disjoint and the loss is the sum of the K per-client batch means,
so one backward pass gives every client exactly the gradient it would compute alone. A model
with ``cohort_gradients`` (sparse LR) gives those gradients in closed form, without autograd.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.func import vmap

from fedsub.algorithms.sampling import Cohort
from fedsub.client.layout import CohortLayout
from fedsub.client.transforms import Members, apply_updates
from fedsub.client.work import CohortWork
from fedsub.data.federated import FederatedDataset
from fedsub.data.ragged import Ragged
from fedsub.engine.schedule import Schedule
from fedsub.engine.shuffle import cohort_schedules
from fedsub.models.base import ClosedFormGradients, CohortHead, Model
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import CohortUpdate


def _per_client(tensor: torch.Tensor, k: int) -> torch.Tensor:
    """[K * B, ...] -> [K, B, ...]."""
    return tensor.reshape(k, -1, *tensor.shape[1:])


def run_cohort(
    model: Model,
    global_params: Params,
    dataset: FederatedDataset,
    index: SubmodelIndex,
    members: Cohort,
    round_index: int,
    schedule: Schedule,
    work: CohortWork,
) -> CohortUpdate:
    cohort = members.clients
    k, steps, batch = len(cohort), schedule.local_steps, schedule.batch_size
    counts = dataset.sample_counts()[cohort]

    # Pull: every member's rows, concatenated; dense parameters stacked on a client axis.
    rows: dict[str, Ragged] = {t: index.rows[t].take(cohort) for t in dataset.table_rows}
    row_tensors = {t: torch.from_numpy(r.values) for t, r in rows.items()}
    pulled_tables = {t: global_params.tables[t].index_select(0, row_tensors[t]) for t in rows}
    pulled_dense = {
        n: p.unsqueeze(0).expand(k, *p.shape).clone() for n, p in global_params.dense.items()
    }

    # Every sample the cohort will visit, step-major: [steps, K, B] global sample indices.
    local_order = cohort_schedules(
        schedule.seed, round_index, cohort, counts, steps, batch
    )  # [K, steps, B]
    visits = (local_order + dataset.client_offsets[cohort][:, None, None]).transpose(1, 0, 2)
    visits = visits.reshape(-1)
    member_of_visit = np.tile(np.repeat(np.arange(k), batch), steps)
    ids: dict[str, Ragged] = {}
    for name, ragged in dataset.train.ids.items():
        local = Ragged(index.local_ids[name], ragged.offsets).take(visits)
        table_offsets = rows[dataset.table_of(name)].offsets
        shift = np.repeat(table_offsets[:-1][member_of_visit], local.lengths())
        ids[name] = Ragged(local.values + shift, local.offsets)
    labels = torch.from_numpy(dataset.train.labels[visits]).to(schedule.dtype)
    labels = labels.reshape(steps, k, batch)
    dense_inputs = None
    if dataset.train.dense is not None:
        dense_inputs = torch.from_numpy(dataset.train.dense[visits]).to(schedule.dtype)
        dense_inputs = dense_inputs.reshape(steps, k, batch, -1)

    # A model may provide ``cohort_head`` (dense [K, ...], features [K, B, ...]) written with
    # batched matmuls; otherwise its per-client head is vmapped over the client axis.
    if isinstance(model, CohortHead):
        head = model.cohort_head
    else:
        head = vmap(model.head, in_dims=(0, 0, None if dense_inputs is None else 0))
    tables = {t: v.clone().requires_grad_(True) for t, v in pulled_tables.items()}
    dense = {n: v.clone().requires_grad_(True) for n, v in pulled_dense.items()}
    leaves = [*tables.values(), *dense.values()]
    row_owner = {t: torch.from_numpy(np.repeat(np.arange(k), r.lengths())) for t, r in rows.items()}
    # The client transforms run on all members at once: the layout gives per-member norms
    # and learning rates (fedsub.client.layout).
    layout = CohortLayout((*(row_owner[t] for t in tables), *(None for _ in dense)), k)
    corrections = None
    if work.corrections is not None:
        corrections = [*work.corrections.tables.values(), *work.corrections.dense.values()]
    rule_inputs = Members(layout, work.lr, corrections)
    with torch.no_grad():
        state = work.chain.init(leaves, rule_inputs)
    # A model may give its cohort gradients in closed form (``cohort_gradients``); otherwise
    # autograd differentiates embed -> head -> loss.
    closed_form = model.cohort_gradients if isinstance(model, ClosedFormGradients) else None
    per_step = k * batch
    id_tensors = {
        n: (torch.from_numpy(r.values), torch.from_numpy(r.offsets)) for n, r in ids.items()
    }
    step_bounds = {n: r.offsets[::per_step].tolist() for n, r in ids.items()}  # per step
    if closed_form is not None:  # for each id, which of its step's K * B samples it is in
        sample_of_id = {
            n: torch.from_numpy(np.repeat(np.arange(len(r)) % per_step, r.lengths()))
            for n, r in ids.items()
        }
    for step in range(steps):
        spans = {n: (bounds[step], bounds[step + 1]) for n, bounds in step_bounds.items()}
        step_values = {n: id_tensors[n][0][a:b] for n, (a, b) in spans.items()}
        step_inputs = None if dense_inputs is None else dense_inputs[step]
        if closed_form is not None:
            step_samples = {n: sample_of_id[n][a:b] for n, (a, b) in spans.items()}
            with torch.no_grad():
                table_grads, dense_grads = closed_form(
                    tables, dense, step_values, step_samples, step_inputs, labels[step]
                )
            grads = [*(table_grads[t] for t in tables), *(dense_grads[n] for n in dense)]
        else:
            step_ids = {
                n: (values, id_tensors[n][1][step * per_step : (step + 1) * per_step + 1] - a)
                for (n, values), (a, _) in zip(step_values.items(), spans.values(), strict=True)
            }
            features = {n: _per_client(f, k) for n, f in model.embed(tables, step_ids).items()}
            outputs = head(dense, features, step_inputs)
            # The loss is a mean over samples, and every client has B of them: K times the
            # mean over the cohort's K * B samples is the sum of the K client means.
            flat = outputs.reshape(k * batch, *outputs.shape[2:])
            total = model.loss(flat, labels[step].reshape(-1)) * k
            grads = list(torch.autograd.grad(total, leaves))
        with torch.no_grad():
            updates, state = work.chain.update(grads, state, leaves, rule_inputs)
            apply_updates(leaves, updates)

    with torch.no_grad():
        return CohortUpdate(
            clients=torch.from_numpy(cohort),
            weights=torch.from_numpy(counts.astype(np.float64)),
            multiplicity=torch.from_numpy(members.multiplicity),
            rows=row_tensors,
            row_owner=row_owner,
            table_deltas={t: tables[t].detach() - pulled_tables[t] for t in tables},
            dense_deltas={n: dense[n].detach() - pulled_dense[n] for n in dense},
        )
