"""SCAFFOLD (Karimireddy et al. 2020, option II) against a dense per-client loop in plain torch.

The reference trains each sampled client on the FULL model (every row of the table and the
dense bias) with ``y -= lr (g + c - c_i)``, keeps full-model ``c_i`` for every client that took
part, and updates ``c += (1/N) sum_{i in S} (c_i+ - c_i)`` with K < N. ``scaffold`` must equal
it; ``scaffold-submodel`` (fedsub's) equals the same loop with the correction and ``c_i``
restricted to the client's rows S(i) and the dense parameters.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsub.algorithms.registry import AlgorithmContext, ServerLrOptions, build_algorithm
from fedsub.algorithms.sampling import Cohort, uniform_cohort
from fedsub.algorithms.scaffold import ControlVariates
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.engine.loop import RunControl
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.engine.shuffle import cohort_schedules
from fedsub.models.base import Batch, forward
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params

from .conftest import make_dataset

ROWS, CLIENTS, K, STEPS, BATCH, LR, SEED = 8, 6, 3, 3, 2, 0.3, 4
SAMPLES = [  # client k's samples (ids of table "t"); row 7 is held by nobody
    [[0, 1], [1], [0, 2]],
    [[3], [3, 4], [4], [3, 1]],
    [[5, 6], [6]],
    [[0, 5], [2, 3], [6, 0], [1]],
    [[4, 6], [2]],
    [[1, 2, 3], [5], [0]],
]


def dataset_and_model():
    dataset = make_dataset(SAMPLES, ROWS, seed=2)
    model = SparseLogisticRegression(dict(dataset.table_rows), init_std=0.5)
    return dataset, model


NORMS: list[float] = []  # every member's update norm, as by_hand last saw them


def by_hand(
    rounds: int, server_lr: float, whole_model: bool, max_norm: float = 0.0, **chain
) -> dict[str, torch.Tensor]:
    """The global model after ``rounds`` rounds of SCAFFOLD, per client in plain torch on the
    full model. ``chain``: train.clip_norm, weight_decay and momentum, in fedsub's order
    (clip, decay, correction, momentum, step). ``max_norm``: a member whose update's norm is
    larger is dropped from the round (no share in the mean, its c_i unchanged)."""
    NORMS.clear()
    dataset, model = dataset_and_model()
    clip, decay, momentum = (chain.get(k, 0.0) for k in ("clip_norm", "weight_decay", "momentum"))
    schedule = Schedule(
        1,
        K,
        LocalWork(STEPS, BATCH, ClientStep(LR)),
        seed=SEED,
        execution=Execution(dtype=torch.float64),
    )
    start = initial_params(model, schedule)
    x = {"t": start.tables["t"].clone(), "bias": start.dense["bias"].clone()}
    c = {n: torch.zeros_like(v) for n, v in x.items()}
    c_i: dict[int, dict[str, torch.Tensor]] = {}
    counts = dataset.sample_counts()
    for r in range(1, rounds + 1):
        cohort = uniform_cohort(SEED, r, CLIENTS, K)
        deltas, variate_changes = {}, {}
        for k in cohort.tolist():
            held = torch.zeros(ROWS, 1, dtype=torch.float64)  # 1 on S(k)
            held[np.unique(np.concatenate(SAMPLES[k]))] = 1.0
            mask = {"t": torch.ones_like(held) if whole_model else held, "bias": 1.0}
            own = c_i.setdefault(k, {n: torch.zeros_like(v) for n, v in x.items()})
            y = {n: v.clone() for n, v in x.items()}
            buffer = {n: torch.zeros_like(v) for n, v in x.items()}
            samples = dataset.train.slice(
                int(dataset.client_offsets[k]), int(counts[: k + 1].sum())
            )
            order = cohort_schedules(
                SEED, r, torch.tensor([k]), torch.tensor([len(samples)]), STEPS, BATCH
            )[0].numpy()
            for step in order:
                batch = Batch.from_samples(samples.take(step), torch.float64)
                tensors = {n: v.clone().requires_grad_(True) for n, v in y.items()}
                params = type(start)({"t": tensors["t"]}, {"bias": tensors["bias"]})
                loss = model.loss(forward(model, params, batch), batch.labels)
                grads = dict(
                    zip(tensors, torch.autograd.grad(loss, list(tensors.values())), strict=True)
                )
                if clip:
                    norm = torch.sqrt(sum((g**2).sum() for g in grads.values()))
                    grads = {n: g * min(1.0, clip / (float(norm) + 1e-6)) for n, g in grads.items()}
                for n in y:
                    g = grads[n] + decay * y[n] + mask[n] * (c[n] - own[n])
                    buffer[n] = momentum * buffer[n] + g
                    y[n] = y[n] - LR * buffer[n]
            deltas[k] = {n: y[n] - x[n] for n in x}
            norm = float(torch.sqrt(sum((d**2).sum() for d in deltas[k].values())))
            NORMS.append(norm)
            if max_norm and norm > max_norm:
                del deltas[k]
                continue
            new = {n: own[n] - mask[n] * (c[n] + deltas[k][n] / (STEPS * LR)) for n in x}
            variate_changes[k] = {n: new[n] - own[n] for n in x}
            c_i[k] = new
        total = sum(float(counts[k]) for k in deltas)
        for n in x:
            x[n] = x[n] + server_lr * sum(counts[k] / total * d[n] for k, d in deltas.items())
            c[n] = c[n] + sum(change[n] for change in variate_changes.values()) / CLIENTS
    return x


def engine(name: str, rounds: int, server_lr: float, backend: str, max_norm=0.0, **chain):
    dataset, model = dataset_and_model()
    index = SubmodelIndex.build(dataset)
    algorithm = build_algorithm(
        name, AlgorithmContext(dataset, index, "samples", K), ServerLrOptions(server_lr=server_lr)
    )
    schedule = Schedule(
        rounds,
        K,
        LocalWork(STEPS, BATCH, ClientStep(LR, **chain)),
        seed=SEED,
        execution=Execution(dtype=torch.float64, backend=backend),
    )
    return train(
        model, algorithm, dataset, index, schedule, control=RunControl(max_update_norm=max_norm)
    )


def assert_equal(got, expected) -> None:
    torch.testing.assert_close(got.tables["t"], expected["t"], rtol=0, atol=1e-12)
    torch.testing.assert_close(got.dense["bias"], expected["bias"], rtol=0, atol=1e-12)


CHAINS = [{}, {"clip_norm": 0.5, "weight_decay": 0.05, "momentum": 0.5}]


@pytest.mark.parametrize("chain", CHAINS, ids=["sgd", "clip-decay-momentum"])
@pytest.mark.parametrize("backend", ["sequential", "batched"])
def test_scaffold_is_the_full_model_algorithm(backend, chain):
    """Three rounds, K = 3 of N = 6, server lr 0.8: every row (cold rows included) equals
    the full-model loop's."""
    expected = by_hand(3, 0.8, whole_model=True, **chain)
    assert_equal(engine("scaffold", 3, 0.8, backend, **chain), expected)


@pytest.mark.parametrize("backend", ["sequential", "batched"])
def test_scaffold_submodel_is_fedsubs_restricted_form(backend):
    expected = by_hand(3, 0.8, whole_model=False)
    assert_equal(engine("scaffold-submodel", 3, 0.8, backend), expected)


def test_the_two_forms_differ_on_rows_a_client_does_not_hold():
    """Sanity of the reference: correcting cold rows (full model) is another model than not
    correcting them, so the tests above tell the forms apart; and the server's c uses the
    share 1/N (with 1/K the model differs too)."""
    whole, submodel = by_hand(3, 0.8, whole_model=True), by_hand(3, 0.8, whole_model=False)
    assert (whole["t"] - submodel["t"]).abs().max() > 1e-4
    assert torch.equal(whole["t"][7], submodel["t"][7])  # the row nobody holds never moves


@pytest.mark.parametrize("whole_model", [True, False])
def test_a_screened_out_member_neither_moves_the_model_nor_its_variates(whole_model):
    """train.max_update_norm drops the members whose update is too large: the others'
    mean moves the model, and only their c_i (with their own corrections) change."""
    by_hand(4, 0.8, whole_model)
    ordered = sorted(NORMS)  # a threshold between members' norms: the two largest dropped,
    threshold = (ordered[-3] + ordered[-2]) / 2  # one of them in front of a kept member
    expected = by_hand(4, 0.8, whole_model, max_norm=threshold)
    name = "scaffold" if whole_model else "scaffold-submodel"
    got = engine(name, 4, 0.8, "batched", max_norm=threshold)
    assert_equal(got, expected)
    unscreened = by_hand(4, 0.8, whole_model)
    assert (unscreened["t"] - expected["t"]).abs().max() > 1e-4


def test_corrections_are_c_minus_c_i_and_the_variates_survive_a_checkpoint():
    """ControlVariates by hand, with a 3 x 4 dense weight beside the table: member j's
    correction is c - c_j on its rows and on every dense entry; state_tensors then
    load_state_tensors (a resume) gives back c and every c_i."""
    dataset, _ = dataset_and_model()
    index = SubmodelIndex.build(dataset)
    shapes = {"w": (3, 4), "b": (4,)}
    params = Params({"t": torch.zeros(ROWS, 2)}, {n: torch.zeros(s) for n, s in shapes.items()})
    variates = ControlVariates(params, index, CLIENTS)
    generator = torch.Generator().manual_seed(0)
    for state in (variates.c, variates._client(1), variates._client(4)):
        for value in [*state.tables.values(), *state.dense.values()]:
            value.copy_(torch.randn(value.shape, generator=generator))
    got = variates.corrections(Cohort(np.array([1, 4]), np.array([1, 1])))
    for j, k in enumerate([1, 4]):
        member, own = got.member(j), variates.client_c[k]
        rows = torch.from_numpy(index.client_rows("t", k))
        assert torch.equal(member.tables["t"], variates.c.tables["t"][rows] - own.tables["t"])
        for n in shapes:
            assert torch.equal(member.dense[n], variates.c.dense[n] - own.dense[n])
    restored = ControlVariates(params, index, CLIENTS)
    restored.load_state_tensors(variates.state_tensors())
    assert sorted(restored.client_c) == [1, 4]
    pairs = [(restored.c, variates.c)] + [
        (restored.client_c[k], variates.client_c[k]) for k in (1, 4)
    ]
    for back, saved in pairs:
        assert back.state_dict().keys() == saved.state_dict().keys()
        assert all(torch.equal(v, saved.state_dict()[n]) for n, v in back.state_dict().items())
