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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.func import vmap

from fedsub import device as device_lib
from fedsub.algorithms.sampling import Cohort
from fedsub.client.layout import CohortLayout
from fedsub.client.transforms import Members
from fedsub.client.work import CohortWork
from fedsub.data.federated import FederatedDataset
from fedsub.engine import captured_step, cuda_graphs
from fedsub.engine.cohort_batches import CohortBatches, cohort_batches
from fedsub.engine.cohort_job import CohortJob
from fedsub.engine.execution import CudaGraphs
from fedsub.engine.schedule import Schedule
from fedsub.models import low_rank
from fedsub.models.base import (
    ClosedFormGradients,
    CohortHead,
    LowRankWeights,
    Model,
    cohort_features,
    has_capability,
    packed_names,
)
from fedsub.models.low_rank import LowRankWeight
from fedsub.profiling import timed
from fedsub.submodel.device_data import DeviceData
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import CohortUpdate

Tensors = dict[str, torch.Tensor]


def run_cohort(job: CohortJob) -> CohortUpdate:
    """The cohort's local steps, all members at once: pull their rows and dense parameters,
    train them (eagerly, captured or as a CUDA graph) and push back their changes."""
    model, members, schedule = job.model, job.cohort, job.schedule
    # A model may give its cohort gradients in closed form (``cohort_gradients``); otherwise
    # autograd differentiates embed -> head -> loss.
    closed_form = model.cohort_gradients if has_capability(model, ClosedFormGradients) else None
    with timed("pull"):
        clients, batches, pulled_tables, pulled_dense = _pull(
            job.params,
            job.dataset,
            job.index,
            members,
            job.round,
            schedule,
            closed_form is not None,
        )
    row_tensors = {t: r.values for t, r in batches.rows.items()}
    tables, dense = _local_steps(job, closed_form, batches, pulled_tables, pulled_dense)
    with torch.no_grad(), timed("push"):
        return CohortUpdate(
            clients=clients,
            weights=batches.counts.to(torch.float64),
            multiplicity=device_lib.from_host(members.multiplicity, schedule.execution.device),
            rows=row_tensors,
            row_owner=batches.row_owner,
            table_deltas={t: tables[t].detach() - pulled_tables[t] for t in tables},
            dense_deltas={n: _change(dense[n], pulled_dense[n]) for n in dense},
            unions=batches.unions,
        )


def _local_steps(
    job: CohortJob,
    closed_form: Callable[..., tuple[Tensors, Tensors]] | None,
    batches: CohortBatches,
    pulled_tables: Tensors,
    pulled_dense: Tensors,
) -> tuple[Tensors, Mapping[str, torch.Tensor | LowRankWeight]]:
    """The members' tables and dense parameters after the round's local steps, run the way
    ``execution.compile`` asks: replayed as a CUDA graph, as one captured program, or op by
    op."""
    model, schedule, work = job.model, job.schedule, job.work
    head = _cohort_head(model, batches.dense)
    capture = captured_step.capture_for(model, closed_form is not None, schedule.execution.compile)
    if capture is None:
        return _eager_steps(
            model, head, closed_form, pulled_tables, pulled_dense, batches.row_owner, batches, work
        )
    field_tables = data_of(job.dataset, job.index, schedule).field_tables
    padding = captured_step.PaddedCohort.of(
        {t: len(v) for t, v in pulled_tables.items()}, field_tables
    )
    if isinstance(capture, CudaGraphs):  # the round's steps replayed as one CUDA graph
        with timed("local steps (graph)"):
            return cuda_graphs.graphed_steps(
                model, head, pulled_tables, pulled_dense, batches, work, padding, capture
            )
    # execution.compile: the steps as one captured program
    k, batch = len(job.cohort), schedule.batch_size
    step = captured_step.captured_step(model, head, work.chain, k, batch, capture)
    with timed("local steps (captured)"):
        return captured_step.run_steps(
            step,
            padding,
            pulled_tables,
            {n: v.clone() for n, v in pulled_dense.items()},
            batches.row_owner,
            batches,
            work,
            cuda_graphs=capture.mode == "reduce-overhead",
        )


def _cohort_head(model: Model, dense_inputs: torch.Tensor | None) -> Callable[..., torch.Tensor]:
    """The head over the whole cohort: the model's ``cohort_head`` (dense [K, ...], features
    [K, B, ...], written with batched matmuls) when it has one, else its per-client head
    vmapped over the client axis."""
    if has_capability(model, CohortHead):
        return model.cohort_head
    return vmap(model.head, in_dims=(0, 0, None if dense_inputs is None else 0))


def _change(final: torch.Tensor | LowRankWeight, pulled: torch.Tensor) -> torch.Tensor:
    """A dense parameter's change over the round's local steps, per member."""
    if isinstance(final, LowRankWeight):
        return final.change()
    return final.detach() - pulled


def data_of(dataset: FederatedDataset, index: SubmodelIndex, schedule: Schedule) -> DeviceData:
    """The run's training data on its device (converted once, kept with the index)."""
    return DeviceData.of(dataset, index, schedule.execution.device, schedule.execution.dtype)


def _pull(
    global_params: Params,
    dataset: FederatedDataset,
    index: SubmodelIndex,
    members: Cohort,
    round_index: int,
    schedule: Schedule,
    sample_of_id: bool,
) -> tuple[torch.Tensor, CohortBatches, Tensors, Tensors]:
    """The cohort's batches and its members' rows and dense parameters (stacked on a client
    axis: views of the global ones, which the caller copies before training), pulled from the
    global model."""
    k, steps, batch = len(members), schedule.local_steps, schedule.batch_size
    data = data_of(dataset, index, schedule)
    clients = device_lib.from_host(members.clients, schedule.execution.device)
    batches = cohort_batches(
        data,
        clients,
        schedule.seed,
        round_index,
        steps,
        batch,
        sample_of_id,
        host_clients=members.clients,
    )
    row_tensors = {t: r.values for t, r in batches.rows.items()}
    pulled_tables = {t: global_params.gather_rows(t, rows) for t, rows in row_tensors.items()}
    # views of the global parameters, not copies: the steps train copies of them (a copy
    # here would be one more pass over the cohort's dense parameters)
    pulled_dense = {n: p.unsqueeze(0).expand(k, *p.shape) for n, p in global_params.dense.items()}
    return clients, batches, pulled_tables, pulled_dense


@dataclass
class _Trainees:
    """What the eager local steps train: the members' tables and dense parameters (a low-rank
    weight kept as the global weight plus factors), all of them in the client rule's order
    (``params``), the rule's per-member inputs and its state."""

    tables: Tensors
    dense: dict[str, torch.Tensor | LowRankWeight]
    params: list[torch.Tensor]
    rule_inputs: Members
    state: Any


def _eager_steps(
    model: Model,
    head: Callable[..., torch.Tensor],
    closed_form: Callable[..., tuple[Tensors, Tensors]] | None,
    pulled_tables: Tensors,
    pulled_dense: Tensors,
    row_owner: Tensors,
    batches: CohortBatches,
    work: CohortWork,
) -> tuple[Tensors, dict[str, torch.Tensor | LowRankWeight]]:
    """The local steps op by op (autograd, or the model's closed-form gradients): the
    members' tables and dense parameters after the last step."""
    trainees = _trainees(model, closed_form, pulled_tables, pulled_dense, row_owner, batches, work)
    if closed_form is not None:
        _closed_form_steps(closed_form, trainees, batches, work)
    else:
        _autograd_steps(model, head, trainees, batches, work)
    return trainees.tables, trainees.dense


def _trainees(
    model: Model,
    closed_form: Callable[..., tuple[Tensors, Tensors]] | None,
    pulled_tables: Tensors,
    pulled_dense: Tensors,
    row_owner: Tensors,
    batches: CohortBatches,
    work: CohortWork,
) -> _Trainees:
    """Copies of the pulled parameters to train, and the client rule set up on them."""
    steps, k, batch = batches.labels.shape
    tables = {t: v.clone().requires_grad_(True) for t, v in pulled_tables.items()}
    low_rank = (
        frozenset() if closed_form else low_rank_names(model, work, pulled_dense, steps * batch)
    )
    dense: dict[str, torch.Tensor | LowRankWeight] = {
        n: LowRankWeight(v[0], k, steps * batch)
        if n in low_rank
        else v.clone().requires_grad_(True)
        for n, v in pulled_dense.items()
    }
    params = cast(list[torch.Tensor], [*tables.values(), *dense.values()])
    # The client transforms run on all members at once: the layout gives per-member norms
    # and learning rates (fedsub.client.layout).
    layout = CohortLayout((*(row_owner[t] for t in tables), *(None for _ in dense)), k)
    corrections = None
    if work.corrections is not None:
        corrections = [*work.corrections.tables.values(), *work.corrections.dense.values()]
    rule_inputs = Members(layout, work.lr, corrections)
    with torch.no_grad():
        state = work.chain.init(params, rule_inputs)
    return _Trainees(tables, dense, params, rule_inputs, state)


def _closed_form_steps(
    closed_form: Callable[..., tuple[Tensors, Tensors]],
    trainees: _Trainees,
    batches: CohortBatches,
    work: CohortWork,
) -> None:
    """The steps with the model's closed-form cohort gradients: no autograd anywhere."""
    tables, dense, params = trainees.tables, trainees.dense, trainees.params
    labels, dense_inputs = batches.labels, batches.dense
    with torch.no_grad():
        values, samples = batches.by_step(batches.ids_values()), batches.samples_by_step()
        for step in range(labels.shape[0]):
            with timed("backward"):
                step_inputs = None if dense_inputs is None else dense_inputs[step]
                table_grads, dense_grads = closed_form(
                    tables, dense, values[step], samples[step], step_inputs, labels[step]
                )
            grads = [*(table_grads[t] for t in tables), *(dense_grads[n] for n in dense)]
            with timed("client rule"):
                trainees.state = work.chain.step(
                    grads, trainees.state, params, trainees.rule_inputs
                )


def _autograd_steps(
    model: Model,
    head: Callable[..., torch.Tensor],
    trainees: _Trainees,
    batches: CohortBatches,
    work: CohortWork,
) -> None:
    """The steps differentiated by autograd: embed, head and loss over the whole cohort."""
    tables, dense, params = trainees.tables, trainees.dense, trainees.params
    steps, k, batch = batches.labels.shape
    labels, dense_inputs = batches.labels, batches.dense
    # a low-rank weight's place among the leaves is its probe (its gradient comes as factors)
    leaves = [*tables.values(), *(_leaf(v) for v in dense.values())]
    packed = packed_names(model)  # features passed without a client axis
    for step in range(steps):
        step_inputs = None if dense_inputs is None else dense_inputs[step]
        with timed("forward"):
            step_ids = batches.step_ids(step)
            features = cohort_features(model.embed(tables, step_ids), k, packed)
            outputs = head(cast(Tensors, dense), features, step_inputs)
            # The loss is a mean over samples, and every client has B of them: K times
            # the mean over the cohort's K * B samples is the sum of the K client means.
            flat = outputs.reshape(k * batch, *outputs.shape[2:])
            total = model.loss(flat, labels[step].reshape(-1)) * k
        with timed("backward"):
            grads = list(torch.autograd.grad(total, leaves))
            for position, weight in enumerate(params):
                if isinstance(weight, LowRankWeight):
                    grads[position] = cast(torch.Tensor, weight.take_gradient())
        with torch.no_grad(), timed("client rule"):
            trainees.state = work.chain.step(grads, trainees.state, params, trainees.rule_inputs)


def low_rank_names(
    model: Model, work: CohortWork, pulled_dense: Tensors, rows: int
) -> frozenset[str]:
    """The dense weights this round keeps as the global weight plus each member's low-rank
    change (models/low_rank.py): the model's ``low_rank_weights`` whose ``rows`` factor rows
    (local steps x batch size) are fewer numbers than the weight, when the client rule only
    scales the gradient (a full-rank term such as FedProx's keeps the dense form)."""
    if not has_capability(model, LowRankWeights) or not work.chain.scalings_only:
        return frozenset()
    return frozenset(
        n
        for n in model.low_rank_weights
        if n in pulled_dense and low_rank.worth_it(tuple(pulled_dense[n].shape[1:]), rows)
    )


def _leaf(value: torch.Tensor | LowRankWeight) -> torch.Tensor:
    return value.probe if isinstance(value, LowRankWeight) else value
