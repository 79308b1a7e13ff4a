"""Distributed differential privacy over secure aggregation (fedsub/dp/distributed.py,
dp/discrete_gaussian.py, privacy.level = "full" with [dp]): the sampler against the discrete
Gaussian's pmf written here, the node's clip-encode-noise against its formula, the wrap-around
bound, the noise the server decodes, the threshold that refuses too few survivors, the
accountant against dp-accounting's zCDP composition computed here, and the refusals."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import rdp
from scipy import stats

from fedsub.algorithms.registry import build_algorithm
from fedsub.config import Config
from fedsub.dp import discrete_gaussian
from fedsub.dp.distributed import SHARE_STD_FLOOR, DiscreteNoise, clipped_integers, noisy_share
from fedsub.dp.settings import DpSettings
from fedsub.engine.features.dp import distributed_dp
from fedsub.errors import ConfigError, FedsubError
from fedsub.privacy import private_rounds
from fedsub.privacy.levels import Privacy
from fedsub.privacy.private_rounds import PrivateRounds
from fedsub.privacy.secagg import SecAggError
from fedsub.privacy.sparse_secagg import INTEGER_SLOTS, RowSlots, secure_row_sum
from fedsub.runs import experiment
from fedsub.runs.run_setup import dp_of, prepare
from fedsub.submodel.transfer import CohortUpdate

from .test_dp import SMALL

FULL = [
    "dp.mechanism='gaussian'",
    "dp.noise_multiplier=1.5",
    "dp.clip=0.5",
    "dp.rows='all'",
    "privacy.level='full'",
    "train.algorithms=['fedavg']",
]


def config(*overrides: str) -> Config:
    return Config.from_toml(None, [*SMALL, *overrides])


# -- the sampler -------------------------------------------------------------------------------


def test_the_sampler_has_the_discrete_gaussian_pmf_at_a_small_sigma():
    sigma, n = 1.5, 200_000
    draws = discrete_gaussian.sample(sigma, n, np.random.default_rng(7))
    support = np.arange(-60, 61)
    weights = np.exp(-(support**2) / (2 * sigma**2))
    pmf = weights / weights.sum()  # P(X = x) = exp(-x^2 / 2 sigma^2) / sum_y exp(-y^2 / 2 sigma^2)
    edges = np.arange(-5, 6)  # cells -5..5 one by one, the two tails lumped
    observed = [np.sum(draws <= -6)] + [np.sum(draws == x) for x in edges] + [np.sum(draws >= 6)]
    expected = [pmf[support <= -6].sum()]
    expected += [pmf[support == x].sum() for x in edges] + [pmf[support >= 6].sum()]
    assert stats.chisquare(observed, n * np.array(expected)).pvalue > 1e-3
    assert draws.dtype == np.int64 and len(draws) == n
    assert len(discrete_gaussian.sample(sigma, 0, np.random.default_rng(0))) == 0
    with pytest.raises(ValueError, match="sigma > 0"):
        discrete_gaussian.sample(0.0, 5, np.random.default_rng(0))


def test_the_sampler_has_mean_zero_and_variance_sigma_squared_at_a_large_sigma():
    # for sigma >= 1 the discrete Gaussian's variance is sigma^2 to ~exp(-2 pi^2 sigma^2)
    sigma, n = 40.0, 200_000
    draws = discrete_gaussian.sample(sigma, n, np.random.default_rng(3)).astype(np.float64)
    assert abs(draws.mean()) < 4 * sigma / math.sqrt(n)
    assert draws.var() == pytest.approx(sigma**2, rel=4 * math.sqrt(2 / n))
    assert stats.kurtosis(draws) == pytest.approx(0.0, abs=0.05)  # Gaussian, not Laplace


# -- the node's share and the round's encoding -------------------------------------------------


def test_the_scale_is_the_largest_power_of_two_whose_sums_cannot_wrap():
    # a clip that puts the finest scale just below a power of two when the noise's sqrt(d) / 2
    # rounding term (4% of the range here) is counted: dropping it would pick twice the scale
    k, k_min, z, d = 4, 1, 100.0, 4 * 10**9
    margin = 14 * math.sqrt(k / k_min) * z
    room = 2**31 - 1 - k / 2 - margin * math.sqrt(d) / 2
    tight = room / (2**19 * 0.99 * (k + margin))
    cases = [(tight, z, k, k_min, d)]
    for clip, z, k, k_min, d in [
        *cases,
        (1.0, 1.0, 10, 10, 10**6),
        (0.3, 5.0, 1000, 600, 40),
        (2, 0.5, 2, 1, 7),
    ]:
        noise = DiscreteNoise.for_round(clip, z, k, k_min, d)

        def worst(scale, clip=clip, z=z, k=k, k_min=k_min, d=d):
            # K (C s + 1/2) + 14 sqrt(K / K_min) z Delta
            delta = clip * scale + math.sqrt(d) / 2
            return k * (clip * scale + 0.5) + 14 * math.sqrt(k / k_min) * z * delta

        assert math.log2(noise.scale).is_integer()
        assert worst(noise.scale) < 2**31 <= worst(2 * noise.scale)
        delta = clip * noise.scale + math.sqrt(d) / 2
        assert noise.share_std == pytest.approx(z * delta / math.sqrt(k_min), rel=1e-12)


def test_a_share_is_the_clipped_weighted_update_in_fixed_point_plus_discrete_noise():
    noise = DiscreteNoise.for_round(1.0, 1.0, 4, 4, 3)
    x = np.array([3.0, -4.0, 0.0])  # norm 5: clipped to 1, then weight 0.5
    exact = np.rint(x * (1.0 / 5.0) * 0.5 * noise.scale)
    assert clipped_integers(x, 0.5, noise).tolist() == exact.tolist()
    small = np.array([0.1, 0.2, -0.05])  # inside the ball: not scaled
    assert clipped_integers(small, 1.0, noise).tolist() == np.rint(small * noise.scale).tolist()
    share = noisy_share(x, 0.5, noise, np.random.default_rng(0))
    signed = share.view(np.int32).astype(np.float64) - exact
    assert share.dtype == np.uint32 and np.all(np.abs(signed) < 20 * noise.share_std)
    assert not np.array_equal(signed, np.zeros(3))
    assert clipped_integers(x, 0.0, noise).tolist() == [0, 0, 0]  # weight 0: nothing
    with pytest.raises(ValueError, match=r"weight must be in \[0, 1\]"):
        clipped_integers(x, 1.5, noise)
    with pytest.raises(ValueError, match="lays out 3"):
        clipped_integers(np.zeros(4), 1.0, noise)


def test_the_decoded_sum_is_the_clipped_sum_plus_noise_of_k_shares():
    k, d, z, clip = 8, 4000, 1.2, 0.7
    noise = DiscreteNoise.for_round(clip, z, k, k, d)
    rng = np.random.default_rng(11)
    vectors = [rng.normal(size=d) * s for s in (0.001, 0.01, 1.0, 3.0, 0.02, 0.5, 0.0, 1.0)]
    shares = [
        noisy_share(v, 1.0, noise, np.random.default_rng(100 + i)) for i, v in enumerate(vectors)
    ]
    total = np.zeros(d, dtype=np.uint64)
    for share in shares:
        total = (total + share) % 2**32
    decoded = noise.coding.decode_sum(total.astype(np.uint32))
    clipped = sum(
        v * min(1.0, clip / np.linalg.norm(v)) if np.linalg.norm(v) else v for v in vectors
    )
    residual = (decoded - clipped) * noise.scale  # integer units: noise + rounding (<= k / 2)
    # k shares of variance sigma_share^2 = (z Delta)^2 / k: the accounted z Delta in all
    delta = clip * noise.scale + math.sqrt(d) / 2
    assert residual.std() == pytest.approx(z * delta, rel=0.05)
    assert abs(residual.mean()) < 5 * z * delta / math.sqrt(d)


def test_a_secure_sum_with_fewer_survivors_than_k_min_cannot_be_decoded():
    slots = RowSlots({"t": np.array([0, 3])}, {"t": 2}, {})
    k, k_min = 6, 5
    noise = DiscreteNoise.for_round(1.0, 1.0, k, k_min, slots.length - INTEGER_SLOTS)
    values = {u: np.concatenate([np.full(4, 0.1 * u), np.zeros(INTEGER_SLOTS)]) for u in range(k)}

    def encode(u: int, vector: np.ndarray) -> np.ndarray:
        share = noisy_share(vector[:-INTEGER_SLOTS], 1.0, noise, np.random.default_rng(u))
        return np.concatenate([share, np.zeros(INTEGER_SLOTS, np.uint32)])

    run = dict(coding=noise.coding, encode=encode, threshold=k_min)
    sums = secure_row_sum(slots, values, 1.0, drop_before_masking=[5], **run)
    assert sums.survivors == (0, 1, 2, 3, 4)
    assert np.abs(sums.tables["t"]).max() < 1.0 + 20 * math.sqrt(k) * noise.share_std / noise.scale
    with pytest.raises(SecAggError):
        secure_row_sum(slots, values, 1.0, drop_before_masking=[4, 5], **run)


# -- the engine's round and the accountant -----------------------------------------------------


def test_a_round_without_movement_changes_every_union_value_by_the_noise_over_k(monkeypatch):
    # 6 members, shares calibrated for K_min = 5 survivors: 6 shares hold (z Delta)^2 6 / 5
    c = config(*FULL, "train.clients_per_round=6", "dp.min_survivors=5")
    setup = prepare(c)
    settings = setup.schedule.setting(DpSettings)
    assert settings is not None and settings.distributed
    thresholds = []

    def recording(*args, **kwargs):
        thresholds.append(args[3])
        return secure_row_sum(*args, **kwargs)

    monkeypatch.setattr(private_rounds, "secure_row_sum", recording)
    aggregation = build_algorithm("fedavg", setup.context).aggregation
    full = Privacy("full", download="buckets")  # p = 1: nothing divided
    noisy = distributed_dp(settings)  # the members' shares keyed by seed 0
    rounds = PrivateRounds(full, aggregation, {"t": 500}, 0, dp=noisy)
    members, per = 6, 50
    rows = torch.arange(members * per) % 300
    update = CohortUpdate(
        clients=torch.arange(members),
        weights=torch.ones(members, dtype=torch.float64),
        multiplicity=torch.ones(members, dtype=torch.int64),
        rows={"t": rows},
        row_owner={"t": torch.arange(members).repeat_interleave(per)},
        table_deltas={"t": torch.zeros(members * per, 4, dtype=torch.float64)},
        dense_deltas={"w": torch.zeros(members, 30, dtype=torch.float64)},
    )
    rounds._requests = {
        j: {"t": np.unique(rows[j * per : (j + 1) * per].numpy())} for j in range(members)
    }
    rounds._round = 1
    out = rounds.combine(update)
    assert thresholds == [5]  # secagg cannot unmask fewer than K_min (majority would be 4)
    assert out.tables["t"].rows.tolist() == sorted(set(rows.tolist()))
    values = torch.cat([out.tables["t"].values.flatten(), out.dense["w"]]).numpy()
    d = 300 * 4 + 30
    noise = DiscreteNoise.for_round(0.5, 1.5, members, 5, d)
    delta = 0.5 * noise.scale + math.sqrt(d) / 2
    # z Delta sqrt(6 / 5) in integer units, decoded (over s), over K = 6
    std = 1.5 * delta * math.sqrt(6 / 5) / noise.scale / members
    assert values.std() == pytest.approx(std, rel=0.06)
    assert stats.kstest(values / std, "norm").pvalue > 1e-3
    # randomized-response download (p = 0.8): the same shares, the rows' sums over K p
    rr = PrivateRounds(Privacy("full", download_keep=0.8), aggregation, {"t": 500}, 0, dp=noisy)
    rr._requests, rr._round = rounds._requests, 1
    unbiased = rr.combine(update)
    expected = out.tables["t"].values / 0.8
    torch.testing.assert_close(unbiased.tables["t"].values, expected, rtol=1e-12, atol=0)
    assert torch.equal(unbiased.dense["w"], out.dense["w"])


def test_distributed_epsilon_is_dp_accountings_zcdp_composition_without_amplification():
    c = config(*FULL)
    settings = dp_of(c, 200)
    assert settings is not None
    z, delta = 1.5, 200**-1.1
    for rounds in (1, 4, 30):
        accountant = rdp.RdpAccountant()
        # replace-one: (2 Delta)^2 / (2 K sigma_share^2) = 2 / z^2; Kairouz et al.'s tau d is
        # below 1e-1000 at sigma_share >= 16 (zero in double precision)
        accountant.compose(dp_accounting.ZCDpEvent(2 / z**2), rounds)
        assert settings.epsilon(rounds) == pytest.approx(accountant.get_epsilon(delta), rel=1e-9)
    central = dp_of(config(*FULL[:4], "train.algorithms=['fedavg']"), 200)
    assert central is not None and central.epsilon(30) < settings.epsilon(30)


def test_kairouz_tau_is_negligible_at_the_share_floor():
    # tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1)), summed here term by term in
    # log space (each term underflows double precision)
    sigma, n = SHARE_STD_FLOOR, 1000
    logs = [-2 * math.pi**2 * sigma**2 * k / (k + 1) for k in range(1, n)]
    log_tau = math.log(10) + max(logs) + math.log(sum(math.exp(v - max(logs)) for v in logs))
    assert log_tau + math.log(2**32) < math.log(10) * -1000  # tau d < 1e-1000 for d < 2^32
    for k_min, k, d in [(0, 4, 10), (5, 4, 10), (2, 4, 0), (2, 2**32, 10)]:
        with pytest.raises(ValueError, match="need 1 <= min_survivors <= cohort"):
            DiscreteNoise.for_round(1.0, 1.0, k, k_min, d)
    with pytest.raises(ValueError, match="cannot fit the secure sum's 32 bits"):
        DiscreteNoise.for_round(1.0, 1e6, 4, 1, 2**31)  # the noise's margin alone overflows
    with pytest.raises(ValueError, match="noise share would have sigma"):
        DiscreteNoise.for_round(1e-9, 1e-9, 4, 4, 10)  # C s stays large; z Delta / 2 < 16


def test_a_run_at_full_reports_the_distributed_epsilon_and_repeats_when_seeded():
    c = config(*FULL, "dp.randomness='seeded'", "privacy.randomness='seeded'")
    first, second = experiment.compare(c, None), experiment.compare(c, None)
    settings = dp_of(c, 200)
    assert settings is not None
    history = first.histories["fedavg"]
    assert [e.metrics["epsilon"] for e in history] == [settings.epsilon(e.round) for e in history]
    a, b = first.params["fedavg"].state_dict(), second.params["fedavg"].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the members' noise is seeded
    assert all(torch.isfinite(v).all() for v in a.values())
    # the default: the members' noise (and the cohorts) from the run's secret, not the seed
    secret = experiment.compare(config(*FULL), None).params["fedavg"].state_dict()
    assert not all(torch.equal(a[k], secret[k]) for k in a)


def test_a_secure_sum_never_runs_without_the_noise_dp_asks_for(monkeypatch):
    """[dp] at full with no [dp] round before the private rounds (a feature order broken, a
    dp adapter that contributes nothing) is refused, not trained without noise."""
    from fedsub.engine.contribution import Feature
    from fedsub.engine.features import assembly
    from fedsub.engine.features import dp as dp_feature

    silent = Feature(dp_feature.NAME, lambda setup: None)
    replaced = tuple(silent if f is dp_feature.FEATURE else f for f in assembly.FEATURES)
    assert replaced != assembly.FEATURES
    monkeypatch.setattr(assembly, "FEATURES", replaced)
    with pytest.raises(FedsubError, match=r"\[dp\] at privacy.level 'full'"):
        experiment.compare(config(*FULL), None)


def test_a_target_epsilon_at_full_calibrates_for_the_zcdp_event():
    c = config(*[o for o in FULL if "noise_multiplier" not in o], "dp.target_epsilon=20.0")
    settings = dp_of(c, 200)
    assert settings is not None
    assert 0.99 * 20.0 <= settings.epsilon(c.train.rounds) <= 20.0


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["dp.rows='private'"], "no party sees under secure aggregation"),
        (["train.sampling='poisson'"], "calibrated for a cohort size"),
        (["dp.adaptive_clip=true"], "its own secure sum"),
        (["dp.weight_cap=5.0"], "uniform weights"),
        (["dp.min_survivors=21"], "exceeds train.clients_per_round"),
        (["train.algorithms=['fedsubavg']"], "exact secure heat"),
    ],
)
def test_what_distributed_dp_cannot_do_is_refused(extra, says):
    with pytest.raises(ConfigError, match=says):
        config(*FULL, *extra)


def test_min_survivors_is_refused_below_full():
    central = ("dp.mechanism='gaussian'", "dp.noise_multiplier=1.0")
    with pytest.raises(ConfigError, match=r"privacy\.level = 'full' only"):
        config(*central, "dp.min_survivors=1")
    assert config(*central, "dp.min_survivors=0").dp.min_survivors == 0  # the default passes


def test_the_refusals_boundaries_at_full_are_accepted():
    # the whole cohort as K_min, and a weight cap just below any count (0: uniform) pass
    assert config(*FULL, "dp.min_survivors=20").dp.min_survivors == 20
    assert config(*FULL, "dp.weight_cap=0").dp.weights.weight_cap == 0
    with pytest.raises(ConfigError, match="uniform weights"):
        config(*FULL, "dp.weight_cap=0.5")
