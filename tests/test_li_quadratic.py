"""Seed 004's Theorem 4 counterexample (appendix C) run through fedsub's round loop:
``li-quadratic`` + ``linear-regression`` + FedAvg with all N devices, E full-gradient local
steps and a constant learning rate. The references are the paper's formulas written out here
from its definitions (A tridiagonal, B_k the block Laplacians, A_1 = B_1 + E_11,
A_N = B_N + E_(Np+1,Np+1)): the round map ``w <- M w + c`` of C.4 and its fixed point (28)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.data import li_quadratic
from fedsub.data.li_quadratic import LiQuadraticOptions
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule, lr_at
from fedsub.models.linear_regression import LinearRegression
from fedsub.submodel.index import SubmodelIndex

N, P, MU = 5, 4, 2e-4  # appendix C.2's N, p, mu
DIM = N * P + 1


def paper_matrices(n: int = N, p: int = P) -> tuple[list[np.ndarray], np.ndarray]:
    """A_k and b as appendix C.1 defines them."""
    dim = n * p + 1
    blocks = []
    for k in range(n):
        b_k = np.zeros((dim, dim))
        lo = k * p  # block I_k = {kp, ..., kp + p} (0-based)
        for i in range(p + 1):
            b_k[lo + i, lo + i] = 1.0 if i in (0, p) else 2.0
            if i < p:
                b_k[lo + i, lo + i + 1] = b_k[lo + i + 1, lo + i] = -1.0
        blocks.append(b_k)
    blocks[0][0, 0] += 1.0
    blocks[-1][-1, -1] += 1.0
    b = np.zeros(dim)
    b[0] = 1.0
    return blocks, b


def round_map(lr: float, steps: int, n: int = N, p: int = P) -> tuple[np.ndarray, np.ndarray]:
    """C.4: w_(t+1) = (1/N) sum_k (I - lr A_k')^E w_t + (lr/N) sum_(l<E) (I - lr A_1')^l b,
    with A_k' = A_k + mu I (the paper's mu > 0 case)."""
    matrices, b = paper_matrices(n, p)
    eye = np.eye(n * p + 1)
    m = sum(np.linalg.matrix_power(eye - lr * (a + MU * eye), steps) for a in matrices) / n
    first = eye - lr * (matrices[0] + MU * eye)
    c = lr / n * sum(np.linalg.matrix_power(first, j) for j in range(steps)) @ b
    return m, c


def fedsub_fedavg(lr: float, steps: int, rounds: int, n: int = N, p: int = P) -> np.ndarray:
    dataset = li_quadratic.generate(LiQuadraticOptions(n, p), seed=0)
    index = SubmodelIndex.build(dataset)
    schedule = Schedule(
        rounds,
        n,
        local=LocalWork(steps, p + 1, ClientStep(lr=lr, weight_decay=MU)),
        seed=0,
        execution=Execution(dtype=torch.float64),
        eval_every=rounds,
    )
    algorithm = build_algorithm("fedavg", AlgorithmContext(dataset, index, "samples"))
    final = train(LinearRegression(n * p + 1), algorithm, dataset, index, schedule)
    return final.dense["weight"].numpy()


def test_the_devices_hold_the_papers_partition():
    dataset = li_quadratic.generate(LiQuadraticOptions(N, P), seed=0)
    matrices, b = paper_matrices()
    assert list(dataset.sample_counts()) == [P + 1] * N  # balanced (C.3)
    x, y = dataset.train.dense, dataset.train.labels
    offsets = dataset.client_offsets
    for k, (lo, hi) in enumerate(itertools.pairwise(offsets)):
        mean_gram = x[lo:hi].T @ x[lo:hi] / (P + 1)  # the mean loss's Hessian
        np.testing.assert_allclose(mean_gram, matrices[k], atol=1e-12)
        np.testing.assert_allclose(x[lo:hi].T @ y[lo:hi] / (P + 1), b if k == 0 else 0 * b)
    a = sum(matrices)
    np.testing.assert_array_equal(a, 2 * np.eye(DIM) - np.eye(DIM, k=1) - np.eye(DIM, k=-1))


@pytest.mark.parametrize("steps", [1, 5])
def test_fedavg_rounds_follow_the_papers_round_map(steps):
    lr, rounds = 0.2, 40
    m, c = round_map(lr, steps)
    w = np.zeros(DIM)
    for _ in range(rounds):
        w = m @ w + c
    np.testing.assert_allclose(fedsub_fedavg(lr, steps, rounds), w, rtol=0, atol=1e-12)


def test_constant_lr_fedavg_converges_to_eq28_not_to_the_optimum():
    """E = 10, eta = 0.2 (< 1/4) on a smaller instance (N = 3, p = 2: the paper's N = 5,
    p = 4 needs some 2,500 rounds): after 300 rounds (rho^300 ~ 1e-10) fedsub's model is the
    paper's limit (28), far from w*."""
    n, p, lr, steps = 3, 2, 0.2, 10
    dim = n * p + 1
    m, c = round_map(lr, steps, n, p)
    limit = np.linalg.solve(np.eye(dim) - m, c)  # (28)
    matrices, b = paper_matrices(n, p)
    optimum = np.linalg.solve(sum(matrices) + n * MU * np.eye(dim), b)
    w = fedsub_fedavg(lr, steps, 300, n, p)
    np.testing.assert_allclose(w, limit, rtol=0, atol=1e-9)
    assert np.linalg.norm(w - optimum) > 0.1


def test_the_modules_closed_forms_are_the_papers():
    """What `fedsub reproduce 004-fig2` plots against: (28) and w*, at the paper's size."""
    options = LiQuadraticOptions(N, P)
    for lr, steps in ((0.04, 1), (0.04, 10), (0.2, 20)):
        m, c = round_map(lr, steps)
        limit = np.linalg.solve(np.eye(DIM) - m, c)
        np.testing.assert_allclose(
            li_quadratic.fedavg_limit(options, MU, lr, steps), limit, atol=1e-10
        )
    matrices, b = paper_matrices()
    optimum = np.linalg.solve(sum(matrices) + N * MU * np.eye(DIM), b)
    np.testing.assert_allclose(li_quadratic.optimum(options, MU), optimum, atol=1e-12)
    w_star_mu0 = 1 - np.arange(1, DIM + 1) / (DIM + 1)  # Proposition 1 (4), mu = 0
    np.testing.assert_allclose(li_quadratic.optimum(options, 0.0), w_star_mu0, atol=1e-12)
    gap = li_quadratic.objective(options, MU, optimum + 0.01) - li_quadratic.objective(
        options, MU, optimum
    )
    assert gap > 0


def test_with_one_local_step_the_limit_is_the_optimum():
    """E = 1 is gradient descent: (28) is w* (C.4, case (1))."""
    m, c = round_map(0.2, 1)
    matrices, b = paper_matrices()
    optimum = np.linalg.solve(sum(matrices) + N * MU * np.eye(DIM), b)
    np.testing.assert_allclose(np.linalg.solve(np.eye(DIM) - m, c), optimum, atol=1e-10)


def test_inverse_time_schedule_is_c2s_annealing():
    """eta_t = (1/5) / (5 + t a) with a = 1e-2: base 1/25, lr_decay = a / 5."""
    step = ClientStep(lr=0.04, lr_schedule="inverse-time", lr_decay=0.002)
    for t in (0, 1, 10, 1000):
        assert lr_at(0.04, step, t + 1) == pytest.approx((1 / 5) / (5 + t * 1e-2))
