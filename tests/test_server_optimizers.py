"""Server optimizers against torch.optim and hand-written reference formulas."""

import numpy as np
import pytest
import torch

from fedsub.algorithms.aggregation import RowUpdate, ServerUpdate
from fedsub.algorithms.server_optimizer import (
    LazyTorchServerOptimizer,
    ServerMomentum,
    ServerYogi,
    TorchServerOptimizer,
)
from fedsub.engine.schedule import Schedule
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


def sparse_rounds(seed: int):
    """Rows 2..5 are untouched in rounds 2-5, row 5 in rounds 2-7; the bias every round."""
    rng = np.random.default_rng(seed)
    for rows in ([0, 1, 2, 3, 4, 5], [0, 1], [1], [0], [0, 1], [2, 4], [3], [0, 5]):
        yield ServerUpdate(
            {
                "t": RowUpdate(
                    torch.tensor(rows), torch.from_numpy(rng.normal(size=(len(rows), DIM)))
                )
            },
            {"b": torch.from_numpy(rng.normal(size=3))},
        )


def dense_aggregate(update: ServerUpdate) -> torch.Tensor:
    full = torch.zeros(ROWS, DIM, dtype=torch.float64)
    full[update.tables["t"].rows] = update.tables["t"].values
    return full


@pytest.mark.parametrize("kind", ["adam", "adagrad"])
def test_fedadam_and_fedadagrad_equal_torch_optim_on_the_dense_pseudo_gradient(kind):
    params = fresh_params()
    reference = [t.clone() for t in (params.tables["t"], params.dense["b"])]
    lr, b1, b2, tau = 0.05, 0.9, 0.99, 1e-3
    ours = TorchServerOptimizer(kind, params, lr, b1, b2, tau)
    if kind == "adam":
        torch_opt = torch.optim.Adam(reference, lr=lr, betas=(b1, b2), eps=tau)
    else:
        torch_opt = torch.optim.Adagrad(reference, lr=lr, eps=tau)
    for round_index, update in enumerate(sparse_rounds(0)):
        before = params.tables["t"].clone()
        ours.apply(params, update)
        reference[0].grad = -dense_aggregate(update)
        reference[1].grad = -update.dense["b"].clone()
        torch_opt.step()
        torch.testing.assert_close(params.tables["t"], reference[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(params.dense["b"], reference[1], rtol=1e-12, atol=1e-12)
        if kind == "adam" and round_index in (1, 2, 3, 4):
            # untouched rows keep moving on their first moment: not the lazy variant
            assert not torch.equal(params.tables["t"][5], before[5])


@pytest.mark.parametrize("kind", ["adam", "adagrad"])
def test_lazy_fedadam_and_fedadagrad_equal_torch_optim_when_every_row_is_touched(kind):
    params = fresh_params()
    reference = [t.clone() for t in (params.tables["t"], params.dense["b"])]
    lr, b1, b2, tau = 0.05, 0.9, 0.99, 1e-3
    ours = LazyTorchServerOptimizer(kind, params, lr, b1, b2, tau)
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


def test_lazy_fedadam_leaves_untouched_rows_and_their_moments_alone():
    params = fresh_params()
    before = params.tables["t"].clone()
    ours = LazyTorchServerOptimizer("adam", params, 0.1)
    touched = set()
    for update in rounds_of_updates(1, 3, touch_all=False):
        ours.apply(params, update)
        touched |= set(update.tables["t"].rows.tolist())
    untouched = [r for r in range(ROWS) if r not in touched]
    assert untouched  # the draw leaves some row out
    assert torch.equal(params.tables["t"][untouched], before[untouched])
    assert not torch.equal(params.tables["t"][sorted(touched)], before[sorted(touched)])
    moments = ours.state_tensors()["table.t.row.exp_avg"]
    assert torch.equal(moments[untouched], torch.zeros_like(moments[untouched]))


def reference_yogi(x0: dict, updates: list, lr, b1, b2, tau, lazy: bool) -> dict:
    """Reddi et al.'s Yogi written out in numpy: on the full table (u = 0 for untouched rows),
    or, ``lazy``, on the touched rows only."""
    x = {k: v.numpy().copy() for k, v in x0.items()}
    m = {k: np.zeros_like(v) for k, v in x.items()}
    v = {k: np.full_like(val, tau**2) for k, val in x.items()}
    for update in updates:
        rows = update.tables["t"].rows.numpy()
        table_u = update.tables["t"].values.numpy()
        if not lazy:
            rows, table_u = slice(None), dense_aggregate(update).numpy()
        for key, u, index in (("t", table_u, rows), ("b", update.dense["b"].numpy(), slice(None))):
            m[key][index] = b1 * m[key][index] + (1 - b1) * u
            v[key][index] = v[key][index] - (1 - b2) * u**2 * np.sign(v[key][index] - u**2)
            x[key][index] += lr * m[key][index] / (np.sqrt(v[key][index]) + tau)
    return x


@pytest.mark.parametrize("lazy", [False, True])
def test_fedyogi_matches_the_formula_of_reddi_et_al(lazy):
    params = fresh_params()
    x0 = {"t": params.tables["t"].clone(), "b": params.dense["b"].clone()}
    lr, b1, b2, tau = 0.05, 0.9, 0.99, 1e-3
    updates = list(sparse_rounds(2))
    ours = ServerYogi(params, lr, b1, b2, tau, lazy=lazy)
    for update in updates:
        ours.apply(params, update)
    x = reference_yogi(x0, updates, lr, b1, b2, tau, lazy)
    np.testing.assert_allclose(params.tables["t"].numpy(), x["t"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(params.dense["b"].numpy(), x["b"], rtol=0, atol=1e-12)
    other = reference_yogi(x0, updates, lr, b1, b2, tau, not lazy)
    assert np.abs(other["t"] - x["t"]).max() > 1e-6  # the two forms differ on this data


@pytest.mark.parametrize("name", ["fedadam", "fedadagrad", "fedyogi"])
def test_checkpointed_state_resumes_to_the_same_model(name):
    from fedsub.algorithms.registry import _adaptive_server, options_class

    params, resumed_params = fresh_params(), fresh_params()
    updates = list(sparse_rounds(4))
    make = _adaptive_server(name[3:], options_class(name)(server_lr=0.05), lazy=False)
    ours = make(params)
    for update in updates[:4]:
        ours.apply(params, update)
    resumed_params.tables["t"].copy_(params.tables["t"])
    resumed_params.dense["b"].copy_(params.dense["b"])
    resumed = make(resumed_params)
    resumed.load_state_tensors({k: v.clone() for k, v in ours.state_tensors().items()})
    for update in updates[4:]:
        ours.apply(params, update)
        resumed.apply(resumed_params, update)
    torch.testing.assert_close(resumed_params.tables["t"], params.tables["t"], rtol=0, atol=0)


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


def first_round(name: str, dataset, options=None):
    from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
    from fedsub.engine.loop import initial_params, train
    from fedsub.models.sparse_lr import SparseLogisticRegression
    from fedsub.submodel.index import SubmodelIndex

    index = SubmodelIndex.build(dataset)
    model = SparseLogisticRegression(dict(dataset.table_rows), dense_dim=dataset.train.dense_dim)
    schedule = Schedule(1, 5, local_steps=3, batch_size=2, lr=0.3, seed=1, dtype=torch.float64)
    context = AlgorithmContext(dataset, index, "samples", 5)
    algorithm = build_algorithm(name, context, options)
    return initial_params(model, schedule), train(model, algorithm, dataset, index, schedule)


@pytest.mark.parametrize("kind", ["adam", "adagrad", "yogi"])
@pytest.mark.parametrize("heat", [True, False])
def test_adaptive_presets_first_round_is_the_closed_form_on_the_aggregate(kind, heat):
    """Round 1 from m = 0: Adam and Adagrad move by lr * u / (|u| + tau); Yogi by
    lr (1 - b1) u / (sqrt(v) + tau), v = tau^2 - (1 - b2) u^2 sign(tau^2 - u^2), with u the
    round's aggregate: FedSubAvg's (heat coefficients) or FedAvg's."""
    from fedsub.algorithms.registry import options_class

    from .test_backends import two_tables_with_dense

    dataset = two_tables_with_dense(0)
    plain, adaptive = ("fedsubavg", f"fedsubavg-{kind}") if heat else ("fedavg", f"fed{kind}")
    lr, b1, b2, tau = 0.07, 0.8, 0.95, 1e-2
    options = options_class(adaptive)(server_lr=lr, beta1=b1, beta2=b2, tau=tau)
    x0, averaged = first_round(plain, dataset)
    _, ours = first_round(adaptive, dataset, options)
    for name, start in x0.state_dict().items():
        u = averaged.state_dict()[name] - start
        if kind == "yogi":
            v = tau**2 - (1 - b2) * u**2 * torch.sign(tau**2 - u**2)
            expected = start + lr * (1 - b1) * u / (v.sqrt() + tau)
        else:
            expected = start + lr * u / (u.abs() + tau)
        assert u.abs().max() > 1e-3  # the round moved this parameter
        torch.testing.assert_close(ours.state_dict()[name], expected, rtol=1e-10, atol=1e-12)


def test_fedsubavg_preset_aggregates_with_the_heat_coefficients():
    from .test_backends import two_tables_with_dense

    dataset = two_tables_with_dense(0)
    _, fedavg = first_round("fedavg", dataset)
    _, fedsubavg = first_round("fedsubavg", dataset)
    _, fedavg_adam = first_round("fedadam", dataset)
    _, fedsubavg_adam = first_round("fedsubavg-adam", dataset)
    assert not torch.allclose(fedavg.tables["a"], fedsubavg.tables["a"])
    assert not torch.allclose(fedavg_adam.tables["a"], fedsubavg_adam.tables["a"])


@pytest.mark.parametrize("lazy", [False, True])
def test_resuming_with_the_other_forms_state_is_an_error_not_a_silent_restart(lazy):
    from fedsub.errors import FedsubError

    saved_by, loads = (
        (TorchServerOptimizer, LazyTorchServerOptimizer)
        if lazy
        else (LazyTorchServerOptimizer, TorchServerOptimizer)
    )
    params = fresh_params()
    saver = saved_by("adam", params, 0.1)
    saver.apply(params, next(sparse_rounds(0)))
    with pytest.raises(FedsubError, match="resume with the matching algorithm"):
        loads("adam", fresh_params(), 0.1).load_state_tensors(saver.state_tensors())
