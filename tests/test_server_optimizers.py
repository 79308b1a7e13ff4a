"""Server optimizers against their formulas written out by hand (Reddi et al.'s Algorithm 2,
seed 002's equation 47)."""

import numpy as np
import pytest
import torch

from fedsub.algorithms.adaptive import AdaptiveRule, AdaptiveServer
from fedsub.algorithms.aggregation import RowUpdate, ServerUpdate
from fedsub.algorithms.server_optimizer import ServerMomentum
from fedsub.engine.execution import Execution
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
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


def reddi_by_hand(kind: str, x0: dict, updates: list, lr, b1, b2, tau, lazy: bool) -> dict:
    """Reddi et al.'s Algorithm 2 written out in numpy, with Delta_t the round's aggregate:
    m = b1 m + (1 - b1) Delta; v by the rule; x += lr m / (sqrt(v) + tau); m0 = 0, v0 =
    tau^2, no bias correction. Over the full table (Delta = 0 on untouched rows) or, ``lazy``,
    on the touched rows only; the dense parameter every round."""
    x = {k: val.numpy().copy() for k, val in x0.items()}
    m = {k: np.zeros_like(val) for k, val in x.items()}
    v = {k: np.full_like(val, tau**2) for k, val in x.items()}
    for update in updates:
        rows = update.tables["t"].rows.numpy()
        table_delta = update.tables["t"].values.numpy()
        if not lazy:
            rows, table_delta = slice(None), dense_aggregate(update).numpy()
        for key, d, at in (("t", table_delta, rows), ("b", update.dense["b"].numpy(), slice(None))):
            m[key][at] = b1 * m[key][at] + (1 - b1) * d
            if kind == "adagrad":
                v[key][at] = v[key][at] + d**2
            elif kind == "yogi":
                v[key][at] = v[key][at] - (1 - b2) * d**2 * np.sign(v[key][at] - d**2)
            else:
                v[key][at] = b2 * v[key][at] + (1 - b2) * d**2
            x[key][at] += lr * m[key][at] / (np.sqrt(v[key][at]) + tau)
    return x


KINDS = ["adam", "adagrad", "yogi"]


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_adaptive_servers_are_the_formulas_of_reddi_et_al(kind, lazy):
    """Eight rounds in which rows go untouched for several rounds (the full-model form moves
    them on their decaying m, the lazy one leaves them), tables and the dense parameter."""
    params = fresh_params()
    x0 = {"t": params.tables["t"].clone(), "b": params.dense["b"].clone()}
    lr, b1, b2, tau = 0.05, 0.8, 0.95, 1e-2
    updates = list(sparse_rounds(2))
    ours = AdaptiveServer(params, AdaptiveRule(kind, lr, b1, b2, tau), lazy=lazy)
    for round_index, update in enumerate(updates):
        before = params.tables["t"].clone()
        ours.apply(params, update)
        x = reddi_by_hand(kind, x0, updates[: round_index + 1], lr, b1, b2, tau, lazy)
        np.testing.assert_allclose(params.tables["t"].numpy(), x["t"], rtol=0, atol=1e-12)
        np.testing.assert_allclose(params.dense["b"].numpy(), x["b"], rtol=0, atol=1e-12)
        if 1 <= round_index <= 4:  # row 5 untouched: moves on its m in the full-model form
            assert torch.equal(params.tables["t"][5], before[5]) == lazy
    other = reddi_by_hand(kind, x0, updates, lr, b1, b2, tau, not lazy)
    assert np.abs(other["t"] - x["t"]).max() > 1e-6  # the two forms differ on this data


def test_the_adaptive_server_is_the_full_model_form_unless_asked_to_be_lazy():
    params, x0 = fresh_params(), fresh_params()
    updates = list(sparse_rounds(3))
    server = AdaptiveServer(params, AdaptiveRule("adam", 0.05))
    for update in updates:
        server.apply(params, update)
    x = reddi_by_hand(
        "adam",
        {"t": x0.tables["t"], "b": x0.dense["b"]},
        updates,
        0.05,
        0.9,
        0.99,
        1e-3,
        lazy=False,
    )
    np.testing.assert_allclose(params.tables["t"].numpy(), x["t"], rtol=0, atol=1e-12)
    assert not server.row_local


@pytest.mark.parametrize("kind", KINDS)
def test_each_preset_builds_its_form_of_the_rule(kind):
    """fed<kind> and fedsubavg-<kind> are Reddi's full-model form, fed<kind>-lazy the lazy
    one, each with its preset's options."""
    from fedsub.algorithms.registry import AlgorithmContext, build_algorithm, options_class
    from fedsub.submodel.index import SubmodelIndex

    from .test_backends import two_tables_with_dense

    dataset = two_tables_with_dense(0)
    context = AlgorithmContext(dataset, SubmodelIndex.build(dataset), "samples", 5)
    for name, lazy in (
        (f"fed{kind}", False),
        (f"fed{kind}-lazy", True),
        (f"fedsubavg-{kind}", False),
    ):
        options = options_class(name)(server_lr=0.07, beta1=0.8, beta2=0.95, tau=0.02)
        server = build_algorithm(name, context, options).make_server(fresh_params())
        assert isinstance(server, AdaptiveServer) and server.lazy == lazy == server.row_local
        beta2 = 0.95 if kind != "adagrad" else server.rule.beta2  # Adagrad has no beta2
        assert server.rule == AdaptiveRule(kind, 0.07, 0.8, beta2, 0.02)


def test_the_three_rules_differ_only_in_v():
    """One round from m = 0, v = tau^2 by hand, per rule, for one coordinate Delta = 0.3:
    FedAdam's step is lr (1 - b1) Delta / (sqrt(b2 tau^2 + (1 - b2) Delta^2) + tau), not
    torch.optim.Adam's bias-corrected lr Delta / (|Delta| + tau)."""
    lr, b1, b2, tau, delta = 0.1, 0.9, 0.99, 1e-3, 0.3
    v = {
        "adam": b2 * tau**2 + (1 - b2) * delta**2,
        "adagrad": tau**2 + delta**2,
        "yogi": tau**2 + (1 - b2) * delta**2,  # sign(tau^2 - Delta^2) = -1
    }
    for kind in KINDS:
        params = Params({}, {"b": torch.zeros(1, dtype=torch.float64)})
        server = AdaptiveServer(params, AdaptiveRule(kind, lr, b1, b2, tau))
        server.apply(params, ServerUpdate({}, {"b": torch.tensor([delta], dtype=torch.float64)}))
        expected = lr * (1 - b1) * delta / (np.sqrt(v[kind]) + tau)
        assert params.dense["b"].item() == pytest.approx(expected, rel=1e-12)
    assert expected != pytest.approx(lr * delta / (delta + tau), rel=1e-2)


def test_lazy_adaptive_server_leaves_untouched_rows_and_their_moments_alone():
    params = fresh_params()
    before = params.tables["t"].clone()
    ours = AdaptiveServer(params, AdaptiveRule("adam", 0.1), lazy=True)
    touched = set()
    for update in rounds_of_updates(1, 3, touch_all=False):
        ours.apply(params, update)
        touched |= set(update.tables["t"].rows.tolist())
    untouched = [r for r in range(ROWS) if r not in touched]
    assert untouched  # the draw leaves some row out
    assert torch.equal(params.tables["t"][untouched], before[untouched])
    assert not torch.equal(params.tables["t"][sorted(touched)], before[sorted(touched)])
    state = ours.state_tensors()
    np.testing.assert_array_equal(state["adam.lazy.m.t"][untouched].numpy(), 0.0)
    np.testing.assert_array_equal(state["adam.lazy.v.t"][untouched].numpy(), 1e-3**2)  # tau^2


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
    torch.testing.assert_close(resumed_params.dense["b"], params.dense["b"], rtol=0, atol=0)


@pytest.mark.parametrize("lr", [1.0, 0.5])
def test_scaffold_approximation_is_equation_47(lr):
    """Seed 002, appendix D.2, eq. 47: u = beta u + (1 - beta) aggregate, x += lr u, over
    every row (untouched rows keep moving on u) and the dense parameter."""
    params = fresh_params()
    x, b = params.tables["t"].numpy().copy(), params.dense["b"].numpy().copy()
    beta = 0.75  # (N - K) / N with N = 4, K = 1
    previous, previous_b = np.zeros_like(x), np.zeros_like(b)
    ours = ServerMomentum(params, beta, lr)
    for update in rounds_of_updates(3, 5, touch_all=False):
        ours.apply(params, update)
        mean_update = np.zeros_like(x)
        mean_update[update.tables["t"].rows.numpy()] = update.tables["t"].values.numpy()
        previous = beta * previous + (1 - beta) * mean_update
        previous_b = beta * previous_b + (1 - beta) * update.dense["b"].numpy()
        x += lr * previous
        b += lr * previous_b
        np.testing.assert_allclose(params.tables["t"].numpy(), x, rtol=0, atol=1e-12)
        np.testing.assert_allclose(params.dense["b"].numpy(), b, rtol=0, atol=1e-12)


def first_round(name: str, dataset, options=None):
    from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
    from fedsub.engine.in_process import train
    from fedsub.engine.initial import initial_params
    from fedsub.models.sparse_lr import SparseLogisticRegression
    from fedsub.submodel.index import SubmodelIndex

    index = SubmodelIndex.build(dataset)
    model = SparseLogisticRegression(dict(dataset.table_rows), dense_dim=dataset.train.dense_dim)
    schedule = Schedule(
        1,
        5,
        local=LocalWork(3, 2, ClientStep(lr=0.3)),
        seed=1,
        execution=Execution(dtype=torch.float64),
    )
    context = AlgorithmContext(dataset, index, "samples", 5)
    algorithm = build_algorithm(name, context, options)
    return initial_params(model, schedule), train(model, algorithm, dataset, index, schedule)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", ["fed{}", "fed{}-lazy", "fedsubavg-{}"])
def test_adaptive_presets_first_round_is_the_closed_form_on_the_aggregate(kind, form):
    """Round 1 from m = 0, v = tau^2: x + lr (1 - b1) u / (sqrt(v1) + tau) with
    v1 = b2 tau^2 + (1 - b2) u^2 (Adam), tau^2 + u^2 (Adagrad),
    tau^2 - (1 - b2) u^2 sign(tau^2 - u^2) (Yogi), u the round's aggregate: FedSubAvg's (heat
    coefficients) or FedAvg's; tables and dense parameters, every preset's options."""
    from fedsub.algorithms.registry import options_class

    from .test_backends import two_tables_with_dense

    dataset = two_tables_with_dense(0)
    adaptive = form.format(kind)
    plain = "fedsubavg" if adaptive.startswith("fedsubavg") else "fedavg"
    lr, b1, b2, tau = 0.07, 0.8, 0.95, 1e-2
    options = options_class(adaptive)(server_lr=lr, beta1=b1, beta2=b2, tau=tau)
    x0, averaged = first_round(plain, dataset)
    _, ours = first_round(adaptive, dataset, options)
    for name, start in x0.state_dict().items():
        u = averaged.state_dict()[name] - start
        v = {
            "adam": b2 * tau**2 + (1 - b2) * u**2,
            "adagrad": tau**2 + u**2,
            "yogi": tau**2 - (1 - b2) * u**2 * torch.sign(tau**2 - u**2),
        }[kind]
        expected = start + lr * (1 - b1) * u / (v.sqrt() + tau)
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

    params = fresh_params()
    saver = AdaptiveServer(params, AdaptiveRule("adam", 0.1), lazy=not lazy)
    saver.apply(params, next(sparse_rounds(0)))
    loads = AdaptiveServer(fresh_params(), AdaptiveRule("adam", 0.1), lazy=lazy)
    with pytest.raises(FedsubError, match="resume with the matching algorithm"):
        loads.load_state_tensors(saver.state_tensors())
    other_rule = AdaptiveServer(fresh_params(), AdaptiveRule("yogi", 0.1), lazy=not lazy)
    with pytest.raises(ValueError, match="expected tensors"):
        other_rule.load_state_tensors(saver.state_tensors())


def test_a_checkpoint_of_the_earlier_torch_optim_servers_is_refused_by_name():
    """fedsub's earlier FedAdam / FedAdagrad were torch.optim.Adam (bias-corrected) and
    Adagrad (no first moment); their saved state (step, exp_avg, sum ...) cannot become
    Reddi et al.'s m and v, so a resume says so instead of restarting the moments."""
    from fedsub.errors import FedsubError

    old_full = {"full.0.step": torch.tensor(3.0), "full.0.exp_avg": torch.zeros(ROWS, DIM)}
    old_lazy = {"table.t.row.sum": torch.zeros(ROWS, DIM), "dense.0.sum": torch.zeros(3)}
    for saved, lazy in ((old_full, False), (old_lazy, True)):
        server = AdaptiveServer(fresh_params(), AdaptiveRule("adagrad", 0.1), lazy=lazy)
        with pytest.raises(FedsubError, match=r"earlier torch\.optim-based"):
            server.load_state_tensors(saved)


def test_a_checkpoint_of_the_earlier_fedyogi_resumes():
    """fedsub's earlier FedYogi was already Reddi's rule, saved as ``m.<name>``/``v.<name>``."""
    params = fresh_params()
    ours = AdaptiveServer(params, AdaptiveRule("yogi", 0.05))
    for update in list(sparse_rounds(4))[:3]:
        ours.apply(params, update)
    earlier = {k.split(".", 2)[2]: v for k, v in ours.state_tensors().items()}
    assert set(earlier) == {"m.t", "m.b", "v.t", "v.b"}
    resumed = AdaptiveServer(fresh_params(), AdaptiveRule("yogi", 0.05))
    resumed.load_state_tensors(earlier)
    for key, value in ours.state_tensors().items():
        assert torch.equal(resumed.state_tensors()[key], value)


@pytest.mark.parametrize("lr", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_server_sgd_adds_an_every_row_update_as_the_scatter_does_bit_for_bit(lr, dtype):
    """An update of every row (DP's rows = "all": rows 0 .. V - 1) is added to the whole table
    (``every_row``), a sparse one scattered: both the numbers of ``index_add_`` of lr times the
    values, to the last bit (float64 values into a float32 table included); a deterministic
    run keeps the scatter."""
    from fedsub.algorithms.server_optimizer import ServerSGD, every_row
    from fedsub.numerics.segment_sum import deterministic_run

    rng = np.random.default_rng(3)
    for rows in (np.arange(ROWS), np.array([0, 2, 5])):
        values = torch.from_numpy(rng.normal(size=(len(rows), DIM)))
        params = Params({"t": torch.from_numpy(rng.normal(size=(ROWS, DIM))).to(dtype)}, {})
        expected = (
            params.tables["t"]
            .clone()
            .index_add_(0, torch.from_numpy(rows), (lr * values).to(dtype))
        )
        update = ServerUpdate({"t": RowUpdate(torch.from_numpy(rows), values)}, {})
        assert every_row(update.tables["t"], params.tables["t"]) == (len(rows) == ROWS)
        ServerSGD(lr).apply(params, update)
        assert torch.equal(params.tables["t"], expected)
        assert params.tables["t"].view(torch.int8).equal(expected.view(torch.int8))
    with deterministic_run(True):
        whole = RowUpdate(torch.arange(ROWS), torch.zeros(ROWS, DIM))
        assert not every_row(whole, torch.zeros(ROWS, DIM))
