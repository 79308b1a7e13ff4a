"""Server optimizers against torch.optim and hand-written reference formulas."""

import numpy as np
import pytest
import torch

from fedsub.algorithms.aggregation import RowUpdate, ServerUpdate
from fedsub.algorithms.server_optimizer import ServerMomentum, ServerYogi, TorchServerOptimizer
from fedsub.submodel.params import Params

ROWS, DIM = 6, 2


def rounds_of_updates(seed: int, count: int, touch_all: bool):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        rows = np.arange(ROWS) if touch_all else np.sort(rng.choice(ROWS, 3, replace=False))
        yield ServerUpdate(
            {
                "t": RowUpdate(
                    torch.from_numpy(rows), torch.from_numpy(rng.normal(size=(len(rows), DIM)))
                )
            },
            {"b": torch.from_numpy(rng.normal(size=3))},
        )


def fresh_params() -> Params:
    rng = np.random.default_rng(9)
    return Params(
        {"t": torch.from_numpy(rng.normal(size=(ROWS, DIM)))},
        {"b": torch.from_numpy(rng.normal(size=3))},
    )


@pytest.mark.parametrize("kind", ["adam", "adagrad"])
def test_fedadam_and_fedadagrad_step_like_torch_optim_on_the_negated_mean_delta(kind):
    params = fresh_params()
    reference = [t.clone() for t in (params.tables["t"], params.dense["b"])]
    lr, b1, b2, tau = 0.05, 0.9, 0.99, 1e-3
    ours = TorchServerOptimizer(kind, params, lr, b1, b2, tau)
    if kind == "adam":
        torch_opt = torch.optim.Adam(reference, lr=lr, betas=(b1, b2), eps=tau)
    else:
        torch_opt = torch.optim.Adagrad(reference, lr=lr, eps=tau)
    for update in rounds_of_updates(0, 6, touch_all=True):
        ours.apply(params, update)
        reference[0].grad = -update.tables["t"].values.clone()
        reference[1].grad = -update.dense["b"].clone()
        torch_opt.step()
    torch.testing.assert_close(params.tables["t"], reference[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(params.dense["b"], reference[1], rtol=1e-12, atol=1e-12)


def test_adaptive_tables_are_lazy_rows_not_touched_do_not_move():
    params = fresh_params()
    before = params.tables["t"].clone()
    ours = TorchServerOptimizer("adam", params, 0.1)
    touched = set()
    for update in rounds_of_updates(1, 3, touch_all=False):
        ours.apply(params, update)
        touched |= set(update.tables["t"].rows.tolist())
    untouched = [r for r in range(ROWS) if r not in touched]
    assert untouched  # the draw leaves some row out
    assert torch.equal(params.tables["t"][untouched], before[untouched])
    assert not torch.equal(params.tables["t"][sorted(touched)], before[sorted(touched)])


def test_fedyogi_matches_the_formula_of_reddi_et_al():
    params = fresh_params()
    x = {"t": params.tables["t"].numpy().copy(), "b": params.dense["b"].numpy().copy()}
    lr, b1, b2, tau = 0.05, 0.9, 0.99, 1e-3
    m = {k: np.zeros_like(v) for k, v in x.items()}
    v = {k: np.full_like(val, tau**2) for k, val in x.items()}
    ours = ServerYogi(params, lr, b1, b2, tau)
    for update in rounds_of_updates(2, 5, touch_all=False):
        ours.apply(params, update)
        rows = update.tables["t"].rows.numpy()
        for key, u, index in (
            ("t", update.tables["t"].values.numpy(), rows),
            ("b", update.dense["b"].numpy(), slice(None)),
        ):
            m[key][index] = b1 * m[key][index] + (1 - b1) * u
            v[key][index] = v[key][index] - (1 - b2) * u**2 * np.sign(v[key][index] - u**2)
            x[key][index] += lr * m[key][index] / (np.sqrt(v[key][index]) + tau)
    np.testing.assert_allclose(params.tables["t"].numpy(), x["t"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(params.dense["b"].numpy(), x["b"], rtol=0, atol=1e-12)


def test_scaffold_approximation_is_equation_47():
    params = fresh_params()
    x = params.tables["t"].numpy().copy()
    beta = 0.75  # (N - K) / N with N = 4, K = 1
    previous = np.zeros_like(x)
    ours = ServerMomentum(params, beta)
    for update in rounds_of_updates(3, 5, touch_all=False):
        ours.apply(params, update)
        mean_update = np.zeros_like(x)
        mean_update[update.tables["t"].rows.numpy()] = update.tables["t"].values.numpy()
        previous = beta * previous + (1 - beta) * mean_update
        x += previous
    np.testing.assert_allclose(params.tables["t"].numpy(), x, rtol=0, atol=1e-12)
