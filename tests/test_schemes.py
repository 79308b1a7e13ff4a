"""Li et al.'s sampling and averaging schemes (seed 004) against their formulas written out.

A quadratic federation whose local steps have a closed form: client k's samples all read its
rows ``S(k)`` (row m ``a_km`` times) with label ``xi_k``; the loss of a sample is
``sum_m a_km (w_m - xi_k)^2 + (b - xi_k)^2`` (a table and a dense parameter), so I plain SGD
steps of rate ``eta`` take ``w_m`` to ``xi_k + (1 - 2 eta a_km)^I (w_m - xi_k)``, whatever
the batch order. Client sizes ``n_k`` are unbalanced, K < N, and one row is held by nobody,
so Scheme II's rescaling of the old model (``f = (N/K) sum_{S_t} p_k != 1``) shows on it.
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
from fedsub.engine.loop import train
from fedsub.engine.schedule import Schedule
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params

ROWS = 5  # row 4 is held by no client
HELD = [{0: 1, 1: 2}, {1: 1}, {2: 3, 0: 1}, {3: 1, 1: 1}, {2: 1}, {0: 2, 3: 1}]
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


def local_model(k: int, w: np.ndarray, b: float, lr: float) -> tuple[np.ndarray, float]:
    """Client k's model after ``STEPS`` SGD steps from (w, b), in closed form."""
    xi, out = LABELS[k], w.copy()
    for m, a in HELD[k].items():
        out[m] = xi + (1 - 2 * lr * a) ** STEPS * (w[m] - xi)
    return out, xi + (1 - 2 * lr) ** STEPS * (b - xi)


def by_hand(scheme: str, rounds: int) -> tuple[np.ndarray, float, list[float]]:
    """The global model after ``rounds`` rounds of ``fedavg@scheme``, and each round's f."""
    n = len(SIZES)
    p = np.array(SIZES) / sum(SIZES)
    w, b, factors = np.full(ROWS, W0), B0, []
    sampling = "proportional-with-replacement" if scheme == "scheme1" else "uniform"
    for r in range(1, rounds + 1):
        cohort = sample_cohort(sampling, SEED, r, np.array(SIZES), K)
        locals_ = {}
        for k in cohort.clients:
            lr = LR * p[k] * n if scheme == "transformed-scheme2" else LR
            locals_[int(k)] = local_model(int(k), w, b, lr)
        if scheme == "scheme2":  # the paper: w_{t+1} = (N/K) sum_{S_t} p_k w_k
            f = n / K * sum(p[k] for k in locals_)
            w = sum(n / K * p[k] * wk for k, (wk, _) in locals_.items())
            b = sum(n / K * p[k] * bk for k, (_, bk) in locals_.items())
            factors.append(f)
            continue
        if scheme == "scheme2-delta":  # fedsub's: the old model keeps weight 1
            a = {k: n / K * p[k] for k in locals_}
        elif scheme == "original":  # McMahan et al.: w + sum_{S_t} p_k (w_k - w)
            a = {k: p[k] for k in locals_}
        else:  # scheme1 (each draw counts) and transformed-scheme2: plain average
            drawn = dict(zip(cohort.clients.tolist(), cohort.multiplicity.tolist(), strict=True))
            a = {k: drawn[k] / K for k in locals_}
        w = w + sum(a[k] * (wk - w) for k, (wk, _) in locals_.items())
        b = b + sum(a[k] * (bk - b) for k, (_, bk) in locals_.items())
    return w, b, factors


def engine(scheme: str, rounds: int, backend: str) -> Params:
    dataset = federation()
    index = SubmodelIndex.build(dataset)
    context = AlgorithmContext(dataset, index, "samples", K)
    algorithm = build_algorithm(f"fedavg@{scheme}", context)
    schedule = Schedule(
        rounds, K, STEPS, batch_size=1, lr=LR, seed=SEED, dtype=torch.float64, backend=backend
    )
    return train(QuadraticWithBias(), algorithm, dataset, index, schedule)


SCHEMES = ["scheme1", "scheme2", "scheme2-delta", "transformed-scheme2", "original"]


@pytest.mark.parametrize("backend", ["sequential", "batched"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_scheme_is_its_formula_over_three_rounds(scheme, backend):
    counts = np.array(SIZES)
    draws = [sample_cohort("proportional-with-replacement", SEED, r, counts, K) for r in (1, 2, 3)]
    assert max(d.multiplicity.max() for d in draws) == 2  # Scheme I counts a repeated draw
    w, b, _ = by_hand(scheme, 3)
    got = engine(scheme, 3, backend)
    np.testing.assert_allclose(got.tables["w"][:, 0].numpy(), w, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.dense["b"].numpy(), [b], rtol=0, atol=1e-12)


def test_scheme2_rescales_the_whole_old_model_by_f():
    """The row nobody holds is W0 * f_1 f_2 f_3 under the paper's Scheme II and stays W0
    under the delta form; the draws here give f != 1, so the two differ."""
    w, _, factors = by_hand("scheme2", 3)
    assert min(abs(f - 1) for f in factors) > 0.05  # unbalanced p_k: f is not 1
    assert w[4] == pytest.approx(W0 * np.prod(factors), abs=1e-12)
    got = engine("scheme2", 3, "batched").tables["w"][4, 0].item()
    assert got == pytest.approx(W0 * np.prod(factors), abs=1e-12)
    assert engine("scheme2-delta", 3, "batched").tables["w"][4, 0].item() == W0


def test_transformed_scheme2_scales_each_clients_lr_by_p_k_n():
    """The same rounds with the unscaled rate are another model: the scaling is in the run."""
    w, _, _ = by_hand("transformed-scheme2", 2)
    unscaled, _, _ = by_hand("scheme1", 2)  # sanity: the formulas differ on this data
    assert np.abs(w - unscaled).max() > 1e-3
    got = engine("transformed-scheme2", 2, "sequential").tables["w"][:, 0].numpy()
    plain = engine("scheme2-delta", 2, "sequential").tables["w"][:, 0].numpy()
    np.testing.assert_allclose(got, w, rtol=0, atol=1e-12)
    assert np.abs(got - plain).max() > 1e-3
