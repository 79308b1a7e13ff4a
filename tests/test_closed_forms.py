"""Algorithms named after papers against their formulas written out, over a few rounds with
partial participation: FedAvg, FedSubAvg (both heat forms, seed 001), FedProx, the FedSubAvg
paper's server-side SCAFFOLD approximation (seed 002, eq. 47), and Li et al.'s sampling and
averaging schemes (seed 004).

A quadratic federation whose local steps have a closed form: client k's samples all read its
rows ``S(k)`` (row m ``a_km`` times) with label ``xi_k``; the loss of a sample is
``sum_m a_km (w_m - xi_k)^2 + (b - xi_k)^2`` (a table and a dense parameter), so a plain SGD
step of rate ``eta`` takes ``w_m`` to ``w_m - eta (2 a_km (w_m - xi_k) + mu (w_m - w0_m))``
(``mu``: FedProx's term, 0 otherwise), whatever the batch order. Client sizes ``n_k`` are
unbalanced, K < N, one row is held by nobody (Scheme II's model average
rescales it by ``f = (N/K) sum_{S_t} p_k != 1``) and one by a single client (heat 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.algorithms.sampling import sample_cohort
from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.ragged import Ragged
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params

ROWS = 6  # row 4 is held by no client, row 5 by client 4 alone (heat 1 in both forms)
HELD = [{0: 1, 1: 2}, {1: 1}, {2: 3, 0: 1}, {3: 1, 1: 1}, {2: 1, 5: 2}, {0: 2, 3: 1}]
SIZES = [1, 4, 2, 7, 1, 3]  # n_k: unbalanced
LABELS = [1.5, -0.5, 2.0, 0.25, -1.25, 0.75]  # exact in float32 (the labels dtype)
W0, B0 = 0.6, -0.4
K, STEPS, LR, SEED = 3, 2, 0.05, 3  # seed 3: Scheme I draws a client twice


@dataclass(frozen=True)
class QuadraticWithBias:
    """Per sample: ``sum over its ids m of (w_m - xi)^2 + (b - xi)^2``."""

    task: str = "regression"

    def init(self, generator, dtype):
        return Params(
            {"w": torch.full((ROWS, 1), W0, dtype=dtype)}, {"b": torch.full((1,), B0, dtype=dtype)}
        )

    def embed(self, tables, ids):
        values, offsets = ids["w"]
        w = tables["w"]
        bag = lambda weight: F.embedding_bag(  # noqa: E731
            values, weight, offsets, mode="sum", include_last_offset=True
        )[:, 0]
        return {"moments": torch.stack([bag(w**2), bag(w), bag(torch.ones_like(w))], dim=1)}

    def head(self, dense, features, dense_inputs):
        moments = features["moments"]
        return torch.cat([moments, dense["b"].expand(len(moments), 1)], dim=1)

    def loss(self, outputs, labels):
        sq, s, count, b = outputs.unbind(1)
        return (sq - 2 * labels * s + labels**2 * count + (b - labels) ** 2).mean()


def federation() -> FederatedDataset:
    parts = []
    for held, size, label in zip(HELD, SIZES, LABELS, strict=True):
        ids = [m for m, a in sorted(held.items()) for _ in range(a)]
        samples = Ragged.from_lists([ids] * size)
        parts.append(SampleSet({"w": samples}, np.full(size, label, dtype=np.float32)))
    return FederatedDataset.from_clients("quadratic", {"w": ROWS}, parts, parts[0])


def local_model(k: int, w: np.ndarray, b: float, lr: float, mu: float = 0.0):
    """Client k's model after ``STEPS`` SGD steps from (w, b), written out step by step."""
    xi, w0, b0, out = LABELS[k], w.copy(), b, w.copy()
    for _ in range(STEPS):
        for m, a in HELD[k].items():
            out[m] = out[m] - lr * (2 * a * (out[m] - xi) + mu * (out[m] - w0[m]))
        b = b - lr * (2 * (b - xi) + mu * (b - b0))
    return out, b


def heat_coefficients(heat: str) -> np.ndarray:
    """FedSubAvg's row coefficients: N / n_m (clients) or sum_k n_k / sum_{k: m in S(k)} n_k
    (samples), 1 for the row nobody holds."""
    coef = np.ones(ROWS)
    for m in range(ROWS):
        holders = [k for k, held in enumerate(HELD) if m in held]
        if holders and heat == "clients":
            coef[m] = len(HELD) / len(holders)
        elif holders:
            coef[m] = sum(SIZES) / sum(SIZES[k] for k in holders)
    return coef


def by_hand(
    name: str,
    rounds: int,
    heat: str = "samples",
    mu: float = 0.0,
    k: int = K,
    beta: float | None = None,
) -> tuple[np.ndarray, float, list[float]]:
    """The global model after ``rounds`` rounds of ``name`` (``fedavg@<scheme>``,
    ``fedsubavg``, ``fedprox``, ``scaffold-approx`` with momentum ``beta``, default
    (N - K) / N), with ``k`` clients a round, and each round's Scheme II factor f."""
    K = k  # the paper's name
    algorithm, _, scheme = name.partition("@")
    n = len(SIZES)
    p = np.array(SIZES) / sum(SIZES)
    coef = heat_coefficients(heat) if algorithm == "fedsubavg" else np.ones(ROWS)
    coef_form = heat if algorithm == "fedsubavg" else None
    w, b, factors = np.full(ROWS, W0), B0, []
    if beta is None:
        beta = (n - K) / n  # scaffold-approx: seed 002's eq. 47 with its default beta
    u_w, u_b = np.zeros(ROWS), 0.0
    sampling = "proportional-with-replacement" if scheme == "scheme1" else "uniform"
    for r in range(1, rounds + 1):
        cohort = sample_cohort(sampling, SEED, r, np.array(SIZES), K)
        locals_ = {}
        for k in cohort.clients:
            lr = LR * p[k] * n if scheme == "transformed-scheme2" else LR
            locals_[int(k)] = local_model(int(k), w, b, lr, mu)
        if scheme == "scheme2":  # the paper: w_{t+1} = (N/K) sum_{S_t} p_k w_k
            f = n / K * sum(p[k] for k in locals_)
            w = sum(n / K * p[k] * wk for k, (wk, _) in locals_.items())
            b = sum(n / K * p[k] * bk for k, (_, bk) in locals_.items())
            factors.append(f)
            continue
        drawn = dict(zip(cohort.clients.tolist(), cohort.multiplicity.tolist(), strict=True))
        if scheme == "scheme2-delta":  # fedsub's: the old model keeps weight 1
            a = {k: n / K * p[k] for k in locals_}
        elif scheme == "original":  # McMahan et al.: w + sum_{S_t} p_k (w_k - w)
            a = {k: p[k] for k in locals_}
        elif scheme in ("scheme1", "transformed-scheme2") or coef_form == "clients":
            a = {k: drawn[k] / K for k in locals_}  # plain average (each draw counts)
        else:  # sample-weighted mean over the round (FedAvg as the FedSubAvg authors run it)
            a = {k: SIZES[k] / sum(SIZES[j] for j in locals_) for k in locals_}
        step_w = coef * sum(a[k] * (wk - w) for k, (wk, _) in locals_.items())
        step_b = sum(a[k] * (bk - b) for k, (_, bk) in locals_.items())
        if algorithm == "scaffold-approx":  # the global update: beta old + (1 - beta) mean
            u_w, u_b = beta * u_w + (1 - beta) * step_w, beta * u_b + (1 - beta) * step_b
            step_w, step_b = u_w, u_b
        w, b = w + step_w, b + step_b
    return w, b, factors


def engine(
    name: str, rounds: int, backend: str, heat: str = "samples", options=None, k: int = K
) -> Params:
    dataset = federation()
    index = SubmodelIndex.build(dataset)
    context = AlgorithmContext(dataset, index, heat, k)
    algorithm = build_algorithm(name, context, options)
    schedule = Schedule(
        rounds,
        k,
        local=LocalWork(STEPS, 1, ClientStep(lr=LR)),
        seed=SEED,
        execution=Execution(dtype=torch.float64, backend=backend),
    )
    return train(QuadraticWithBias(), algorithm, dataset, index, schedule)


SCHEMES = ["default", "scheme1", "scheme2", "scheme2-delta", "transformed-scheme2", "original"]


@pytest.mark.parametrize("backend", ["sequential", "batched"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_scheme_is_its_formula_over_three_rounds(scheme, backend):
    counts = np.array(SIZES)
    draws = [sample_cohort("proportional-with-replacement", SEED, r, counts, K) for r in (1, 2, 3)]
    assert max(d.multiplicity.max() for d in draws) == 2  # Scheme I counts a repeated draw
    w, b, _ = by_hand(f"fedavg@{scheme}", 3)
    got = engine(f"fedavg@{scheme}", 3, backend)
    np.testing.assert_allclose(got.tables["w"][:, 0].numpy(), w, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.dense["b"].numpy(), [b], rtol=0, atol=1e-12)


def test_scheme2_rescales_the_whole_old_model_by_f():
    """The row nobody holds is W0 * f_1 f_2 f_3 under the paper's Scheme II and stays W0
    under the delta form; the draws here give f != 1, so the two differ."""
    w, _, factors = by_hand("fedavg@scheme2", 3)
    assert min(abs(f - 1) for f in factors) > 0.05  # unbalanced p_k: f is not 1
    assert w[4] == pytest.approx(W0 * np.prod(factors), abs=1e-12)
    got = engine("fedavg@scheme2", 3, "batched").tables["w"][4, 0].item()
    assert got == pytest.approx(W0 * np.prod(factors), abs=1e-12)
    assert engine("fedavg@scheme2-delta", 3, "batched").tables["w"][4, 0].item() == W0


def test_transformed_scheme2_scales_each_clients_lr_by_p_k_n():
    """The same rounds with the unscaled rate are another model: the scaling is in the run."""
    w, _, _ = by_hand("fedavg@transformed-scheme2", 2)
    got = engine("fedavg@transformed-scheme2", 2, "sequential").tables["w"][:, 0].numpy()
    plain = engine("fedavg@scheme2-delta", 2, "sequential").tables["w"][:, 0].numpy()
    np.testing.assert_allclose(got, w, rtol=0, atol=1e-12)
    assert np.abs(got - plain).max() > 1e-3


@pytest.mark.parametrize("backend", ["sequential", "batched"])
@pytest.mark.parametrize("heat", ["samples", "clients"])
def test_fedsubavg_is_its_formula_with_either_heat(heat, backend):
    """Seed 001, Algorithm 1 (heat = clients: uniform mean over the K clients, row m scaled
    by N / n_m) and appendix D.4 (heat = samples: sample-weighted mean, scaled by
    sum_k n_k / sum_{k: m in S(k)} n_k); dense parameters unscaled."""
    assert any(
        4 in sample_cohort("uniform", SEED, r, np.array(SIZES), K).clients for r in (1, 2, 3)
    )
    w, b, _ = by_hand("fedsubavg", 3, heat)
    got = engine("fedsubavg", 3, backend, heat)
    np.testing.assert_allclose(got.tables["w"][:, 0].numpy(), w, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.dense["b"].numpy(), [b], rtol=0, atol=1e-12)
    plain, _, _ = by_hand("fedavg", 3, heat)
    assert np.abs(w - plain).max() > 1e-3  # the coefficients matter on this data


@pytest.mark.parametrize("backend", ["sequential", "batched"])
def test_fedprox_is_its_formula(backend):
    """FedProx: each local step adds mu (x - x_pulled) to the gradient, on the submodel and
    the dense parameters."""
    from fedsub.algorithms.registry import FedProxOptions

    w, b, _ = by_hand("fedprox", 3, mu=0.7)
    got = engine("fedprox", 3, backend, options=FedProxOptions(mu=0.7))
    np.testing.assert_allclose(got.tables["w"][:, 0].numpy(), w, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.dense["b"].numpy(), [b], rtol=0, atol=1e-12)
    plain, _, _ = by_hand("fedavg", 3)
    assert np.abs(w - plain).max() > 1e-3


@pytest.mark.parametrize("backend", ["sequential", "batched"])
def test_scaffold_approx_is_equation_47_with_beta_n_minus_k_over_n(backend):
    """Seed 002, appendix D.2, eq. 47: the global update is (N-K)/N times the previous one
    plus K/N times the round's mean update (here 1/2 and 1/2), on every row and the bias."""
    w, b, _ = by_hand("scaffold-approx", 3)
    got = engine("scaffold-approx", 3, backend)
    np.testing.assert_allclose(got.tables["w"][:, 0].numpy(), w, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.dense["b"].numpy(), [b], rtol=0, atol=1e-12)
    plain, _, _ = by_hand("fedavg", 3)
    assert np.abs(w - plain).max() > 1e-3


@pytest.mark.parametrize("backend", ["sequential", "batched"])
@pytest.mark.parametrize(("k", "beta"), [(2, 4 / 6), (1, 5 / 6)])
def test_scaffold_approx_momentum_is_n_minus_k_over_n_where_n_is_not_2k(k, beta, backend):
    """N = 6 clients, K = 2 (beta = 4/6) and K = 1 (beta = 5/6), written out: with N = 2K,
    (N - K) / N and K / N are both 1/2, so the test above cannot tell them apart."""
    w, b, _ = by_hand("scaffold-approx", 3, k=k, beta=beta)
    got = engine("scaffold-approx", 3, backend, k=k)
    np.testing.assert_allclose(got.tables["w"][:, 0].numpy(), w, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.dense["b"].numpy(), [b], rtol=0, atol=1e-12)
    swapped, _, _ = by_hand("scaffold-approx", 3, k=k, beta=k / 6)  # K / N: another model
    assert np.abs(w - swapped).max() > 1e-4
