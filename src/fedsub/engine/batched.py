"""The batched backend: the whole cohort takes each local step together, as one program.

Layout of a round with K clients (positions j = 0..K-1)::

    table rows   [ S(c_0) rows | S(c_1) rows | ... | S(c_K-1) rows ]   one leaf tensor
    ids of c_j   positions in S(c_j) + row offset of block j            one embedding call
    dense        [K, *shape] per dense parameter                         vmap over clients
    samples      step i: [K, B] (every client runs I steps of B samples)

The clients' parameters are disjoint and the loss is the sum of the K per-client batch means,
so one backward pass gives every client exactly the gradient it would compute alone. A model
with ``cohort_gradients`` (sparse LR) gives those gradients in closed form, without autograd.
The rows, ids and labels come from ``cohort_batches`` (engine/cohort_batches.py), gathered on
the run's device.
"""

from __future__ import annotations

import torch
from torch.func import vmap

from fedsub.algorithms.sampling import Cohort
from fedsub.client.local_rule import CohortWork, LocalRule, clip_scale, descend
from fedsub.data.federated import FederatedDataset
from fedsub.engine.cohort_batches import cohort_batches
from fedsub.engine.schedule import Schedule
from fedsub.models.base import ClosedFormGradients, CohortHead, Model
from fedsub.submodel.device_data import DeviceData
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import CohortUpdate


def _per_client(tensor: torch.Tensor, k: int) -> torch.Tensor:
    """[K * B, ...] -> [K, B, ...]."""
    return tensor.reshape(k, -1, *tensor.shape[1:])


def _per_member(values: torch.Tensor, owner: torch.Tensor | None, like: torch.Tensor):
    """A per-member vector [K] broadcast to a cohort-layout tensor: rows via their owner,
    stacked dense tensors via the leading axis."""
    if owner is not None:
        return values.index_select(0, owner).reshape(-1, *([1] * (like.dim() - 1)))
    return values.reshape(-1, *([1] * (like.dim() - 1)))


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
    k, steps, batch = len(members), schedule.local_steps, schedule.batch_size
    data = DeviceData.of(dataset, index, schedule.device, schedule.dtype)
    clients = torch.from_numpy(members.clients).to(schedule.device)
    # A model may give its cohort gradients in closed form (``cohort_gradients``); otherwise
    # autograd differentiates embed -> head -> loss.
    closed_form = model.cohort_gradients if isinstance(model, ClosedFormGradients) else None
    batches = cohort_batches(
        data, clients, schedule.seed, round_index, steps, batch, closed_form is not None
    )
    labels, dense_inputs = batches.labels, batches.dense

    # Pull: every member's rows, concatenated; dense parameters stacked on a client axis.
    row_tensors = {t: r.values for t, r in batches.rows.items()}
    pulled_tables = {
        t: global_params.tables[t].index_select(0, rows) for t, rows in row_tensors.items()
    }
    pulled_dense = {
        n: p.unsqueeze(0).expand(k, *p.shape).clone() for n, p in global_params.dense.items()
    }

    # A model may provide ``cohort_head`` (dense [K, ...], features [K, B, ...]) written with
    # batched matmuls; otherwise its per-client head is vmapped over the client axis.
    if isinstance(model, CohortHead):
        head = model.cohort_head
    else:
        head = vmap(model.head, in_dims=(0, 0, None if dense_inputs is None else 0))
    tables = {t: v.clone().requires_grad_(True) for t, v in pulled_tables.items()}
    dense = {n: v.clone().requires_grad_(True) for n, v in pulled_dense.items()}
    leaves = [*tables.values(), *dense.values()]
    anchors = [*pulled_tables.values(), *pulled_dense.values()]
    row_owner = batches.row_owner
    owners = [*(row_owner[t] for t in tables), *(None for _ in dense)]
    rule = work.rule
    lr = torch.from_numpy(work.lr_scale * rule.lr).to(schedule.device, schedule.dtype)
    leaf_lr = [_per_member(lr, o, leaf) for o, leaf in zip(owners, leaves, strict=True)]
    corrections = None
    if work.corrections is not None:
        corrections = [*work.corrections.tables.values(), *work.corrections.dense.values()]
    buffers = [torch.zeros_like(x) for x in leaves] if rule.momentum else None
    for step in range(steps):
        step_inputs = None if dense_inputs is None else dense_inputs[step]
        if closed_form is not None:
            step_values, step_samples = batches.step_values(step), batches.step_samples(step)
            with torch.no_grad():
                table_grads, dense_grads = closed_form(
                    tables, dense, step_values, step_samples, step_inputs, labels[step]
                )
            grads = [*(table_grads[t] for t in tables), *(dense_grads[n] for n in dense)]
        else:
            step_ids = batches.step_ids(step)
            features = {n: _per_client(f, k) for n, f in model.embed(tables, step_ids).items()}
            outputs = head(dense, features, step_inputs)
            # The loss is a mean over samples, and every client has B of them: K times the
            # mean over the cohort's K * B samples is the sum of the K client means.
            flat = outputs.reshape(k * batch, *outputs.shape[2:])
            total = model.loss(flat, labels[step].reshape(-1)) * k
            grads = list(torch.autograd.grad(total, leaves))
        with torch.no_grad():
            _apply_rule(rule, leaves, grads, anchors, owners, leaf_lr, corrections, buffers, k)

    with torch.no_grad():
        return CohortUpdate(
            clients=clients,
            weights=batches.counts.to(torch.float64),
            multiplicity=torch.from_numpy(members.multiplicity).to(schedule.device),
            rows=row_tensors,
            row_owner=row_owner,
            table_deltas={t: tables[t].detach() - pulled_tables[t] for t in tables},
            dense_deltas={n: dense[n].detach() - pulled_dense[n] for n in dense},
        )


def _apply_rule(
    rule: LocalRule,
    leaves: list[torch.Tensor],
    grads: list[torch.Tensor],
    anchors: list[torch.Tensor],
    owners: list[torch.Tensor | None],
    leaf_lr: list[torch.Tensor],
    corrections: list[torch.Tensor] | None,
    buffers: list[torch.Tensor] | None,
    k: int,
) -> None:
    """``LocalRule`` for every member at once (see fedsub.client.local_rule)."""
    if rule.mu:
        grads = [g + rule.mu * (x - a) for g, x, a in zip(grads, leaves, anchors, strict=True)]
    if rule.clip_norm:
        squared = torch.zeros(k, dtype=grads[0].dtype)
        for g, owner in zip(grads, owners, strict=True):
            per_entry = g.pow(2).reshape(len(g), -1).sum(1)
            if owner is not None:
                squared.index_add_(0, owner, per_entry)
            else:
                squared += per_entry
        scale = clip_scale(squared, rule.clip_norm)
        grads = [g * _per_member(scale, o, g) for g, o in zip(grads, owners, strict=True)]
    descend(rule, leaves, grads, leaf_lr, corrections, buffers)
