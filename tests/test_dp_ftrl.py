"""DP-FTRL (dp/ftrl.py, dp/tree_noise.py, dp/ftrl_accounting.py, dp/participation.py):
the generator against published answers, the tree's estimator against the formula written out
here, the sparse per-row noise against the dense tree, the sensitivity against an enumeration
of the participation patterns, epsilon against dp-accounting's tree event, and the pattern
enforced at the cohort draw."""

from __future__ import annotations

import itertools
import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import rdp

from fedsub.config import Config
from fedsub.dp import ftrl_accounting, tree_noise
from fedsub.dp.ftrl import DenseTree
from fedsub.dp.participation import ParticipationBound, Pattern
from fedsub.errors import ConfigError


def k(*words: int) -> bytes:
    """A test key: 32 bytes from a few small numbers, drawing noise stream version 1 (these
    tests pin its numbers; tests/test_dp_noise_stream.py runs the ones written for any key
    with version 2's)."""
    return tree_noise.StreamKey(bytes(words) + bytes(32 - len(words)), 1)


def test_the_keystream_is_aes_256_of_the_counter_blocks() -> None:
    """FIPS-197 appendix C.3 (AES-256), and CTR mode's keystream at those counters."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key = bytes(range(32))
    block = np.frombuffer(bytes.fromhex("00112233445566778899aabbccddeeff"), dtype="<u4")
    got = tree_noise.keystream_words(block.reshape(1, 4), key)
    assert got.astype("<u4").tobytes().hex() == "8ea2b7ca516745bfeafc49904b496089"
    counters = np.array([[5, 0, 0, 0], [6, 0, 0, 0], [9, 1, 2, 3]], dtype=np.uint32)
    for counter, words in zip(counters, tree_noise.keystream_words(counters, key), strict=True):
        ctr = Cipher(algorithms.AES(key), modes.CTR(counter.astype("<u4").tobytes())).encryptor()
        assert words.astype("<u4").tobytes() == ctr.update(bytes(16))
    assert len(tree_noise.table_key(7, 0)) == 32 and tree_noise.table_key(7, 0) != (
        tree_noise.table_key(7, 1)
    )


def test_node_noise_is_standard_normal_and_keyed() -> None:
    z = tree_noise.node_noise(k(5, 9), np.arange(300), 2, np.arange(100), 4)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    other = tree_noise.node_noise(k(5, 10), np.arange(300), 2, np.arange(100), 4)
    assert not np.allclose(z, other)
    # one row's noise is the same drawn alone or among others
    alone = tree_noise.node_noise(k(5, 9), np.array([17]), 2, np.array([40]), 4)
    np.testing.assert_array_equal(alone[0, 0], z[17, 40])


def test_entry_noise_is_box_muller_of_the_blocks_written_out() -> None:
    """Each (row, level, node) entry's pair p of normals is Box-Muller on two 53-bit uniforms
    from AES-256 of the block (p, node, level, row): u1 = ((w0 >> 5) 2^26 + (w1 >> 6)) / 2^53,
    u2 from w2, w3; z = sqrt(-2 ln(1 - u1)) (cos 2 pi u2, sin 2 pi u2), the first dim kept.
    A known answer: the statistical test above cannot see a changed bit layout or angle.
    Version 1 (the stream of runs started before versions)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key = tree_noise.StreamKey(bytes(range(32)), 1)
    rows, levels, nodes, dim = np.array([3, 7]), np.array([0, 2]), np.array([5, 1]), 3
    got = tree_noise.entry_noise(key, rows, levels, nodes, dim)
    for i in range(2):
        expected = []
        for p in range(2):
            block = np.array([p, nodes[i], levels[i], rows[i]], dtype="<u4").tobytes()
            aes = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
            w = [int(x) for x in np.frombuffer(aes.update(block), dtype="<u4")]
            u1 = ((w[0] >> 5) * 2**26 + (w[1] >> 6)) / 2**53
            u2 = ((w[2] >> 5) * 2**26 + (w[3] >> 6)) / 2**53
            radius = math.sqrt(-2.0 * math.log(1.0 - u1))
            expected += [radius * math.cos(2 * math.pi * u2), radius * math.sin(2 * math.pi * u2)]
        np.testing.assert_allclose(got[i], expected[:dim], rtol=1e-12, atol=1e-15)
    noise = tree_noise.node_noise(key, np.array([3]), 0, np.array([5]), dim)
    np.testing.assert_array_equal(noise[0, 0], got[0])


def written_out_prefix(key: bytes, rows: np.ndarray, t: int, dim: int) -> np.ndarray:
    """Kairouz et al. 2021's tree with Honaker's online estimate, written out from TF
    Privacy's EfficientTreeAggregator recursion: b(leaf) = n, b(parent) = n + (b(left) +
    b(right)) / 2, the cumulative noise the sum of b / (2 - 2^-level) over the nodes of t's
    binary decomposition."""

    def b(level: int, index: int) -> np.ndarray:
        own = tree_noise.node_noise(key, rows, level, np.array([index]), dim)[:, 0]
        if level == 0:
            return own
        return own + 0.5 * (b(level - 1, 2 * index) + b(level - 1, 2 * index + 1))

    total, start = np.zeros((len(rows), dim)), 0
    for level in range(10, -1, -1):
        if t >> level & 1:
            total += b(level, start >> level) / (2 - 0.5**level)
            start += 1 << level
    return total


def test_prefix_noise_is_the_written_out_estimator() -> None:
    key, rows = k(3, 4), np.array([0, 7, 123])
    for t in (1, 2, 3, 6, 8, 11, 16, 21):
        np.testing.assert_allclose(
            tree_noise.honaker_prefix(key, rows, t, 3), written_out_prefix(key, rows, t, 3)
        )


def test_honaker_estimate_variance() -> None:
    """A node estimate at level l has variance 1 / (2 - 2^-l) (Honaker's bottom-up bound)."""
    rows = np.arange(4000)
    for level in (1, 3):
        est = tree_noise.subtree_sum(k(1, 2), rows, level, 0, 1) / (2 - 2.0**-level)
        assert est.var() == pytest.approx(1 / (2 - 2.0**-level), rel=0.06)


def test_dense_tree_increments_telescope_to_the_prefix() -> None:
    """The buffered dense tree's increments sum to N(t), and a tree started at a later round
    (a resumed run) continues with the same numbers."""
    key, rows = k(11, 12), 5
    tree = DenseTree(key, rows, 2)
    total = np.zeros((rows, 2))
    for t in range(1, 14):
        total += tree.increment(t)
        np.testing.assert_allclose(
            total, tree_noise.honaker_prefix(key, np.arange(rows), t, 2), atol=1e-12
        )
    straight = DenseTree(key, rows, 2)
    steps = [straight.increment(t) for t in range(1, 14)]
    for start in range(2, 14):  # resumed at round ``start``: the same bits as the straight run
        resumed = DenseTree(key, rows, 2)
        for t in range(start, 14):
            assert np.array_equal(resumed.increment(t), steps[t - 1]), (start, t)


def test_sparse_rows_get_the_dense_trees_noise() -> None:
    """The per-row noise a selected row gets between its selections equals the dense tree's
    noise on that row summed over the same rounds (the sparse form is the dense tree
    restricted to the rows, no O(V) state)."""
    key, num_rows = k(21, 22), 40
    dense = DenseTree(key, num_rows, 3)
    increments = {t: dense.increment(t) for t in range(1, 20)}
    rows = np.array([3, 17, 31])
    for before, t in ((0, 5), (5, 9), (9, 19), (0, 19)):
        sparse = tree_noise.honaker_prefix(key, rows, t, 3)
        if before:
            sparse = sparse - tree_noise.honaker_prefix(key, rows, before, 3)
        expected = sum(increments[i][rows] for i in range(before + 1, t + 1))
        np.testing.assert_allclose(sparse, expected, atol=1e-12)


def enumerated_sensitivity(rounds: int, pattern: Pattern) -> float:
    """Every participation set the pattern allows, every complete dyadic node counted."""
    nodes = [
        (s, s + (1 << lv))
        for lv in range(12)
        for s in range(0, rounds, 1 << lv)
        if s + (1 << lv) <= rounds
    ]
    best = 0
    for c in range(1, pattern.most(rounds) + 1):
        for chosen in itertools.combinations(range(rounds), c):
            if any(b - a < pattern.min_separation for a, b in itertools.pairwise(chosen)):
                continue
            best = max(best, sum(sum(a <= p < e for p in chosen) ** 2 for a, e in nodes))
    return math.sqrt(best)


@pytest.mark.parametrize("rounds", [0, 1, 2, 5, 7, 8, 11, 13, 16, 19])  # 0: no rounds, no noise
@pytest.mark.parametrize(("separation", "most"), [(1, 1), (1, 3), (2, 0), (3, 2), (4, 0)])
def test_tree_sensitivity_is_the_enumerated_maximum(rounds, separation, most) -> None:
    pattern = Pattern(separation, most)
    if pattern.most(rounds) > 5:
        pytest.skip("too many patterns to enumerate")
    assert ftrl_accounting.tree_sensitivity(rounds, pattern) == pytest.approx(
        enumerated_sensitivity(rounds, pattern), abs=1e-12
    )


def test_single_participation_epsilon_matches_dp_accountings_tree_event() -> None:
    """One participation: epsilon of GaussianDpEvent(z / sens) equals dp-accounting's
    SingleEpochTreeAggregationDpEvent(z, T) (Kairouz et al. appendix D) within 1%."""
    for z, rounds in ((2.0, 150), (5.0, 1000), (1.0, 37)):
        mine = ftrl_accounting.gaussian_epsilon(
            ftrl_accounting.effective_multiplier(z, None, rounds, Pattern(rounds, 1)), 1e-6, "rdp"
        )
        relation = dp_accounting.NeighboringRelation.REPLACE_SPECIAL
        event = dp_accounting.SingleEpochTreeAggregationDpEvent(z, rounds)
        theirs = rdp.RdpAccountant(neighboring_relation=relation).compose(event).get_epsilon(1e-6)
        assert mine == pytest.approx(theirs, rel=0.01)


def test_more_participations_cost_more_and_calibration_meets_the_target() -> None:
    one = ftrl_accounting.tree_sensitivity(150, Pattern(150, 1))
    three = ftrl_accounting.tree_sensitivity(150, Pattern(50, 0))
    assert one == pytest.approx(math.sqrt(8)) and three > math.sqrt(3) * one * 0.99
    z = ftrl_accounting.calibrate_gaussian(2.0, 1e-5, "rdp")
    assert ftrl_accounting.gaussian_epsilon(z, 1e-5, "rdp") == pytest.approx(2.0, rel=1e-3)


def test_the_effective_multiplier_is_the_written_out_sum_of_inverses() -> None:
    """1 / z_eff^2 = count / z_sel^2 + sens^2 / z_tree^2, written out, at an inverse of 1
    (z_eff = 1) and without any noise released (z_eff infinite)."""
    pattern = Pattern(50, 0)
    assert ftrl_accounting.effective_multiplier(2.0, None, 1, pattern, sensitivity=2.0) == 1.0
    z = ftrl_accounting.effective_multiplier(2.0, 3.0, 150, pattern, 4.0, selections=2)
    assert z == pytest.approx(1.0 / math.sqrt(2 / 3.0**2 + (4.0 / 2.0) ** 2), rel=1e-12)
    assert ftrl_accounting.effective_multiplier(2.0, None, 1, pattern, 0.0) == math.inf


def test_kept_epsilons_are_dp_accountings_for_every_round() -> None:
    """gaussian_epsilon keeps its answers (a run asks every round): each round's epsilon of a
    150-round pattern is dp-accounting's GaussianDpEvent epsilon computed afresh, and rounds
    with an unchanged multiplier are answered from what was kept."""
    ftrl_accounting.gaussian_epsilon.cache_clear()
    pattern = Pattern(50, 0)
    multipliers = [
        ftrl_accounting.effective_multiplier(1.0, 3.0, t, pattern, selections=None)
        for t in range(1, 151)
    ]
    for z in multipliers:
        fresh = rdp.RdpAccountant().compose(dp_accounting.GaussianDpEvent(z)).get_epsilon(1e-6)
        assert ftrl_accounting.gaussian_epsilon(z, 1e-6, "rdp") == fresh
    info = ftrl_accounting.gaussian_epsilon.cache_info()
    assert info.misses == len(set(multipliers)) < len(multipliers) == info.misses + info.hits


def test_participation_bound_refuses_users_in_their_window() -> None:
    bound = ParticipationBound(Pattern(3, 2), 6)
    assert list(bound.eligible(1, None)) == [0, 1, 2, 3, 4, 5]
    bound.record(1, np.array([0, 1]))
    assert list(bound.eligible(2, None)) == [2, 3, 4, 5] and bound.refused == 2
    bound.record(2, np.array([2]))
    assert list(bound.eligible(3, np.array([0, 2, 4]))) == [4] and bound.refused == 2
    assert list(bound.eligible(4, None)) == [0, 1, 3, 4, 5] and bound.refused == 1
    bound.record(4, np.array([0]))
    assert 0 not in bound.eligible(9, None)  # k = 2 reached
    assert bound.refused == 1 and list(bound.eligible(9, np.array([0, 5]))) == [5]
    assert bound.eligible(9, None).tolist() == [1, 2, 3, 4, 5] and bound.refused == 1
    assert bound.eligible(9, None).dtype == np.int64  # positions, as the cohort draw reads them
    assert bound.eligible(5, np.array([0, 1, 3])).tolist() == [1, 3] and bound.refused == 1
    assert bound.eligible(5, None).tolist() == [1, 2, 3, 4, 5] and bound.refused == 1
    assert bound.eligible(4, None).tolist() == [1, 3, 4, 5] and bound.refused == 2


def run_ftrl(overrides: list[str]):
    from fedsub.runs.experiment import compare

    config = Config.from_toml(
        None,
        [
            "train.rounds=6",
            "train.clients_per_round=50",
            "eval.every=6",
            "dp.mechanism='ftrl-tree'",
            "dp.noise_multiplier=1.0",
            "train.algorithms=['fedsubavg']",
            *overrides,
        ],
    )
    return compare(config, None)


def drawn_cohorts(monkeypatch, overrides: list[str]):
    """The cohorts a ``run_ftrl`` run of ``overrides`` drew, round by round, and its outcome."""
    from fedsub.engine import server_round

    seen: list[np.ndarray] = []
    begin = server_round.ServerRound.begin

    def recorded(self, round_index, among=None):
        plan = begin(self, round_index, among)
        seen.append(plan.cohort.clients.copy())
        return plan

    monkeypatch.setattr(server_round.ServerRound, "begin", recorded)
    return seen, run_ftrl(overrides)


def test_cohort_draw_enforces_the_separation(monkeypatch) -> None:
    """In a run every user's rounds are at least min_separation apart (unenforced, about 12
    users of 3,000 would be drawn twice within 5 of the 6 rounds of 50)."""
    seen, outcome = drawn_cohorts(monkeypatch, ["dp.min_separation=5", "dp.randomness='seeded'"])
    assert len(seen) == 6
    last: dict[int, int] = {}
    for r, clients in enumerate(seen, start=1):
        for c in clients.tolist():
            assert r - last.get(c, -100) >= 5
            last[c] = r
    dp = outcome.summary["algorithms"]["fedsubavg"]["dp"]
    assert dp["noise"] == "ftrl-tree" and dp["participation"]["min_separation"] == 5


def test_pattern_keys_refused_beside_the_sampled_gaussian() -> None:
    with pytest.raises(ConfigError, match="min_separation"):
        Config.from_toml(
            None,
            ["dp.mechanism='gaussian'", "dp.noise_multiplier=1.0", "dp.min_separation=5"],
        )
    with pytest.raises(ConfigError, match="adaptive"):
        Config.from_toml(
            None,
            ["dp.mechanism='ftrl-tree'", "dp.noise_multiplier=1.0", "dp.adaptive_clip=true"],
        )


FTRL_SEEDED = (
    "dp.mechanism='ftrl-tree'",
    "dp.noise_multiplier=0.8",
    "dp.clip=0.5",
    "dp.randomness='seeded'",
    "dp.min_separation=2",
)


@pytest.mark.usefixtures("flower_task_identity")
@pytest.mark.parametrize(("name", "rows"), [("fedavg", "all"), ("fedsubavg", "private")])
def test_a_flower_run_with_ftrl_is_the_in_process_run(tmp_path, name, rows) -> None:
    """The Flower ServerApp draws its cohorts through the same ``ServerRound.begin``, so
    the pattern is enforced there too: with 6 users, 3 a round and min_separation 2 the
    seeded run's model is the in-process one, whose cohorts alternate."""
    from safetensors.torch import load_file

    from .test_flower import OVERRIDES
    from .test_flower_dp import flower_run, in_process_model

    overrides = (*OVERRIDES, *FTRL_SEEDED, f"dp.rows='{rows}'", f"train.algorithms=['{name}']")
    result = flower_run(tmp_path, overrides, eval_every=1)
    flower = load_file(tmp_path / "model.safetensors")
    expected = in_process_model(overrides, name)
    for key, value in expected.items():
        torch.testing.assert_close(flower[key], value, rtol=0, atol=1e-5)
    epsilons = [result["evaluations"][r]["epsilon"] for r in ("1", "2", "3")]
    assert 0 < epsilons[0] <= epsilons[1] <= epsilons[2]


def test_settings_split_the_runs_budget_and_epsilon_is_the_target() -> None:
    """z is the whole run's multiplier: k_max / z_sel^2 + sens^2 / z_tree^2 = 1 / z^2, and
    the epsilon after the configured rounds is the target."""
    from fedsub.runs.run_setup import dp_of

    config = Config.from_toml(
        None,
        [
            "train.rounds=40",
            "dp.mechanism='ftrl-tree'",
            "dp.target_epsilon=3.0",
            "dp.min_separation=8",
            "dp.rows='private'",
        ],
    )
    settings = dp_of(config, 3000)
    assert settings is not None
    pattern = Pattern(8, 0)
    k, tree = pattern.most(40), ftrl_accounting.tree_sensitivity(40, pattern)
    inverse = k / settings.selection_multiplier**2 + tree**2 / settings.update_multiplier**2
    assert inverse == pytest.approx(1 / settings.noise_multiplier**2)
    assert settings.epsilon(40) == pytest.approx(3.0, rel=1e-3)
    assert settings.epsilon(10) < settings.epsilon(20) < settings.epsilon(40)


def test_the_vectorized_difference_is_the_estimators() -> None:
    """The one-draw difference a round uses equals the estimator's prefixes subtracted (a row
    last noised in round t itself: nothing)."""
    key, rows = k(8, 9), np.array([2, 40, 41, 1000, 7, 55])
    since = np.array([0, 3, 12, 12, 8, 13])
    got = tree_noise.prefix_difference(key, rows, 13, since, 3)
    for i, row in enumerate(rows):
        expected = tree_noise.honaker_prefix(key, rows[i : i + 1], 13, 3)
        if since[i]:
            expected = expected - tree_noise.honaker_prefix(key, rows[i : i + 1], int(since[i]), 3)
        np.testing.assert_allclose(got[i], expected[0], atol=1e-12)
        assert row == rows[i]


@pytest.mark.parametrize(("t", "dim"), [(13, 3), (48, 1), (64, 2)])
def test_the_difference_draws_each_entry_once_and_sums_every_term(t, dim, monkeypatch) -> None:
    """Bit for bit the sum, term after term in ``difference_terms``' order, of each term's
    weight times its entry's noise drawn alone, while each distinct (row, level, node) is
    drawn once (a subtree under a node of the other decomposition comes in twice)."""
    key, rows = k(3, 1), np.array([2, 40, 41, 1000, 7])
    since = np.array([0, t - 1, t // 2, t - 1, t - 3])
    drawn: list[int] = []
    entry_noise = tree_noise.entry_noise

    def counted(*args):
        drawn.append(len(args[1]))
        return entry_noise(*args)

    monkeypatch.setattr(tree_noise, "entry_noise", counted)
    got = tree_noise.prefix_difference(key, rows, t, since, dim)
    distinct = 0
    for i, row in enumerate(rows):
        levels, nodes, weights = tree_noise.difference_terms(t, int(since[i]))
        distinct += len(set(zip(levels.tolist(), nodes.tolist(), strict=True)))
        total = np.zeros(dim)
        for level, node, w in zip(levels, nodes, weights, strict=True):
            one = entry_noise(key, np.array([row]), np.array([level]), np.array([node]), dim)
            total = total + one[0] * w
        assert got[i].tobytes() == total.tobytes()
    assert (
        sum(drawn) == distinct < sum(len(tree_noise.difference_terms(t, int(v))[0]) for v in since)
    )


@pytest.mark.parametrize(("t", "dim"), [(1, 1), (13, 3), (48, 1), (64, 2), (65, 1)])
@pytest.mark.parametrize("before", [0, 1, 2, 17])
def test_rows_with_one_last_round_sum_the_same_terms_in_the_same_order(t, dim, before) -> None:
    """Rows all last noised in round t - before (a window's rows: one last round, the
    uniform path) get, bit for bit, the sum term after term in ``difference_terms``' order of
    each term's weight times its entry's noise drawn alone (zero when nothing is due)."""
    key, rows = k(3, 2), np.array([2, 40, 41, 1000, 7])
    since = max(t - before, 0)
    got = tree_noise.prefix_difference(key, rows, t, np.full(len(rows), since), dim)
    levels, nodes, weights = tree_noise.difference_terms(t, since)
    for i, row in enumerate(rows):
        total = np.zeros(dim)
        for level, node, w in zip(levels, nodes, weights, strict=True):
            one = tree_noise.entry_noise(
                key, np.array([row]), np.array([level]), np.array([node]), dim
            )
            total = total + one[0] * w
        assert got[i].tobytes() == total.tobytes()


def test_windowed_selection_keeps_one_row_set_per_window(monkeypatch) -> None:
    """dp.selection_window = w: the first window updates no table row; each later window
    updates one set of rows in every one of its rounds, chosen at its first round."""
    from fedsub.dp import ftrl

    updated: dict[int, set[int]] = {}
    combine = ftrl.FtrlMechanism.combine

    def recorded(self, update, round_index):
        out = combine(self, update, round_index)
        updated[round_index] = {int(r) for u in out.tables.values() for r in u.rows.tolist()}
        return out

    monkeypatch.setattr(ftrl.FtrlMechanism, "combine", recorded)
    run_ftrl(
        [
            "train.rounds=12",
            "eval.every=12",
            "dp.min_separation=4",
            "dp.selection_window=4",
            "dp.selection_threshold=1.0",
            "dp.randomness='seeded'",
        ]
    )
    assert [updated[r] for r in (1, 2, 3, 4)] == [set()] * 4
    for first in (5, 9):
        assert updated[first]  # threshold 1: some rows pass
        assert all(updated[r] == updated[first] for r in range(first, first + 4))
    assert updated[5] != updated[9]


def test_a_window_longer_than_the_separation_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"selection_window = 8 exceeds dp\.min_separation = 4"):
        Config.from_toml(
            None,
            [
                "dp.mechanism='ftrl-tree'",
                "dp.noise_multiplier=1.0",
                "dp.min_separation=4",
                "dp.selection_window=8",
            ],
        )
    with pytest.raises(ConfigError, match="selection_window applies to mechanism = 'ftrl-tree'"):
        Config.from_toml(
            None, ["dp.mechanism='gaussian'", "dp.noise_multiplier=1.0", "dp.selection_window=2"]
        )


def test_the_pattern_and_the_rows_last_rounds_survive_a_checkpoint() -> None:
    """The stages a resumed run reads back: the participation bound (so it keeps refusing the
    same users) and the selected rows' last rounds (so their noise continues the tree)."""
    bound = ParticipationBound(Pattern(3, 2), 5)
    bound.record(1, np.array([0, 4]))
    again = ParticipationBound(Pattern(3, 2), 5)
    again.load_state_tensors(bound.state_tensors())
    assert list(again.eligible(2, None)) == list(bound.eligible(2, None)) == [1, 2, 3]
    with pytest.raises(ValueError, match="participation bound"):
        ParticipationBound(Pattern(3, 2), 6).load_state_tensors(bound.state_tensors())

    from fedsub.dp.ftrl import FtrlMechanism
    from fedsub.runs.run_setup import dp_of

    config = Config.from_toml(
        None, ["dp.mechanism='ftrl-tree'", "dp.noise_multiplier=1.0", "dp.randomness='seeded'"]
    )
    settings = dp_of(config, 3000)
    assert settings is not None
    mechanism = FtrlMechanism(settings, {"w": 100}, np.ones(3000))
    mechanism.pending_rows = (4, {"w": (np.array([7, 9]), np.array([4, 4]))})
    saved = mechanism.state_tensors()
    resumed = FtrlMechanism(settings, {"w": 100}, np.ones(3000))
    resumed.load_state_tensors(saved)
    assert list(resumed.last_rounds("w", np.array([7, 8, 9]))) == [4, 0, 4]


@pytest.mark.parametrize("cap", [0.0, 0.5, 1.0, 4.0])  # 1: the rule's at K = 50, epsilon 1
def test_the_host_cap_of_the_heat_is_the_clamp(cap) -> None:
    """The selections cap the noisy heat on the host (``capped``, numpy): the same numbers as
    torch's clamp at D / heat_cap, written out here (and the heat itself without a cap)."""
    from fedsub.dp.ftrl import FtrlMechanism
    from fedsub.runs.run_setup import dp_of

    config = Config.from_toml(
        None,
        [
            "dp.mechanism='ftrl-tree'",
            "dp.noise_multiplier=1.0",
            "dp.randomness='seeded'",
            f"dp.heat_cap={cap}",
        ],
    )
    settings = dp_of(config, 3000)
    assert settings is not None
    mechanism = FtrlMechanism(settings, {"w": 100}, np.ones(3000), heat=True)
    heat = np.random.default_rng(4).uniform(0.0, 3.0 * mechanism.denominator, 200)
    host = mechanism.capped(heat)
    floor = mechanism.denominator / cap if cap > 0 else -math.inf
    clamped = torch.from_numpy(heat).clamp(min=floor).numpy()
    assert host.tobytes() == clamped.tobytes()
    assert (host > heat).any() == (cap > 0)


def server_round_of(overrides: list[str], monkeypatch):
    """The server round a short run drew its cohorts with."""
    from fedsub.engine import server_round

    seen = []
    begin = server_round.ServerRound.begin

    def recorded(self, round_index, among=None):
        seen.append(self)
        return begin(self, round_index, among)

    monkeypatch.setattr(server_round.ServerRound, "begin", recorded)
    config = Config.from_toml(
        None,
        [
            "train.rounds=1",
            "train.clients_per_round=50",
            "eval.every=1",
            "dp.noise_multiplier=1.0",
            "train.algorithms=['fedsubavg']",
            *overrides,
        ],
    )
    from fedsub.runs.experiment import compare

    compare(config, None)
    return seen[0]


def test_the_pattern_is_dps_cohort_filter_and_both_states_are_checkpoint_stages(
    monkeypatch,
) -> None:
    """[dp]'s contribution under DP-FTRL: the participation bound is its cohort filter (the
    spine asks it at every draw), and the bound and the selected rows' last rounds are
    checkpoint stages; the sampled Gaussian has neither."""
    from fedsub.engine.features.dp import dp_round_of

    rounds = server_round_of(["dp.mechanism='ftrl-tree'", "dp.min_separation=2"], monkeypatch)
    dp = dp_round_of(rounds.features)
    contribution = rounds.features.of("dp")
    assert dp is not None and isinstance(dp.participation, ParticipationBound)
    assert contribution is not None and contribution.draw.filter is dp.participation
    assert int((dp.participation.count == 1).sum()) == 50  # round 1's cohort was recorded
    assert {"dp_participation", "dp_ftrl"} <= set(rounds.stages())
    plain = server_round_of(["dp.mechanism='gaussian'"], monkeypatch)
    assert not {"dp_participation", "dp_ftrl"} & set(plain.stages())
    gaussian = plain.features.of("dp")
    assert gaussian is not None and gaussian.draw.filter is None


def test_entry_noise_is_box_muller_of_the_keystream_written_out() -> None:
    """Each block's two normals, Box-Muller on two 53-bit uniforms built from its four AES
    words (written out here with integer arithmetic as first implemented), at even and odd
    positions, for odd and even dims, rows of one call or alone."""
    key = k(13, 14)
    rows, levels, nodes = np.array([0, 5, 2**31 - 1]), np.array([0, 3, 19]), np.array([7, 0, 9])
    for dim in (1, 2, 5):
        got = tree_noise.entry_noise(key, rows, levels, nodes, dim)
        for i in range(len(rows)):
            for j in range(dim):
                counter = np.array([[j // 2, nodes[i], levels[i], rows[i]]], dtype=np.uint32)
                w = [int(x) for x in tree_noise.keystream_words(counter, key)[0]]
                u1 = ((w[0] >> 5) * (1 << 26) + (w[1] >> 6)) / 2.0**53
                u2 = ((w[2] >> 5) * (1 << 26) + (w[3] >> 6)) / 2.0**53
                radius = np.sqrt(-2.0 * np.log1p(np.float64(-u1)))
                trig = np.cos if j % 2 == 0 else np.sin
                assert got[i, j] == radius * trig(2.0 * np.pi * np.float64(u2))
        alone = tree_noise.entry_noise(key, rows[1:2], levels[1:2], nodes[1:2], dim)
        np.testing.assert_array_equal(alone[0], got[1])


def test_the_most_participations_are_the_enumerated_maximum() -> None:
    """``Pattern.most``: the largest set of rounds 1..n pairwise >= b apart, at most k of them,
    by enumeration; and the bound's edges (b = 1 allows consecutive rounds, one record per
    round)."""
    for n, b, most in itertools.product(range(0, 9), range(1, 4), range(0, 3)):
        best = 0
        for size in range(n + 1):
            for rounds in itertools.combinations(range(1, n + 1), size):
                if all(y - x >= b for x, y in itertools.pairwise(rounds)):
                    best = max(best, size)
        expected = min(best, most) if most else best
        assert Pattern(b, most).most(n) == expected, (n, b, most)
    bound = ParticipationBound(Pattern(1, 0), 4)
    bound.record(3, np.array([0, 2]))
    assert bound.eligible(4, None).tolist() == [0, 1, 2, 3]  # b = 1: the next round is fine
    with pytest.raises(ValueError, match="recorded already"):
        bound.record(3, np.array([0]))  # client 0 took part in round 3 once
    assert Pattern(2, 0).as_json() == {"min_separation": 2, "max_participations": None}
    assert Pattern(2, 3).as_json() == {"min_separation": 2, "max_participations": 3}


def test_the_commits_merge_is_a_dict_of_each_rows_last_round() -> None:
    """``_commit``'s merge (binary search, the known rows renewed in place) gives the rows
    and rounds of the merge written out here (a dict of row -> last round, the selected rows'
    new round overriding), sorted, on empty, disjoint, overlapping, all-known and unsorted
    selections."""
    from fedsub.dp.ftrl import _merged

    rng = np.random.default_rng(3)
    for size, picked in itertools.product((0, 1, 7, 200), (0, 1, 5, 150)):
        known = np.sort(rng.choice(400, size, replace=False))
        rounds = rng.integers(1, 30, size)
        for rows in (
            rng.choice(400, picked, replace=False),  # a selection, in any order
            np.sort(rng.choice(known, min(picked, size), replace=False)),  # all known
            np.array([377, 5]),  # two rows out of order
            np.array([5, 377, 9]),  # the first the least, the others out of order
        ):
            new_rounds = rng.integers(30, 60, len(rows))
            expected = dict(zip(known.tolist(), rounds.tolist(), strict=True))
            expected |= dict(zip(rows.tolist(), new_rounds.tolist(), strict=True))
            merged, merged_rounds = _merged(known.copy(), rounds.copy(), rows, new_rounds)
            assert merged.tolist() == sorted(expected)
            assert merged_rounds.tolist() == [expected[r] for r in sorted(expected)]


@pytest.mark.parametrize(
    "rows", [[3, 9, 40], [3, 9, 40, 41], [0, 3], [3, 4], [41], [2], list(range(0, 50, 3))]
)
def test_a_commit_of_known_rows_renews_them_in_place(rows) -> None:
    """When every selected row is known (a window's later rounds), the merge writes the new
    rounds into the rounds kept (no new arrays); otherwise it returns the merge written out
    here."""
    from fedsub.dp import ftrl

    known, rounds = np.array([0, 3, 9, 21, 40, 41]), np.array([1, 2, 2, 5, 5, 6])
    new, at = np.array(rows), np.full(len(rows), 7)
    merged = dict(zip(known.tolist(), rounds.tolist(), strict=True)) | dict.fromkeys(rows, 7)
    out_rows, out_rounds = ftrl._merged(known, rounds, new, at)
    assert dict(zip(out_rows.tolist(), out_rounds.tolist(), strict=True)) == merged
    assert (out_rounds is rounds) == (set(rows) <= set(known.tolist()))


@pytest.mark.parametrize("kind", ["tree", "blt"])
@pytest.mark.parametrize(("rows", "dim"), [(1, 1), (3, 2), (70, 1)])
def test_a_tiny_stream_drawn_ahead_is_the_round_by_round_stream(kind, rows, dim, monkeypatch):
    """A dense stream of at most ``AHEAD_ENTRIES`` entries (a bias) draws the next rounds'
    noise in one call; bit for bit the stream drawn a round at a time (``AHEAD_ENTRIES`` =
    1), from round 1 and resumed at round 9, a round asked twice included."""
    from fedsub.dp import blt_noise, ftrl
    from fedsub.dp.blt_noise import BltStrategy, DenseBlt

    def stream(start: int) -> ftrl.NoiseStream:
        if kind == "tree":
            return ftrl.DenseTree(k(5, 2), rows, dim)
        return DenseBlt(BltStrategy((0.9, 0.35), (0.4, 0.25)), k(5, 3), rows, dim)

    def increments(start: int, entries: int) -> list[bytes]:
        monkeypatch.setattr(ftrl, "AHEAD_ENTRIES", entries)
        monkeypatch.setattr(blt_noise, "AHEAD_ENTRIES", entries)
        noise = stream(start)
        return [noise.increment(t).tobytes() for t in [*range(start, 80), 79]]

    for start in (1, 9):
        assert increments(start, 64) == increments(start, 1)


@pytest.mark.parametrize("mechanism", ["ftrl-tree", "ftrl-blt"])
def test_a_window_read_from_what_its_first_round_kept_is_the_window_recomputed(
    mechanism, monkeypatch
) -> None:
    """A window's rows, false positives and FedSubAvg divisor are kept from the first round
    that reads its selection (``_window_kept``), and BLT's z of the window's rows drawn for
    its remaining rounds at once (``_window_z``): every round's update bit for bit what it
    is when they are computed (drawn) again each round."""
    from fedsub.dp import ftrl, ftrl_blt

    if mechanism == "ftrl-blt":
        pytest.importorskip("jax_privacy", reason="ftrl-blt's strategy is jax-privacy's")
    combine = ftrl.FtrlMechanism.combine

    def updates(recompute: bool) -> list[bytes]:
        out: list[bytes] = []

        def recorded(self, update, round_index):
            if recompute:
                self.window_rows.clear()
            got = combine(self, update, round_index)
            out.extend(
                u.rows.numpy().tobytes() + u.values.numpy().tobytes() for u in got.tables.values()
            )
            return got

        monkeypatch.setattr(ftrl.FtrlMechanism, "combine", recorded)
        if recompute:  # BLT's z of round t alone, drawn when asked
            monkeypatch.setattr(
                ftrl_blt.BltMechanism,
                "_window_z",
                lambda self, table, key, rows, t, dim: tree_noise.node_noise(
                    key, rows, 0, np.array([t]), dim
                )[:, 0],
            )
        run_ftrl(
            [
                "train.rounds=12",
                "eval.every=12",
                f"dp.mechanism='{mechanism}'",
                "dp.min_separation=4",
                "dp.selection_window=4",
                "dp.selection_threshold=1.0",
                "dp.heat_cap=4",
                "dp.randomness='seeded'",
            ]
        )
        return out

    kept = updates(False)
    assert kept == updates(True)
    assert len(set(kept[4:8])) == 4  # the rounds of a window: the same rows, other values


def test_a_tables_tree_draws_a_rounds_nodes_at_once_as_the_small_streams_do(monkeypatch):
    """A table's dense tree (more than ``SMALL_STREAM`` entries) draws the nodes a round
    completes in one call into the counter blocks it keeps (``RowsCounter.nodes_noise``),
    rounds of one node and of up to five among them: bit for bit the increments of the same
    tree drawn through the small streams' path, from round 1, resumed at round 13 and a round
    asked twice."""
    from fedsub.dp import ftrl

    def increments(start: int, small: int) -> list[bytes]:
        monkeypatch.setattr(ftrl, "SMALL_STREAM", small)
        tree = DenseTree(k(8, 4), 2100, 2)  # 4,200 entries
        return [tree.increment(t).tobytes() for t in [*range(start, 34), 33]]

    for start in (1, 13):
        assert increments(start, 4096) == increments(start, 10**9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_dense_forms_table_noise_is_rounded_once_to_the_deltas_dtype(dtype):
    """rows = "all": the table's noise sigma * increment, computed in float64 and rounded to
    the deltas' dtype straight (numpy on the CPU), is torch's sigma * increment then .to: each
    row's value (its clipped sum + that noise) / D to the last bit, round after round."""
    from fedsub.dp import clipping
    from fedsub.dp.ftrl import FtrlMechanism
    from fedsub.runs.run_setup import dp_of

    from .test_dp import cohort

    config = Config.from_toml(
        None,
        ["train.algorithms=['fedavg']", "dp.mechanism='ftrl-tree'", "dp.rows='all'",
         "dp.noise_multiplier=1.0",
         "dp.randomness='seeded'", "dp.min_separation=3", "train.clients_per_round=3"],
    )  # fmt: skip
    settings = dp_of(config, 3000)
    assert settings is not None
    members = [{3: [0.25, -1.0], 7: [0.5, 0.125]}, {3: [1.5, 2.0]}, {0: [0.75, 0.5], 7: [1, 2]}]
    update = cohort(members, [[0.0], [0.0], [0.0]])
    update.table_deltas["t"] = update.table_deltas["t"].to(dtype)
    mechanism = FtrlMechanism(settings, {"t": 5000}, np.ones(3000))
    reference = DenseTree(mechanism.key(0), 5000, 2)
    factors = clipping.clip_factors(update.squared_norms(), mechanism.clip)
    sums = torch.zeros((5000, 2), dtype=dtype)
    sums.index_add_(0, update.rows["t"], mechanism.scaled(update, factors).table_deltas["t"])
    for t in (1, 2, 3, 4):
        got = mechanism.combine(update, t).tables["t"].values
        noise = (mechanism.sigma * torch.from_numpy(reference.increment(t))).to(dtype)
        expected = (sums + noise) / mechanism.denominator
        assert got.dtype == dtype
        assert got.numpy().tobytes() == expected.numpy().tobytes()
