"""The sequential backend: clients one after another, each on its own pulled submodel.

The plainest correct implementation of a round's client work; the batched backend is tested
against it.
"""

from __future__ import annotations

import torch

from fedsub.client.transforms import Chain
from fedsub.client.work import CohortWork
from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.engine.cohort_job import CohortJob
from fedsub.engine.local_sgd import local_sgd
from fedsub.engine.schedule import Schedule
from fedsub.engine.shuffle import cohort_schedules
from fedsub.models.base import Model
from fedsub.profiling import timed
from fedsub.submodel.device_data import DeviceData
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import ClientUpdate, CohortUpdate, pull, push


def train_submodel(
    model: Model,
    pulled: Params,
    samples: SampleSet,
    client: int,
    round_index: int,
    schedule: Schedule,
    chain: Chain,
    lr: float,
    correction: Params | None = None,
) -> Params:
    """A client's local steps on its pulled submodel (a copy is trained): its batches come
    from the counter-based schedule of (seed, round, client), wherever it runs."""
    order = cohort_schedules(
        schedule.seed,
        round_index,
        torch.tensor([client]),
        torch.tensor([len(samples)]),
        schedule.local_steps,
        schedule.batch_size,
    )[0].numpy()  # host indices into the client's numpy samples (the plain reference)
    return local_sgd(model, pulled.clone(), samples, order, chain, lr, correction)


def client_round(
    model: Model,
    global_params: Params,
    dataset: FederatedDataset,
    index: SubmodelIndex,
    client: int,
    round_index: int,
    schedule: Schedule,
    work: CohortWork,
    member: int = 0,
) -> ClientUpdate:
    """One client's work in one round: pull S(k), local steps, push the row deltas.

    ``member`` is the client's position in the cohort (to find its lr / corrections)."""
    with timed("pull"):
        data = DeviceData.of(dataset, index, schedule.execution.device, schedule.execution.dtype)
        rows = {t: r.row(client) for t, r in data.rows.items()}
        pulled = pull(global_params, rows)
        samples = index.client_samples(dataset, client)
        correction = None if work.corrections is None else work.corrections.member(member)
    lr = float(work.lr[member])
    trained = train_submodel(
        model, pulled, samples, client, round_index, schedule, work.chain, lr, correction
    )
    with timed("push"):
        return push(client, float(len(samples)), rows, pulled, trained)


def run_cohort(job: CohortJob) -> CohortUpdate:
    """The cohort's members one after another (``client_round``), in cohort order."""
    args = (job.model, job.params, job.dataset, job.index)
    updates = [
        client_round(*args, int(k), job.round, job.schedule, job.work, j)
        for j, k in enumerate(job.cohort.clients)
    ]
    multiplicity = torch.from_numpy(job.cohort.multiplicity).to(job.schedule.execution.device)
    return CohortUpdate.from_clients(updates, multiplicity)
