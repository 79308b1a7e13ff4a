"""User-level differential privacy (fedsub/dp): the accountant against dp-accounting computed
here from the config alone and against Balle & Wang's analytic Gaussian mechanism, clipping
against its formula, the noise's distribution, the false-positive sampler against thresholding
noise on every row, unselected rows bit-identical, both backends equal, resume, the budget stop
and the refusals."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import pld, rdp
from scipy import optimize, stats

from fedsub.algorithms.registry import build_algorithm
from fedsub.config import Config
from fedsub.dp import clipping, selection
from fedsub.dp import mechanism as mechanism_lib
from fedsub.dp.mechanism import DpMechanism
from fedsub.dp.settings import (
    Accounting,
    AdaptiveClip,
    DpSettings,
    DpWeights,
    NoiseKey,
    RowSelection,
)
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.engine.loop import Interrupted, RunControl
from fedsub.errors import ConfigError
from fedsub.flower.runtime import FLOWER
from fedsub.runs import experiment
from fedsub.runs.run_setup import dp_of, prepare
from fedsub.submodel.transfer import CohortUpdate

SMALL = [
    "data.num_users=200",
    "data.num_items=300",
    "train.clients_per_round=20",
    "train.rounds=4",
    "train.local_steps=2",
    "eval.every=2",
    "eval.train_loss_samples=200",
    "execution.dtype='float64'",
]
# seeded: these tests compare runs bit for bit (tests/test_dp_secret.py tests the secret default)
DP = ["dp.mechanism='gaussian'", "dp.noise_multiplier=0.8", "dp.clip=0.5", "dp.randomness='seeded'"]


def config(*overrides: str) -> Config:
    return Config.from_toml(None, [*SMALL, *overrides])


# -- the accountant ----------------------------------------------------------------------------


def independent_epsilon(c: Config, rounds: int, num_clients: int) -> float:
    """dp-accounting on the event the config declares, written out here from the config."""
    z, k, n = c.dp.noise_multiplier, c.train.clients_per_round, num_clients
    delta = c.dp.delta if c.dp.delta is not None else n**-1.1
    if c.train.sampling == "poisson":
        event = dp_accounting.PoissonSampledDpEvent(k / n, dp_accounting.GaussianDpEvent(z))
        relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    else:  # replace-one: the sum's sensitivity is 2C, so the event's multiplier is z / 2
        event = dp_accounting.SampledWithoutReplacementDpEvent(
            n, k, dp_accounting.GaussianDpEvent(z / 2)
        )
        relation = dp_accounting.NeighboringRelation.REPLACE_ONE
    if c.dp.accountant == "pld":
        accountant = pld.PLDAccountant(relation, 1e-4)
    else:
        accountant = rdp.RdpAccountant(neighboring_relation=relation)
    accountant.compose(event, rounds)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["train.sampling='poisson'"],
        ["train.sampling='poisson'", "dp.accountant='pld'"],
        ["dp.delta=1e-6"],
    ],
)
def test_the_reported_epsilon_is_dp_accountings_of_the_declared_event(extra):
    c = config(*DP, *extra, "train.algorithms=['fedavg']")
    outcome = experiment.compare(c, None)
    history = outcome.histories["fedavg"]
    assert [e.round for e in history] == [0, 2, 4]
    for evaluation in history[1:]:
        expected = independent_epsilon(c, evaluation.round, 200)
        assert evaluation.metrics["epsilon"] == pytest.approx(expected, rel=0.01)
    assert history[0].metrics["epsilon"] == 0.0
    record = outcome.summary["algorithms"]["fedavg"]["dp"]
    assert record["epsilon"] == history[-1].metrics["epsilon"]
    assert record["noise_multiplier"] == 0.8
    assert record["sampling"] == c.train.sampling
    assert record["delta"] == pytest.approx(c.dp.delta or 200**-1.1)


def analytic_gaussian_delta(epsilon: float, sigma: float) -> float:
    """Balle & Wang 2018, Theorem 8: the Gaussian mechanism of sensitivity 1 and std sigma is
    (epsilon, delta)-DP exactly for delta = Phi(1/(2 sigma) - epsilon sigma) - e^epsilon
    Phi(-1/(2 sigma) - epsilon sigma)."""
    a, b = 1 / (2 * sigma), epsilon * sigma
    return stats.norm.cdf(a - b) - math.exp(epsilon) * stats.norm.cdf(-a - b)


def test_one_unsampled_gaussian_round_has_the_analytic_gaussian_epsilon():
    # q = K / N = 1 (Poisson, every client): one round is the plain Gaussian mechanism
    c = config(*DP, "train.clients_per_round=200", "train.sampling='poisson'")
    c = dataclasses.replace(c, dp=dataclasses.replace(c.dp, accountant="pld", delta=1e-5))
    settings = dp_of(c, 200)
    assert settings is not None
    got = settings.epsilon(1)
    exact = optimize.brentq(lambda e: analytic_gaussian_delta(e, 0.8) - 1e-5, 1e-3, 50)
    assert got == pytest.approx(exact, rel=0.01)


def test_a_target_epsilon_calibrates_z_for_the_configured_rounds():
    c = config("dp.mechanism='gaussian'", "dp.target_epsilon=3.0", "train.rounds=30")
    settings = dp_of(c, 200)
    assert settings is not None
    spent = settings.epsilon(30)
    assert 0.99 * 3.0 <= spent <= 3.0
    assert settings.budget == 3.0
    c = dataclasses.replace(
        c,
        dp=dataclasses.replace(
            c.dp, noise_multiplier=settings.noise_multiplier, target_epsilon=None
        ),
    )
    assert independent_epsilon(c, 30, 200) == pytest.approx(spent, rel=0.01)


# -- clipping and the noise --------------------------------------------------------------------


def cohort(deltas: list[dict[int, list[float]]], dense: list[list[float]]) -> CohortUpdate:
    """A cohort of one table "t": member k's row deltas {row: values} and dense deltas."""
    rows, owner, values = [], [], []
    for k, member in enumerate(deltas):
        for row, value in sorted(member.items()):
            rows.append(row)
            owner.append(k)
            values.append(value)
    dim = len(values[0]) if values else 1
    return CohortUpdate(
        clients=torch.arange(len(deltas)),
        weights=torch.ones(len(deltas), dtype=torch.float64),
        multiplicity=torch.ones(len(deltas), dtype=torch.int64),
        rows={"t": torch.tensor(rows, dtype=torch.int64)},
        row_owner={"t": torch.tensor(owner, dtype=torch.int64)},
        table_deltas={"t": torch.tensor(values, dtype=torch.float64).reshape(-1, dim)},
        dense_deltas={"w": torch.tensor(dense, dtype=torch.float64)},
    )


def test_clipping_scales_each_whole_update_to_norm_at_most_c():
    update = cohort(
        [{0: [3.0], 5: [0.0]}, {2: [0.1]}, {1: [1.0], 2: [1.0]}],
        [[4.0, 0.0], [0.0, 0.1], [1.0, 1.0]],
    )
    clip = 1.5
    factors = clipping.clip_factors(update.squared_norms(), clip)
    norms = [math.sqrt(9 + 16), math.sqrt(0.01 + 0.01), 2.0]  # rows and dense together
    assert factors.tolist() == pytest.approx([min(1, clip / n) for n in norms])
    scaled = clipping.scaled(update, factors)
    assert scaled.squared_norms().sqrt().tolist() == pytest.approx([min(n, clip) for n in norms])


def settings(clients_per_round: int = 10, **changes) -> DpSettings:
    accounting = Accounting(
        delta=1e-5,
        accountant="rdp",
        sampling="fixed",
        num_clients=1000,
        clients_per_round=clients_per_round,
        rounds=1,
    )
    base = DpSettings(
        clip=0.7,
        noise_multiplier=1.3,
        accounting=accounting,
        rows="private",
        selection=RowSelection(share=0.3, threshold=2.0),
        key=NoiseKey("seeded"),  # two mechanisms of one round draw the same noise
    )
    return dataclasses.replace(base, **changes)


def test_a_round_without_movement_adds_gaussian_noise_of_std_z_grad_c_over_d():
    # every member touched rows 0..199 with zero deltas; the selected rows (touched ones and
    # ~2% of the 100,000 untouched, threshold 2 sigma) hold noise / D only
    s = settings()
    members = [{r: [0.0, 0.0] for r in range(200)} for _ in range(10)]
    update = cohort(members, [[0.0] * 300 for _ in range(10)])
    mechanism = DpMechanism(s, {"t": 100_000}, np.ones(1000))
    out = mechanism.combine(update, round_index=3)
    table = out.tables["t"]
    assert len(table.rows) == mechanism.last.rows_changed > 1500
    assert torch.equal(table.rows, torch.unique(table.rows))  # sorted, each row once
    z_grad = 1.3 / math.sqrt(1 - 0.3)
    std = z_grad * 0.7 / 10  # D = K with uniform weights
    values = torch.cat([table.values.flatten(), out.dense["w"]]).numpy()
    assert stats.kstest(values / std, "norm").pvalue > 1e-3
    assert np.std(values) == pytest.approx(std, rel=0.05)


@pytest.mark.parametrize("heat", [False, True])
def test_with_negligible_noise_a_round_is_the_clipped_sum_over_d_or_the_private_heat(heat):
    # z -> 0: every touched row is selected (tau -> 0) and its value is sum_k clip(delta_k)[m]
    # over D = K (DP-FedAvg) or over h_m = sum_k c_k [m in S(k)] (DP-FedSubAvg's coefficient)
    members = [{0: [3.0], 2: [4.0]}, {2: [1.0], 5: [0.5]}, {0: [0.2]}]
    dense = [[0.0], [1.0], [0.0]]
    s = settings(noise_multiplier=1e-12, clip=2.0, clients_per_round=3)
    out = DpMechanism(s, {"t": 8}, np.ones(1000), heat=heat).combine(cohort(members, dense), 1)
    scale = [min(1, 2.0 / 5.0), min(1, 2.0 / math.sqrt(1 + 0.25 + 1)), 1.0]  # C / ||delta_k||
    c = [min(1, 1 / math.sqrt(2)), min(1, 1 / math.sqrt(2)), 1.0]  # B / sqrt(|S(k)|), B = 1
    sums = {0: 3.0 * scale[0] + 0.2, 2: 4.0 * scale[0] + 1.0 * scale[1], 5: 0.5 * scale[1]}
    h = {0: c[0] + c[2], 2: c[0] + c[1], 5: c[1]}
    table = out.tables["t"]
    got = dict(zip(table.rows.tolist(), table.values.flatten().tolist(), strict=True))
    for row, total in sums.items():
        assert got[row] == pytest.approx(total / (h[row] if heat else 3), abs=1e-9)
    assert out.dense["w"].tolist() == pytest.approx([scale[1] / 3], abs=1e-9)


@pytest.mark.parametrize("weight_mean", [1.0, 0.875])
def test_capped_weights_and_the_fixed_denominator(weight_mean):
    # McMahan et al.'s capped weights w_k = min(1, n_k / cap) and D = K * dp.weight_mean, a
    # public number: the population's sample counts are not read (their mean weight is 0.875)
    population = np.array([5.0, 20.0, 10.0, 40.0])
    s = settings(
        rows="all",
        noise_multiplier=1e-12,
        weights=DpWeights(cap=10.0, mean=weight_mean),
        clip=100.0,
        clients_per_round=2,
    )
    update = cohort([{0: [1.0]}, {1: [4.0]}], [[1.0], [2.0]])
    update.weights = torch.tensor([5.0, 40.0], dtype=torch.float64)
    out = DpMechanism(s, {"t": 3}, population).combine(update, 1)
    assert DpMechanism(s, {"t": 3}, population * 0 + 1e6).denominator == 2 * weight_mean
    d = 2 * weight_mean
    assert out.dense["w"].tolist() == pytest.approx([(0.5 * 1.0 + 1.0 * 2.0) / d], abs=1e-9)
    assert out.tables["t"].values.flatten().tolist() == pytest.approx(
        [0.5 * 1.0 / d, 1.0 * 4.0 / d, 0.0], abs=1e-9
    )


def test_dp_fedavgs_dense_form_noises_every_row():
    s = settings(rows="all", noise_multiplier=0.9)
    update = cohort([{3: [0.0]}], [[0.0]])
    out = DpMechanism(s, {"t": 5000}, np.ones(1000)).combine(update, 1)
    assert out.tables["t"].rows.tolist() == list(range(5000))
    values = out.tables["t"].values.flatten().numpy()
    assert stats.kstest(values / (0.9 * 0.7 / 10), "norm").pvalue > 1e-3


def test_the_dense_forms_rows_are_the_clipped_sums_plus_the_rounds_noise_bit_for_bit():
    """rows = "all": each row's value is (its clipped deltas summed in entry order, from 0,
    in the deltas' dtype, plus the round's noise drawn for every row) / D, written out here
    entry by entry against the same generator's draw; untouched rows hold the noise alone."""
    s = settings(rows="all", noise_multiplier=0.9)
    members = [{3: [0.25, -1.0], 7: [0.5, 0.125]}, {3: [1.5, 2.0]}, {0: [0.75, 0.5], 7: [1, 2]}]
    update = cohort(members, [[0.0], [0.0], [0.0]])
    out = DpMechanism(s, {"t": 9}, np.ones(1000)).combine(update, 4)
    assert out.tables["t"].rows.tolist() == list(range(9))
    factors = clipping.clip_factors(update.squared_norms(), 0.7)  # uniform weights: 1
    generator = mechanism_lib.round_generator(s.key.seed, 4)
    noise = mechanism_lib.gaussian((9, 2), s.update_multiplier * 0.7, generator)
    expected = torch.zeros((9, 2), dtype=torch.float64)
    for k, member in enumerate(members):
        for row, delta in sorted(member.items()):  # the cohort's entry order
            expected[row] += torch.tensor(delta, dtype=torch.float64) * factors[k]
    expected = (expected + noise) / 10
    assert torch.equal(out.tables["t"].values, expected)
    assert (
        DpMechanism(s, {"t": 9}, np.ones(1000))
        .combine(update, 4)
        .tables["t"]
        .values.equal(expected)
    )


def test_the_dense_forms_row_ids_are_kept_per_table_and_its_touched_rows_counted():
    """rows = "all": every round of every table names all its rows (0 .. V - 1, the ids made
    once per table size and kept: the same tensor round after round, never one table's for
    another's), its values stay each round's own, and the round's touched rows (distinct rows
    the cohort sent, a row sent twice counted once) are counted as ``torch.unique`` counts
    them."""
    s = settings(rows="all", noise_multiplier=0.9)

    def two_tables(members: list[dict[int, list[float]]], more: list[int]) -> CohortUpdate:
        update = cohort(members, [[0.0]] * len(members))
        update.rows["u"] = torch.tensor(more)
        update.row_owner["u"] = torch.zeros(len(more), dtype=torch.int64)
        update.table_deltas["u"] = torch.ones((len(more), 2), dtype=torch.float64)
        return update

    members = [{3: [0.25, -1.0], 7: [0.5, 0.125]}, {3: [1.5, 2.0]}, {0: [0.75, 0.5], 7: [1, 2]}]
    mechanism = DpMechanism(s, {"t": 9, "u": 12}, np.ones(1000))
    first = mechanism.combine(two_tables(members, [11]), 4)
    assert first.tables["t"].rows.tolist() == list(range(9))
    assert first.tables["u"].rows.tolist() == list(range(12))
    assert mechanism.last.touched_rows == 3 + 1
    second = mechanism.combine(two_tables(members[:2], [2, 5]), 5)
    assert second.tables["t"].rows is first.tables["t"].rows  # kept, and left as it was
    assert second.tables["u"].rows is first.tables["u"].rows
    assert first.tables["t"].rows.tolist() == list(range(9))
    assert mechanism.last.touched_rows == 2 + 2
    assert not first.tables["t"].values.equal(second.tables["t"].values)  # each round's noise


def test_false_positives_are_distributed_as_thresholded_noise_on_every_row():
    # V = 12 rows, 3 touched with histogram values 0.5, 2, 4; threshold 1.5, noise std 1:
    # brute force (noise on all 12 rows, keep >= 1.5) against the sampler, row by row
    touched = torch.tensor([2, 5, 9])
    heat = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)
    trials, v, std, tau = 4000, 12, 1.0, 1.5
    sampled = np.zeros(v)
    fp_heat = []
    generator = torch.Generator().manual_seed(7)
    for _ in range(trials):
        chosen = selection.select(touched, heat, v, std, tau, generator)
        sampled[chosen.rows.numpy()] += 1
        fp_heat += chosen.noisy_heat[chosen.touched_position < 0].tolist()
        assert (chosen.noisy_heat >= tau).all()
    full = np.zeros(v)
    full[[2, 5, 9]] = [0.5, 2.0, 4.0]
    rng = np.random.default_rng(0)
    brute = (full + std * rng.standard_normal((trials, v)) >= tau).sum(0)
    p = stats.norm.sf(tau - full)  # each row's selection probability
    for counts in (sampled, brute):  # both against the binomial of each row
        z_scores = (counts - trials * p) / np.sqrt(trials * p * (1 - p))
        assert np.abs(z_scores).max() < 4.5
    # a false positive's noisy value: the noise given that it reached the threshold
    truncated = stats.truncnorm(tau / std, np.inf, scale=std)
    assert stats.kstest(fp_heat, truncated.cdf).pvalue > 1e-3


def test_the_number_of_false_positives_is_binomial_on_a_large_table():
    v, tau = 1_000_000, 3.0
    generator = torch.Generator().manual_seed(1)
    touched = torch.arange(0, 2000, 2)
    counts = [
        len(
            selection.select(
                touched, torch.zeros(1000, dtype=torch.float64), v, 1.0, tau, generator
            ).rows
        )
        for _ in range(300)
    ]
    expected = (v - 1000) * stats.norm.sf(tau) + 1000 * stats.norm.sf(tau)
    assert np.mean(counts) == pytest.approx(expected, rel=0.02)


def test_sampled_untouched_rows_are_distinct_uniform_and_never_touched():
    generator = torch.Generator().manual_seed(3)
    touched = torch.tensor([0, 1, 2, 7])
    seen = np.zeros(10)
    for _ in range(3000):
        rows = selection.sample_untouched(touched, 10, 3, generator).numpy()
        assert len(set(rows)) == 3 and not set(rows) & {0, 1, 2, 7}
        seen[rows] += 1
    free = seen[[3, 4, 5, 6, 8, 9]]
    assert stats.chisquare(free).pvalue > 1e-3


def test_each_members_contribution_has_l2_norm_at_most_b():
    # c_k = min(1, B / sqrt(|S(k)|)), |S(k)| over every table: 1, 4 and 100 rows with B = 0.5 / 3
    update = cohort(
        [{0: [0.0]}, {r: [0.0] for r in range(4)}, {r: [0.0] for r in range(100)}], [[0.0]] * 3
    )
    for bound in (0.5, 3.0):
        got = selection.contributions(update, bound).tolist()
        assert got == pytest.approx([min(1, bound / math.sqrt(n)) for n in (1, 4, 100)])


@pytest.mark.parametrize(
    ("num_rows", "count", "touched"),
    [
        (60, 12, [1, 4, 7, 30, 55]),
        (20_000, 24, [1, 4, 7, 30, 55]),
        (300, 40, [1, 4, 7, 30, 55]),
        (65, 30, [1, 4, 7, 30, 55]),  # 2 count = the free rows: still this path
        (200, 50, list(range(0, 200, 2))),  # half the draws touched: later batches
    ],
)
def test_untouched_rows_are_the_first_distinct_free_draws(num_rows, count, touched):
    """sample_untouched keeps, batch after batch of the generator's draws, each free row's
    first draw until ``count`` (a loop over the draws written out here, the same generator
    state), with rows drawn twice in a batch (small tables) and without, and with batches
    after the first (each of 2 (count - kept) + 8 draws, leaving the generator where the loop
    leaves it). It takes this path while 2 count is at most the free rows."""
    touched = torch.tensor(touched)
    for seed in range(20):
        used = torch.Generator().manual_seed(seed)
        got = selection.sample_untouched(touched, num_rows, count, used)
        generator, kept = torch.Generator().manual_seed(seed), []
        while len(kept) < count:
            batch = torch.randint(num_rows, (2 * (count - len(kept)) + 8,), generator=generator)
            for row in batch.tolist():
                if row not in touched.tolist() and row not in kept and len(kept) < count:
                    kept.append(row)
        assert got.tolist() == sorted(kept)
        # and exactly these draws taken from the generator (the selection's next draws read it)
        assert torch.equal(used.get_state(), generator.get_state())


@pytest.mark.parametrize(("num_rows", "count"), [(60, 40), (65, 31), (66, 61)])
def test_more_than_half_the_free_rows_are_a_permutation_of_the_free_list(num_rows, count):
    """When 2 count exceeds the free rows, sample_untouched lists the free rows (ascending)
    and keeps the first ``count`` of a random permutation of them (written out here with the
    same generator state)."""
    touched = [1, 4, 7, 30, 55]
    free = [r for r in range(num_rows) if r not in touched]
    for seed in range(10):
        got = selection.sample_untouched(
            torch.tensor(touched), num_rows, count, torch.Generator().manual_seed(seed)
        )
        order = torch.randperm(len(free), generator=torch.Generator().manual_seed(seed))
        assert got.tolist() == sorted(free[i] for i in order[:count].tolist())


def test_all_the_free_rows_can_be_drawn_and_no_more():
    generator = torch.Generator().manual_seed(0)
    touched = torch.tensor([1, 4])
    for _ in range(20):  # every draw of all 4 free rows is exactly them
        assert selection.sample_untouched(touched, 6, 4, generator).tolist() == [0, 2, 3, 5]
    with pytest.raises(ValueError, match="5 untouched rows wanted, 4 exist"):
        selection.sample_untouched(touched, 6, 5, generator)


def test_fedsubavgs_private_coefficient_is_bounded_by_d_over_the_threshold():
    s = settings(selection=RowSelection(share=0.3, threshold=1.0))
    members = [{r: [1.0] for r in range(k, k + 5)} for k in range(10)]
    mechanism = DpMechanism(s, {"t": 50}, np.ones(1000), heat=True)
    for r in range(20):
        mechanism.combine(cohort(members, [[0.0]] * 10), r)
        assert mechanism.last.largest_coefficient <= 10 / s.histogram_threshold + 1e-9


def test_adaptive_clipping_moves_c_toward_the_target_quantile():
    # z tiny: the noisy count is the count; 3 of 4 members have norm <= C = 1
    adaptive = AdaptiveClip(target_quantile=0.5, clip_lr=0.2)
    s = settings(adaptive=adaptive, noise_multiplier=1e-9, clip=1.0)
    update = cohort([{0: [0.5]}, {1: [0.9]}, {2: [3.0]}, {3: [0.1]}], [[0.0]] * 4)
    mechanism = DpMechanism(s, {"t": 10}, np.ones(1000))
    mechanism.combine(update, 1)
    d = 10  # K: uniform weights
    fraction = (3 - 4 / 2) / d + 0.5  # (sum of b_k - 1/2) / D + 1/2, as Andrew et al. center it
    expected = 1.0 * math.exp(-0.2 * (fraction - 0.5))
    assert float(mechanism.state_tensors()["clip"][0]) == pytest.approx(expected, rel=1e-6)
    assert mechanism.current_clip(1) == 1.0  # a recombined round keeps its C
    assert mechanism.current_clip(2) == pytest.approx(expected, rel=1e-6)


def test_the_budget_split_keeps_one_gaussian_mechanism_of_multiplier_z():
    s = settings(adaptive=AdaptiveClip(count_share=0.1), noise_multiplier=1.7)
    assert s.selection.share == 0.3
    z_sel, z_grad = s.selection_multiplier, s.update_multiplier
    z_count = s.count_std / 0.5  # the count's sensitivity is 1/2
    assert 1 / z_sel**2 + 1 / z_grad**2 + 1 / z_count**2 == pytest.approx(1 / 1.7**2)
    assert 1 / z_sel**2 == pytest.approx(0.3 / 1.7**2)
    # the selection noise's std is z_sel B and the threshold tau z_sel B (histogram units)
    wide = dataclasses.replace(s, selection=RowSelection(share=0.3, threshold=3.0, bound=2.5))
    assert wide.selection_std == pytest.approx(1.7 / math.sqrt(0.3) * 2.5)
    assert wide.histogram_threshold == pytest.approx(3.0 * 1.7 / math.sqrt(0.3) * 2.5)


def test_an_empty_cohort_update_has_no_member_and_the_models_shapes():
    from fedsub.dp.mechanism import empty_update
    from fedsub.submodel.params import Params

    params = Params(tables={"t": torch.zeros(7, 3)}, dense={"w": torch.zeros(2, 2)})
    empty = empty_update(params)
    assert len(empty) == 0 and len(empty.weights) == 0
    assert empty.rows["t"].shape == (0,) and empty.row_owner["t"].shape == (0,)
    assert empty.table_deltas["t"].shape == (0, 3)
    assert empty.dense_deltas["w"].shape == (0, 2, 2)


# -- whole runs --------------------------------------------------------------------------------


def test_unselected_rows_stay_bit_identical(monkeypatch):
    c = config(*DP, "train.rounds=1", "train.algorithms=['fedsubavg']")
    setup = prepare(c)
    noised: list[torch.Tensor] = []
    combine = DpMechanism.combine

    def recorded(self, update, round_index):
        out = combine(self, update, round_index)
        noised.append(out.tables["features"].rows.clone())
        return out

    monkeypatch.setattr(DpMechanism, "combine", recorded)
    algorithm = build_algorithm("fedsubavg", setup.context)
    before = initial_params(setup.model, setup.schedule).tables["features"].clone()
    after = train(setup.model, algorithm, setup.dataset, setup.index, setup.schedule).tables[
        "features"
    ]
    selected = noised[0]
    others = torch.ones(len(before), dtype=torch.bool)
    others[selected] = False
    assert 0 < len(selected) < len(before) // 4
    assert torch.equal(after[others], before[others])
    assert (after[selected] != before[selected]).all()


def test_both_backends_give_the_same_numbers_under_dp():
    runs = {
        backend: experiment.compare(config(*DP, f"execution.backend='{backend}'"), None)
        for backend in ("sequential", "batched")
    }
    for name in ("fedavg", "fedsubavg"):
        a = runs["sequential"].params[name].state_dict()
        b = runs["batched"].params[name].state_dict()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-9)
        start = initial_params(runs["batched"].model, prepare(config(*DP)).schedule)
        assert not torch.equal(a["table.features"], start.tables["features"])


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_resumed_run_continues_the_same_model_and_epsilon_curve(tmp_path, adaptive):
    c = config(
        *DP,
        "train.algorithms=['fedsubavg']",
        "eval.every=1",
        f"dp.adaptive_clip={str(adaptive).lower()}",
    )
    setup = prepare(c)
    algorithm = build_algorithm("fedsubavg", setup.context)
    straight: list = []
    args = (setup.model, algorithm, setup.dataset, setup.index, setup.schedule, setup.evaluator)
    final = train(*args, on_evaluation=straight.append)
    done: list[int] = []
    stop = RunControl(checkpoints=tmp_path, stop_requested=lambda: done[-1] >= 2)
    with pytest.raises(Interrupted) as stopped:
        train(*args, on_round=done.append, control=stop)
    resumed: list = []
    saved = checkpoint_lib.load(stopped.value.checkpoint)
    again = train(*args, on_evaluation=resumed.append, control=RunControl(resume=saved))
    assert [e.metrics["epsilon"] for e in resumed] == [e.metrics["epsilon"] for e in straight[3:]]
    for key, value in final.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_a_run_stops_before_the_round_that_would_exceed_its_budget(caplog):
    c = config(
        *DP,
        "dp.epsilon_budget=12.0",
        "train.algorithms=['fedavg']",
        "train.rounds=40",
        "eval.every=10",
    )
    outcome = experiment.compare(c, None)
    history = outcome.histories["fedavg"]
    settings_ = dp_of(c, 200)
    assert settings_ is not None
    last = history[-1].round
    assert settings_.epsilon(last) <= 12.0 < settings_.epsilon(last + 1)
    assert last < 40
    assert history[-1].metrics["epsilon"] == settings_.epsilon(last)
    assert "stopped before round" in caplog.text


def test_poisson_sampling_draws_each_client_with_probability_k_over_n():
    c = config("train.sampling='poisson'", "train.algorithms=['fedavg']")
    setup = prepare(c)
    from fedsub.algorithms.sampling import poisson_cohort

    sizes = [len(poisson_cohort(0, r, 200, 20)) for r in range(1, 2001)]
    assert np.mean(sizes) == pytest.approx(20, rel=0.02)
    assert np.var(sizes) == pytest.approx(200 * 0.1 * 0.9, rel=0.15)
    assert setup.schedule.sampling == "poisson"


def test_mechanism_none_leaves_the_run_unchanged():
    plain = experiment.compare(config(), None)
    explicit = experiment.compare(config("dp.mechanism='none'", "dp.clip=1.0"), None)
    for name in ("fedavg", "fedsubavg"):
        a, b = plain.params[name].state_dict(), explicit.params[name].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert "epsilon" not in plain.histories[name][-1].metrics


# -- with privacy.level levels ------------------------------------------------------------------


def test_privacy_heat_with_dp_is_the_privacy_none_run_and_runs_no_heat_exchange():
    # under DP FedSubAvg's heat is the noisy histogram: the level adds no heat exchange, so
    # the numbers (models and epsilons) are exactly those of privacy "none"
    plain = experiment.compare(config(*DP), None)
    heat = experiment.compare(config(*DP, "privacy.level='heat'"), None)
    assert prepare(config(*DP, "privacy.level='heat'")).heat_source is None
    assert prepare(config("privacy.level='heat'")).heat_source is not None  # without DP: one
    for name in ("fedavg", "fedsubavg"):
        a, b = plain.params[name].state_dict(), heat.params[name].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
        epsilons = [e.metrics["epsilon"] for e in plain.histories[name]]
        assert [e.metrics["epsilon"] for e in heat.histories[name]] == epsilons


def test_download_with_dp_spends_the_same_epsilon():
    c = config(*DP, "privacy.level='download'", "privacy.download_keep=0.8")
    outcome = experiment.compare(c, None)
    plain = experiment.compare(config(*DP), None)
    for name in ("fedavg", "fedsubavg"):
        got = [e.metrics["epsilon"] for e in outcome.histories[name]]
        assert got == [e.metrics["epsilon"] for e in plain.histories[name]]
        assert got[-1] == pytest.approx(independent_epsilon(c, 4, 200), rel=1e-6)


@pytest.mark.parametrize("rows", ["private", "all"])
def test_randomized_response_download_divides_rows_by_p_without_heat_only(rows):
    # a held row reaches the sum with probability p: (sum + noise) / (p D) without heat; the
    # private heat counts the same requested rows, so (sum + noise) / h_m is left as it is
    members = [{0: [0.3], 2: [-0.4]}, {2: [1.0], 5: [0.5]}, {0: [0.2]}]
    update = cohort(members, [[0.1], [1.0], [0.0]])
    s = settings(rows=rows, clients_per_round=3)
    for heat in (False, True) if rows == "private" else (False,):
        sure = DpMechanism(s, {"t": 50}, np.ones(1000), heat=heat).combine(update, 4)
        rr = DpMechanism(s, {"t": 50}, np.ones(1000), heat=heat, keep=0.8).combine(update, 4)
        assert torch.equal(rr.tables["t"].rows, sure.tables["t"].rows)
        expected = sure.tables["t"].values * (1.0 if heat else 1 / 0.8)
        torch.testing.assert_close(rr.tables["t"].values, expected, rtol=1e-14, atol=0)
        assert torch.equal(rr.dense["w"], sure.dense["w"])  # dense parameters always go up


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["train.algorithms=['scaffold']"], "outside the Gaussian mechanism"),
        (["train.algorithms=['fedavg@scheme1']"], "scheme"),
        (["privacy.level='full'"], "exact secure heat"),
        (["dp.accountant='pld'"], "no event for fixed-size cohorts"),
        (["dp.target_epsilon=2.0"], "mechanism = 'gaussian' needs exactly one of"),
        (
            ["dp.mechanism='ftrl-tree'", "dp.min_separation=5", "dp.target_epsilon=2.0"],
            "mechanism = 'ftrl-tree' needs exactly one of",
        ),
        (["dp.rows='all'"], "exact heat"),
        (["eval.gradient_norms=true"], "exact heat"),
        (["execution.table_placement='host'"], "not yet supported"),
        (["train.algorithms=['central-sgd']"], "pools the data"),
    ],
)
def test_combinations_that_cannot_be_private_are_refused(extra, says):
    with pytest.raises(ConfigError, match=says):
        config(*DP, *extra)


DP_KEYS = {  # a value away from each [dp] key's default
    "clip": "2.0",
    "noise_multiplier": "1.0",
    "target_epsilon": "1.0",
    "delta": "1e-6",
    "accountant": "'pld'",
    "rows": "'all'",
    "selection_share": "0.3",
    "selection_threshold": "2.0",
    "selection_bound": "2.0",
    "weight_cap": "5.0",
    "weight_mean": "0.5",
    "public_test": "true",
    "epsilon_budget": "3.0",
    "adaptive_clip": "true",
    "target_quantile": "0.3",
    "clip_lr": "0.1",
    "count_share": "0.2",
    "min_survivors": "2",
    "selection_window": "4",
    "heat_cap": "4.0",
    "selection_max_rows": "200",
    "selection_refresh": "2",
    "min_separation": "5",
    "max_participations": "3",
    "blt_buffers": "2",
    "randomness": "'seeded'",
}


def test_every_dp_key_covered_by_the_list_of_non_defaults():
    from fedsub.config import DpConfig
    from fedsub.keys import flat_values

    assert set(flat_values(DpConfig())) - {"mechanism"} <= set(DP_KEYS)


@pytest.mark.parametrize("key", sorted(DP_KEYS))
def test_a_dp_key_set_without_the_mechanism_is_an_error_naming_dp_mechanism(key):
    with pytest.raises(ConfigError, match=rf"dp\.{key} set while dp\.mechanism = 'none'"):
        config(f"dp.{key}={DP_KEYS[key]}")
    with pytest.raises(ConfigError, match=r"dp\.mechanism"):
        Config.from_dict({"dp": {key: tomllib.loads(f"v = {DP_KEYS[key]}")["v"]}})
    config(f"dp.{key}={DP_KEYS[key]}", "dp.mechanism='none'", f"dp.{key}=None")  # unset: fine


def test_the_python_api_refuses_dp_keys_without_the_mechanism():
    import fedsub

    for dp in ({"target_epsilon": 1.0}, {"noise_multiplier": 1.0, "clip": 0.5}):
        with pytest.raises(ConfigError, match=r"dp\.mechanism"):
            fedsub.train("sparse-lr", "synthetic-sparse", algorithm="fedavg", rounds=1, dp=dp)


def test_a_delta_of_one_over_n_or_more_is_refused_with_the_reason():
    for delta in (0.5, 1 / 200):
        with pytest.raises(ConfigError, match=r"dp.delta = .* is not below 1/N = 0.005 \(N = 200"):
            dp_of(config(*DP, f"dp.delta={delta}"), 200)
    assert dp_of(config(*DP, "dp.delta=0.0049"), 200) is not None


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["dp.clip=1e-30"], "every update vanishes"),
        (["dp.clip=1e-30", "dp.adaptive_clip=true"], "every update vanishes"),
        (["dp.clip=1e-18", "execution.dtype='float32'"], "float32's resolution"),
        (["train.max_update_norm=3.0"], "rejections.jsonl"),
        (["dp.weight_mean=0.5"], "applies with dp.weight_cap > 0"),
    ],
)
def test_settings_that_cannot_train_or_release_outside_epsilon_are_refused(extra, says):
    with pytest.raises(ConfigError, match=says):
        config(*DP, *extra)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["dp.selection_threshold=1e9"], "out of reach"),
        (["dp.selection_threshold=1e9", "train.sampling='poisson'"], "out of reach"),
        (["dp.epsilon_budget=0.01"], "cannot pay for one round: round 1 alone spends"),
        (["dp.noise_multiplier=None", "dp.target_epsilon=1e6"], "is no privacy"),
        (["dp.noise_multiplier=None", "dp.target_epsilon=1e-6", "dp.delta=1e-9"], "cannot be met"),
    ],
)
def test_settings_that_cannot_train_are_refused_before_training(extra, says, tmp_path):
    c = config(*DP, *extra)
    with pytest.raises(ConfigError, match=says):
        dp_of(c, 200)
    with pytest.raises(ConfigError, match=says):
        experiment.compare(c, tmp_path / "run")
    assert not (tmp_path / "run" / "summary.json").exists()


def test_reachable_thresholds_and_affordable_budgets_are_accepted():
    assert dp_of(config(*DP, "dp.selection_threshold=6.0"), 200) is not None
    settings_ = dp_of(config(*DP, "dp.epsilon_budget=100"), 200)
    assert settings_ is not None and settings_.budget == 100


def test_the_accountant_answers_every_multiplier_without_a_raw_error():
    from fedsub.dp import accountant

    args = (150, 3000**-1.1, "rdp", "fixed", 3000, 50)
    at_cap = accountant.epsilon(accountant.Z_MAX, *args)
    assert 0 < at_cap < 0.01
    for z in (1e4, 1e9, 1e300):  # accounted at Z_MAX: an upper bound, never a domain error
        assert accountant.epsilon(z, *args) == at_cap
    assert accountant.epsilon(1e-6, *args) > 1e6  # no noise to speak of: huge, finite
    for kind, sampling in (("rdp", "poisson"), ("pld", "poisson")):
        assert 0 < accountant.epsilon(1e9, 150, 1e-5, kind, sampling, 3000, 50) < 0.01
        # PLD's distribution would not fit in memory: RDP's upper bound instead
        assert accountant.epsilon(1e-6, 1, 1e-6, kind, sampling, 100_000, 500) > 1e6


@pytest.mark.parametrize(
    ("sampling", "kind"), [("fixed", "rdp"), ("poisson", "rdp"), ("poisson", "pld")]
)
def test_the_calibration_is_dp_accountings_within_its_tolerance(sampling, kind):
    from fedsub.dp import accountant

    delta, rounds = 1e-5, 40
    z = accountant.calibrate(3.0, rounds, delta, kind, sampling, 500, 20)

    def fresh():
        return accountant.fresh_accountant(kind, sampling)

    expected = dp_accounting.calibrate_dp_mechanism(
        fresh,
        lambda m: accountant.run_event(m, rounds, sampling, 500, 20),
        3.0,
        delta,
        dp_accounting.LowerEndpointAndGuess(0.05, 1.0),
        tol=1e-4,
    )
    assert z == pytest.approx(expected, abs=2.5e-4)
    assert accountant.epsilon(z, rounds, delta, kind, sampling, 500, 20) <= 3.0


@pytest.mark.parametrize(("sampling", "kind"), [("fixed", "rdp"), ("poisson", "pld")])
def test_rounds_drawn_from_different_populations_compose_their_own_events(sampling, kind):
    """epsilon_over: each round accounted at the population it sampled from (q_t = K / N_t),
    against dp-accounting composing those events one by one."""
    from fedsub.dp import accountant

    populations = ((300, 3), (200, 2), (100, 4))
    got = accountant.epsilon_over(1.1, populations, 1e-5, kind, sampling, 20)
    independent = accountant.fresh_accountant(kind, sampling)
    for n, count in populations:
        for _ in range(count):
            if sampling == "poisson":
                event = dp_accounting.PoissonSampledDpEvent(
                    20 / n, dp_accounting.GaussianDpEvent(1.1)
                )
            else:
                event = dp_accounting.SampledWithoutReplacementDpEvent(
                    n, 20, dp_accounting.GaussianDpEvent(1.1 / 2)
                )
            independent.compose(event)
    assert got == pytest.approx(independent.get_epsilon(1e-5), rel=0.01)
    at_first = accountant.epsilon(1.1, 9, 1e-5, kind, sampling, 300, 20)
    assert got > at_first  # fewer online clients: a higher rate, more epsilon


def test_flower_runs_central_dp_at_the_server_app():
    """Flower declares the capability (its ServerApp runs the engine's loop, which clips,
    noises and accounts; tests/test_flower_dp.py: the in-process model and epsilon)."""
    from fedsub.flower.settings import FlowerSettings

    settings_ = FlowerSettings(overrides=(*SMALL, *DP))
    assert settings_.fedsub_config().dp.mechanism == "gaussian"
    assert FLOWER.has("differential-privacy")


def test_dp_rounds_split_across_processes_give_the_one_process_model(monkeypatch):
    """The cohort split across 2 and 3 processes (emulated here, tests/test_distributed.py):
    every process adds the same host-drawn noise after the gather, so the model is the
    one-process model bit for bit (sequential backend, float64)."""
    from .test_distributed import assert_same_model, train_split

    c = config(*DP, "train.algorithms=['fedsubavg']", "execution.backend='sequential'")
    setup = prepare(c)
    algorithm = build_algorithm("fedsubavg", setup.context)
    args = (setup.model, algorithm, setup.dataset, setup.index, setup.schedule)
    whole = train(*args)
    for world in (2, 3):
        assert_same_model(train_split(monkeypatch, world, *args), whole)


# -- interfaces --------------------------------------------------------------------------------


def test_fedsub_dp_prints_the_planned_epsilon_without_training(capsys):
    from fedsub.cli import main

    overrides = [*SMALL, *DP]
    assert main(["dp", *(a for o in overrides for a in ("--set", o))]) == 0
    out = capsys.readouterr().out
    c = config(*DP)
    assert f"epsilon after round 4: {independent_epsilon(c, 4, 200):.4f}" in out
    assert "noise multiplier z = 0.8" in out


def test_fedsub_dp_answers_extreme_multipliers_and_targets_cleanly(capsys):
    from fedsub.cli import main

    base = [*SMALL, "dp.mechanism='gaussian'"]
    argv = ["dp", *(a for o in base for a in ("--set", o))]
    assert main([*argv, "--set", "dp.noise_multiplier=1e9"]) == 0
    out = capsys.readouterr().out
    assert "epsilon after round 4: 0.0" in out and "upper bounds" in out
    assert main([*argv, "--set", "dp.target_epsilon=1e6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is no privacy" in err[0], err


def test_a_sweep_over_the_target_epsilon_runs_from_a_base_without_one(tmp_path, capsys):
    from fedsub.cli import main

    base = [*SMALL, "train.rounds=1", "train.algorithms=['fedavg']", "dp.mechanism='gaussian'"]
    argv = ["compare", "--quiet", "--out", str(tmp_path / "sweep")]
    argv += [a for o in base for a in ("--set", o)]
    assert main([*argv, "--sweep", "dp.target_epsilon=2,4"]) == 0
    out = capsys.readouterr().out
    assert "| fedavg | 2 |" in out and "| fedavg | 4 |" in out
    assert "epsilon covers the released models only" in out  # sweep.md says what it covers


def test_the_python_api_passes_dp_through():
    import fedsub

    result = fedsub.train(
        "sparse-lr",
        "synthetic-sparse",
        algorithm="fedavg",
        rounds=2,
        every=1,
        dp={"mechanism": "gaussian", "noise_multiplier": 1.0},
    )
    assert result.history[-1]["epsilon"] > 0


def test_the_progress_line_shows_the_epsilon_spent():
    from fedsub.progress import Reporter, reporting

    class Notes(Reporter):
        def __init__(self) -> None:
            self.notes: list[tuple[str, str]] = []

        def note(self, label: str, text: str) -> None:
            self.notes.append((label, text))

    # every round, evaluated or not (eval.every = 2): rounds 1 to 4 each noted
    settings_ = dp_of(config(*DP), 200)
    assert settings_ is not None
    for randomness, says in [("secret", ""), ("seeded", " (seeded: not a guarantee)")]:
        notes = Notes()
        overrides = (*DP, "train.algorithms=['fedavg']", f"dp.randomness='{randomness}'")
        with reporting(notes):
            outcome = experiment.compare(config(*overrides), None)
        spent = outcome.histories["fedavg"][-1].metrics["epsilon"]
        assert notes.notes[-1] == ("fedavg", f"epsilon {spent:.3g}{says}")
        for r in range(1, 5):
            assert ("fedavg", f"epsilon {settings_.epsilon(r):.3g}{says}") in notes.notes


def test_the_rounds_epsilon_is_computed_only_when_something_shows_it(monkeypatch):
    """The silent reporter without trackers reads no round's epsilon, so none is computed
    (``RunReport.round_metrics``); a reporter that shows notes gets every round's; the
    evaluations' epsilon (the ledger's) is the same either way."""
    from fedsub.engine.features.dp import DpReport
    from fedsub.progress import Reporter, RichReporter, reporting

    class Notes(Reporter):
        def note(self, label: str, text: str) -> None:
            pass

    assert not Reporter().shows_notes
    assert Notes().shows_notes and RichReporter().shows_notes
    asked: list[int] = []
    round_metrics = DpReport.round_metrics

    def counted(self, round_index):
        asked.append(round_index)
        return round_metrics(self, round_index)

    monkeypatch.setattr(DpReport, "round_metrics", counted)
    overrides = (*DP, "train.algorithms=['fedavg']", "dp.randomness='seeded'")
    silent = experiment.compare(config(*overrides), None)
    assert asked == []
    with reporting(Notes()):
        shown = experiment.compare(config(*overrides), None)
    assert asked == [1, 2, 3, 4]
    epsilons = [[e.metrics["epsilon"] for e in o.histories["fedavg"]] for o in (silent, shown)]
    assert epsilons[0] == epsilons[1] and epsilons[0][-1] > 0


@pytest.mark.parametrize("dp", [[], DP])
def test_an_empty_poisson_round_adds_the_noise_and_nothing_else(dp):
    from fedsub.algorithms.sampling import poisson_cohort

    # q = 1 / 200: a seed whose 4 rounds all draw nobody
    seed = next(
        s for s in range(1000) if not any(len(poisson_cohort(s, r, 200, 1)) for r in range(1, 5))
    )
    c = config(
        *dp,
        "train.sampling='poisson'",
        "train.clients_per_round=1",
        "train.algorithms=['fedavg']",
        f"train.seed={seed}",
    )
    outcome = experiment.compare(c, None)
    start = initial_params(outcome.model, prepare(c).schedule).tables["features"]
    moved = not torch.equal(outcome.params["fedavg"].tables["features"], start)
    assert moved == bool(dp)  # only the noise moves a model nobody trained


def test_a_dp_runs_files_say_what_epsilon_covers_and_withhold_per_client_costs(tmp_path):
    c = config(*DP, "train.algorithms=['fedavg']", "privacy.level='heat'")
    experiment.compare(c, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    record = summary["algorithms"]["fedavg"]["dp"]
    assert any("model" in item for item in record["covered_by_epsilon"])
    assert "best" in record["not_covered"] and "rounds_to_target" in record["not_covered"]
    assert any("held-out" in item for item in record["not_covered"])
    markdown = (tmp_path / "summary.md").read_text()
    assert "epsilon covers the released models only" in markdown
    privacy = json.loads((tmp_path / "fedavg" / "privacy.json").read_text())
    assert "bytes_up_per_client_round" not in privacy and "clipped_values" not in privacy
    assert privacy["costs"].startswith("withheld under [dp]")
    assert record["public_test"] is False


def test_a_test_split_declared_public_puts_the_test_metrics_under_epsilon(tmp_path):
    """dp.public_test = true: the test metrics, their best and the rounds to target are
    post-processing of the released models on public data, so summary.* lists them as covered;
    the train metrics and a divergence stop (the users' training data) stay uncovered."""
    c = config(*DP, "train.algorithms=['fedavg']", "dp.public_test=true")
    experiment.compare(c, tmp_path)
    record = json.loads((tmp_path / "summary.json").read_text())["algorithms"]["fedavg"]["dp"]
    assert record["public_test"] is True
    covered, uncovered = " ".join(record["covered_by_epsilon"]), " ".join(record["not_covered"])
    assert "test metrics" in covered and "rounds_to_target" in covered
    assert "test" not in uncovered and "held-out" not in uncovered
    assert "train metrics" in uncovered and "diverged" in uncovered
    markdown = (tmp_path / "summary.md").read_text()
    assert "declared public (dp.public_test = true: your declaration, not checked)" in markdown
    assert "epsilon covers the released models only" not in markdown


@pytest.mark.parametrize(
    ("download", "keep"),
    [([], 1.0), (["privacy.level='download'", "privacy.download_keep=0.8"], 0.8)],
)
def test_the_downloads_p_reaches_the_central_mechanism_through_the_dp_settings(download, keep):
    """[dp]'s adapter reads p from ``DpSettings.weights`` (runs/run_setup.py's ``dp_of`` fills
    it from [privacy]), not from the privacy settings: the mechanism it builds divides by it."""
    from fedsub.engine.contribution import RoundSetup
    from fedsub.engine.features import dp as dp_feature

    c = config(*DP, *download)
    setup = prepare(c)
    dp = setup.schedule.setting(DpSettings)
    assert dp is not None and dp.weights.download_keep == keep
    assert dp_of(c, setup.dataset.num_clients) == dp
    algorithm = build_algorithm("fedavg", setup.context)
    params = initial_params(setup.model, setup.schedule)
    round_setup = RoundSetup(
        setup.model, algorithm, setup.schedule, setup.dataset.sample_counts(), params
    )
    contribution = dp_feature.contribute(round_setup)
    assert contribution is not None
    mechanism = dp_feature.narrowed(contribution.handle, dp_feature.DpRound).mechanism
    assert mechanism is not None and mechanism.keep == keep


def test_the_clip_factors_are_torchs_formula_to_the_last_bit_zero_nan_and_inf_included():
    """On the CPU the clip factors min(1, C / max(||delta||, tiny)) are computed in numpy:
    the bits of torch's formula (the path other devices take), for norms over many scales,
    a zero update (factor 1), NaN (kept NaN) and Inf (factor 0); the clipped count is torch's."""
    rng = np.random.default_rng(4)
    squared = np.concatenate(
        [rng.lognormal(0, 8, 500), [0.0, 5e-324, 1e-300, 0.25, 1.0, float("nan"), float("inf")]]
    )
    norms = torch.from_numpy(squared)
    for clip in (0.5, 1.0, 3.7):
        tiny = torch.finfo(torch.float64).tiny
        expected = torch.clamp(clip / torch.clamp(norms.sqrt(), min=tiny), max=1.0)
        got = clipping.clip_factors(norms, clip)
        assert got.dtype == torch.float64
        assert got.numpy().tobytes() == expected.numpy().tobytes()
        assert clipping.clipped(got) == int((expected < 1).sum())
    assert clipping.clip_factors(torch.tensor([0.0]), 0.5).tolist() == [1.0]
    assert clipping.clip_factors(torch.tensor([float("inf")]), 0.5).tolist() == [0.0]
    assert math.isnan(clipping.clip_factors(torch.tensor([float("nan")]), 0.5).item())
