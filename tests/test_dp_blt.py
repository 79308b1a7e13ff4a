"""DP-FTRL with BLT noise (dp/blt_noise.py, dp/ftrl_blt.py, ``dp.mechanism = "ftrl-blt"``): the
noise against the dense matrix formula C^-1 z written out here, the sparse rows against the
dense stream bit for bit, jax-privacy's sensitivity against a brute force over every allowed
participation set and sign, epsilon against dp-accounting from the brute force, a run, and the
refusals."""

from __future__ import annotations

import importlib.util
import itertools
import math
import types

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp

from fedsub.config import Config
from fedsub.dp import blt_noise, tree_noise
from fedsub.dp.blt_noise import BltStrategy, DenseBlt
from fedsub.dp.participation import Pattern
from fedsub.errors import ConfigError

pytest.importorskip("jax_privacy", reason="ftrl-blt's strategy is jax-privacy's (fedsub[blt])")

STRATEGY = BltStrategy((0.9, 0.35), (0.4, 0.25))  # a BLT with positive, decreasing coefficients
ROUNDS, PATTERN, BUFFERS = 8, Pattern(2, 0), 2  # the optimised strategy of the slow tests


def key(*words: int) -> bytes:
    """A test key drawing noise stream version 1 (tests/test_dp_noise_stream.py runs the
    identities with version 2's)."""
    return tree_noise.StreamKey(bytes(words) + bytes(32 - len(words)), 1)


def written_out_matrix(strategy: BltStrategy, n: int) -> np.ndarray:
    """C[t, t] = 1, C[t, s] = sum_j omega_j theta_j^(t - s - 1) for s < t (arXiv 2408.08868,
    Section 2; jax-privacy's BufferedToeplitz docstring)."""
    c = np.eye(n)
    for t in range(n):
        for s in range(t):
            c[t, s] = sum(
                w * d ** (t - s - 1) for d, w in zip(strategy.decay, strategy.scale, strict=True)
            )
    return c


def test_dense_noise_is_c_inverse_of_the_keyed_draws() -> None:
    """y = C^-1 z row by row, z_t of a row its keyed draw at (row, level 0, node t)."""
    n, rows, dim = 12, 5, 3
    c = written_out_matrix(STRATEGY, n)
    dense = DenseBlt(STRATEGY, key(1, 2), rows, dim)
    got = np.stack([dense.increment(t) for t in range(1, n + 1)], axis=1)  # (rows, n, dim)
    for r in range(rows):
        z = np.stack(
            [
                tree_noise.entry_noise(
                    key(1, 2), np.array([r]), np.zeros(1, int), np.array([t]), dim
                )[0]
                for t in range(1, n + 1)
            ]
        )
        np.testing.assert_allclose(got[r], np.linalg.solve(c, z), atol=1e-12)
    assert abs(got.mean()) < 0.5


def test_a_resumed_dense_stream_and_the_sparse_rows_are_the_same_numbers() -> None:
    """The dense stream replayed from round 1 (a resumed run) and the selected rows' sums
    between their selections (fresh, continued from the kept buffers, or the same rows as the
    round before stepped in place, as a window's rounds) equal the dense increments bit for
    bit."""
    from fedsub.dp.ftrl_blt import BltMechanism

    dense = DenseBlt(STRATEGY, key(4), 30, 2)
    increments = {t: dense.increment(t) for t in range(1, 15)}
    resumed = DenseBlt(STRATEGY, key(4), 30, 2)
    np.testing.assert_array_equal(resumed.increment(9), increments[9])

    class Probe(BltMechanism):
        strategy = STRATEGY
        sigma = 1.0

        def key(self, stream: int) -> bytes:
            return key(4)

    mechanism = Probe.__new__(Probe)  # only sparse_noise's state is used
    mechanism.row_buffers, mechanism.selected, mechanism.pending_rows = {}, {}, None
    mechanism.window_z = {}  # the same rows stepped in rounds 4-6 and 11-12: z drawn ahead
    mechanism.settings = types.SimpleNamespace(selection=types.SimpleNamespace(window=4))
    mechanism.table_rows = {"w": 30}
    last = np.zeros(30, dtype=int)
    schedule = [(3, [1, 4, 9]), (4, [1, 9, 20]), (5, [1, 9, 20]), (6, [1, 9, 20]), (7, [1, 4])]
    schedule += [(11, [1, 4, 9, 20]), (12, [1, 4, 9, 20]), (14, [1, 4, 9, 20])]
    for t, picked in schedule:
        rows = np.array(picked)
        mechanism._commit(t)
        got = mechanism.sparse_noise("w", rows, t, 2)
        for at, r in enumerate(picked):
            expected = np.zeros(2)
            for i in range(last[r] + 1, t + 1):
                expected = expected + increments[i][r]
            np.testing.assert_array_equal(got[at], expected)
            last[r] = t
        mechanism.pending_rows = (t, {"w": (rows, np.full(len(rows), t))})


REPLAYS = [  # (rows, dim, t, since, chunk entries): one row of one entry over many rounds
    # (numpy would sum a reduction over them pairwise), and chunks of one and of two rounds
    (np.array([2, 5, 11, 40]), 3, 13, np.array([4, 9, 13, 6]), 1 << 18),
    (np.array([7]), 1, 40, np.array([4]), 1 << 18),
    (np.array([2, 5, 11, 40]), 1, 30, np.array([25, 4, 30, 12]), 1),
    (np.array([2, 5, 11]), 2, 17, np.array([4, 16, 8]), 40),
]


@pytest.mark.parametrize("decay", [(), (0.8,), (0.9, 0.35), (0.99, 0.6, 0.2)])
@pytest.mark.parametrize(("rows", "dim", "t", "since", "chunk"), REPLAYS)
def test_replay_is_the_recurrence_written_out_buffer_by_buffer(
    decay, rows, dim, t, since, chunk, monkeypatch
) -> None:
    """``replay`` against 2408.08868's Algorithm 3 written out here one buffer and one row at
    a time, bit for bit: y = z_i - omega_0 buf_0 - omega_1 buf_1 - ..., buf_j <- theta_j
    buf_j + y, and per row the sum of y_i over since_r < i <= t (added one round after
    another), from kept buffers; in chunks of rounds too (``blt_noise.CHUNK_ENTRIES``)."""
    monkeypatch.setattr(blt_noise, "CHUNK_ENTRIES", chunk)
    strategy = BltStrategy(decay, tuple(0.3 / (j + 1) for j in range(len(decay))))
    rng = np.random.default_rng(len(decay))
    done = 4
    start = rng.standard_normal((len(decay), len(rows), dim))
    state = blt_noise.RowBuffers(rows, done, start.copy())
    got = blt_noise.replay(strategy, key(8), state, t, since, dim)
    for at, row in enumerate(rows):
        buffers = [start[j, at].copy() for j in range(len(decay))]
        total = np.zeros(dim)
        for i in range(done + 1, t + 1):
            y = tree_noise.entry_noise(
                key(8), np.array([row]), np.zeros(1, int), np.array([i]), dim
            )[0]
            for j in range(len(decay)):
                y = y - strategy.scale[j] * buffers[j]
            for j in range(len(decay)):
                buffers[j] = buffers[j] * strategy.decay[j] + y
            if since[at] < i:
                total = total + y
        assert got[at].tobytes() == total.tobytes()
        for j in range(len(decay)):
            assert state.buffers[j, at].tobytes() == buffers[j].tobytes()
    assert state.done == t


def brute_sensitivity(c: np.ndarray, pattern: Pattern) -> float:
    """max over every participation set P the pattern allows and every sign of the
    contributions of ||sum_p s_p C[:, p]||: no assumption on C's signs."""
    n, best = c.shape[0], 0.0
    for size in range(1, pattern.most(n) + 1):
        for chosen in itertools.combinations(range(n), size):
            if any(b - a < pattern.min_separation for a, b in itertools.pairwise(chosen)):
                continue
            for signs in itertools.product((1.0, -1.0), repeat=size - 1):
                column = c[:, chosen[0]] + c[:, list(chosen[1:])] @ np.array(signs)
                best = max(best, float(column @ column))
    return math.sqrt(best)


@pytest.mark.parametrize(
    ("n", "separation", "most"), [(9, 1, 0), (10, 2, 0), (11, 3, 2), (7, 1, 1)]
)
def test_jax_privacys_sensitivity_is_the_brute_force(n, separation, most) -> None:
    pattern = Pattern(separation, most)
    c = written_out_matrix(STRATEGY, n)
    assert blt_noise.sensitivity(STRATEGY, n, pattern) == pytest.approx(
        brute_sensitivity(c, pattern), rel=1e-9
    )
    np.testing.assert_allclose(STRATEGY.coefficients(n), c[:, 0], rtol=1e-12)


def test_the_optimised_strategy_its_sensitivity_and_epsilon() -> None:
    """jax-privacy's optimised BLT: its sensitivity is the brute force's, it beats no
    correlation (the identity, sqrt(k)) and the tree, and the run's epsilon is dp-accounting's
    Gaussian of the multiplier computed here from the brute force."""
    from fedsub.dp import ftrl_accounting
    from fedsub.runs.run_setup import dp_of

    strategy = blt_noise.optimized(ROUNDS, PATTERN, BUFFERS)
    assert strategy.buffers == BUFFERS and all(0 < d < 1 for d in strategy.decay)
    c = written_out_matrix(strategy, ROUNDS)
    brute = brute_sensitivity(c, PATTERN)
    assert blt_noise.sensitivity(strategy, ROUNDS, PATTERN) == pytest.approx(brute, rel=1e-6)
    config = Config.from_toml(
        None,
        [
            f"train.rounds={ROUNDS}",
            "dp.mechanism='ftrl-blt'",
            "dp.noise_multiplier=2.0",
            f"dp.min_separation={PATTERN.min_separation}",
            f"dp.blt_buffers={BUFFERS}",
            "dp.rows='all'",
            "train.algorithms=['fedavg']",
        ],
    )
    settings = dp_of(config, 3000)
    assert settings is not None and settings.accounting.blt == strategy
    assert settings.update_multiplier == pytest.approx(2.0 * brute, rel=1e-6)
    z_eff = settings.update_multiplier / brute
    expected = rdp.RdpAccountant().compose(dp_accounting.GaussianDpEvent(z_eff))
    assert settings.epsilon(ROUNDS) == pytest.approx(
        expected.get_epsilon(settings.accounting.delta), rel=1e-2
    )
    assert settings.as_json()["noise"] == "ftrl-blt"
    assert settings.as_json()["blt"]["buf_decay"] == list(strategy.decay)
    # the BLT's prefix-sum error (max over rounds of ||row of A C^-1||^2 times sens^2) is
    # below the identity's (no correlation: k rounds' noise, sens sqrt(k))
    a = np.tril(np.ones((ROUNDS, ROUNDS)))
    error = (np.linalg.solve(c.T, a.T).T ** 2).sum(axis=1).max() * brute**2
    identity = ROUNDS * PATTERN.most(ROUNDS)
    assert error < identity
    assert ftrl_accounting.tree_sensitivity(ROUNDS, PATTERN) > 0


def run_blt(overrides: list[str]):
    from fedsub.runs.experiment import compare

    config = Config.from_toml(
        None,
        [
            f"train.rounds={ROUNDS}",
            "train.clients_per_round=50",
            f"eval.every={ROUNDS}",
            "dp.mechanism='ftrl-blt'",
            "dp.noise_multiplier=1.0",
            f"dp.min_separation={PATTERN.min_separation}",
            f"dp.blt_buffers={BUFFERS}",
            "dp.randomness='seeded'",
            *overrides,
        ],
    )
    return compare(config, None)


@pytest.mark.parametrize(("name", "rows"), [("fedavg", "all"), ("fedsubavg", "private")])
def test_a_run_with_blt_noise(name, rows) -> None:
    outcome = run_blt([f"train.algorithms=['{name}']", f"dp.rows='{rows}'"])
    dp = outcome.summary["algorithms"][name]["dp"]
    assert dp["noise"] == "ftrl-blt" and dp["participation"]["min_separation"] == 2
    assert len(dp["blt"]["buf_decay"]) == BUFFERS
    assert 0 < outcome.summary["algorithms"][name]["dp"]["epsilon"] < math.inf


def test_refusals(monkeypatch) -> None:
    with pytest.raises(ConfigError, match="blt_buffers applies to mechanism = 'ftrl-blt'"):
        Config.from_toml(
            None, ["dp.mechanism='ftrl-tree'", "dp.noise_multiplier=1.0", "dp.blt_buffers=3"]
        )
    with pytest.raises(ConfigError, match="blt_buffers applies to mechanism = 'ftrl-blt'"):
        Config.from_toml(
            None, ["dp.mechanism='gaussian'", "dp.noise_multiplier=1.0", "dp.blt_buffers=3"]
        )
    with pytest.raises(ConfigError, match="adaptive_clip"):
        Config.from_toml(
            None, ["dp.mechanism='ftrl-blt'", "dp.noise_multiplier=1.0", "dp.adaptive_clip=true"]
        )
    with pytest.raises(ConfigError, match="poisson"):
        Config.from_toml(
            None, ["dp.mechanism='ftrl-blt'", "dp.noise_multiplier=1.0", "train.sampling='poisson'"]
        )
    with pytest.raises(ConfigError, match="blt_buffers"):
        Config.from_toml(
            None, ["dp.mechanism='ftrl-blt'", "dp.noise_multiplier=1.0", "dp.blt_buffers=11"]
        )
    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "jax_privacy" else find(name, *a),
    )
    with pytest.raises(ConfigError, match="jax-privacy, which is not installed"):
        Config.from_toml(None, ["dp.mechanism='ftrl-blt'", "dp.noise_multiplier=1.0"])


@pytest.mark.usefixtures("flower_task_identity")
def test_a_flower_run_with_blt_noise_is_the_in_process_run(tmp_path) -> None:
    """At the Flower ServerApp the same mechanism (the registry's) adds the same keyed BLT
    noise: the seeded run's model is the in-process one."""
    import torch
    from safetensors.torch import load_file

    from .test_flower import OVERRIDES
    from .test_flower_dp import flower_run, in_process_model

    overrides = (
        *OVERRIDES,
        f"train.rounds={ROUNDS}",
        "dp.mechanism='ftrl-blt'",
        "dp.noise_multiplier=0.8",
        "dp.clip=0.5",
        "dp.randomness='seeded'",
        f"dp.min_separation={PATTERN.min_separation}",
        f"dp.blt_buffers={BUFFERS}",
    )
    flower_run(tmp_path, overrides, eval_every=ROUNDS)
    flower = load_file(tmp_path / "model.safetensors")
    for name, value in in_process_model(overrides, "fedsubavg").items():
        torch.testing.assert_close(flower[name], value, rtol=0, atol=1e-5)


def test_a_resume_refuses_a_strategy_other_than_the_one_the_run_started_with(
    tmp_path, monkeypatch
) -> None:
    """jax-privacy optimises the strategy anew at a resume; another platform or version could
    give other parameters, and two strategies' noise would be mixed under one accounting."""
    from fedsub.engine.loop import Interrupted
    from fedsub.errors import FedsubError
    from fedsub.runs.experiment import compare

    sets = [f"train.rounds={ROUNDS}", "train.clients_per_round=50", f"eval.every={ROUNDS}",
            "dp.mechanism='ftrl-blt'", "dp.noise_multiplier=1.0", "dp.randomness='seeded'",
            f"dp.min_separation={PATTERN.min_separation}", f"dp.blt_buffers={BUFFERS}",
            "train.checkpoint_every=2", "train.algorithms=['fedavg']"]  # fmt: skip
    config = Config.from_toml(None, sets)
    stop = {"after": False}

    def stopped_after_round_4(algorithm: str, round_index: int) -> None:
        stop["after"] = round_index == 4

    with pytest.raises(Interrupted):  # as Ctrl-C stops it: a checkpoint, then Interrupted
        compare(
            config, tmp_path / "run", stopped_after_round_4, stop_requested=lambda: stop["after"]
        )
    compare(config, tmp_path / "same", resume=False)  # the same strategy resumes (below)
    other = BltStrategy((0.9, 0.35), (0.4, 0.2500001))
    monkeypatch.setattr(blt_noise, "optimized", lambda *args: other)
    with pytest.raises((FedsubError, ValueError), match=r"started with the BLT strategy"):
        compare(config, tmp_path / "run", resume=True)
    monkeypatch.undo()
    resumed = compare(config, tmp_path / "run", resume=True)
    straight = (tmp_path / "same" / "fedavg" / "model.safetensors").read_bytes()
    assert (tmp_path / "run" / "fedavg" / "model.safetensors").read_bytes() == straight
    assert resumed.summary["algorithms"]["fedavg"]["dp"]["noise"] == "ftrl-blt"


def test_an_optimised_strategy_is_kept_for_its_request_and_versions(monkeypatch, tmp_path):
    """The optimiser's tens of seconds are paid once per (rounds, pattern, buffers, versions):
    a process that asks again reads the strategy back from fedsub's cache folder, the same
    numbers; a file that does not read back, or was written for other versions, is optimised
    again."""
    monkeypatch.setenv("FEDSUB_CACHE", str(tmp_path))
    calls: list[tuple] = []

    def optimize(rounds: int, pattern: Pattern, buffers: int) -> BltStrategy:
        calls.append((rounds, pattern, buffers))
        return BltStrategy((0.9 - 0.01 * len(calls), 1 / 3), (0.4, 0.1))

    monkeypatch.setattr(blt_noise, "_optimize", optimize)
    blt_noise.optimized.cache_clear()
    first = blt_noise.optimized(12, Pattern(3), 2)
    blt_noise.optimized.cache_clear()  # another process
    assert blt_noise.optimized(12, Pattern(3), 2) == first and len(calls) == 1
    (kept,) = (tmp_path / "blt").iterdir()
    blt_noise.optimized(13, Pattern(3), 2)  # another request: optimised
    assert len(calls) == 2
    kept.write_text("{not json")
    blt_noise.optimized.cache_clear()
    assert blt_noise.optimized(12, Pattern(3), 2) != first and len(calls) == 3
    monkeypatch.setattr(blt_noise, "_versions", lambda: {"jax": "0", "jax-privacy": "0"})
    blt_noise.optimized.cache_clear()
    blt_noise.optimized(12, Pattern(3), 2)
    assert len(calls) == 4
    blt_noise.optimized.cache_clear()


def test_the_sensitivity_refuses_coefficients_jax_privacy_does_not_cover():
    """jax-privacy's min-separation sensitivity holds for non-negative, non-increasing
    coefficients; its own checks are skipped in the compiled call, so fedsub's make them."""
    rising = BltStrategy((0.5,), (2.0,))  # C's column 1, 2, 1, 0.5: rises
    with pytest.raises(ValueError, match="non-increasing"):
        blt_noise.sensitivity(rising, 4, Pattern(1))
    assert blt_noise.sensitivity(STRATEGY, 4, Pattern(2)) > 1.0


def test_a_sensitivity_is_kept_for_its_request_and_versions(monkeypatch, tmp_path):
    """jax compiles the sensitivity's computation once per number of rounds (about 18 ms), and
    a run asks for every round's epsilon: each value is kept in fedsub's cache folder, and a
    process that asks again reads the same float back without jax; other rounds, another
    strategy or other versions are computed again."""
    monkeypatch.setenv("FEDSUB_CACHE", str(tmp_path))
    blt_noise.sensitivity.cache_clear()
    first = blt_noise.sensitivity(STRATEGY, 7, Pattern(2))
    blt_noise.sensitivity.cache_clear()  # another process
    compiled = blt_noise._compiled_sensitivity
    monkeypatch.setattr(blt_noise, "_compiled_sensitivity", lambda pattern: pytest.fail("jax"))
    assert blt_noise.sensitivity(STRATEGY, 7, Pattern(2)) == first
    monkeypatch.setattr(blt_noise, "_compiled_sensitivity", compiled)
    calls: list[Pattern] = []

    def counted(pattern: Pattern):
        calls.append(pattern)
        return compiled(pattern)

    monkeypatch.setattr(blt_noise, "_compiled_sensitivity", counted)
    blt_noise.sensitivity(STRATEGY, 8, Pattern(2))
    blt_noise.sensitivity(BltStrategy((0.8, 0.35), (0.4, 0.25)), 7, Pattern(2))
    monkeypatch.setattr(blt_noise, "_versions", lambda: {"jax": "0", "jax-privacy": "0"})
    blt_noise.sensitivity.cache_clear()
    assert blt_noise.sensitivity(STRATEGY, 7, Pattern(2)) == first
    assert len(calls) == 3
    blt_noise.sensitivity.cache_clear()


def test_the_versions_are_read_once_a_process(monkeypatch):
    """A run asks for the versions at every round's epsilon; importlib.metadata is read once
    (the same answer after)."""
    import importlib.metadata

    blt_noise._installed_versions.cache_clear()
    calls: list[str] = []
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda n: calls.append(n) or version(n))
    first = blt_noise._versions()
    assert first == {n: version(n) for n in ("jax", "jax-privacy")} == blt_noise._versions()
    assert calls == ["jax", "jax-privacy"]


def test_replayed_groups_are_each_groups_replay_bit_for_bit():
    """``replay_groups`` draws the z of several states (rows kept from different rounds, one
    with no rows) in one call: bit for bit each state's own ``replay``, buffers included."""
    rng = np.random.default_rng(3)
    specs = [(np.array([2, 5, 11]), 9), (np.array([1, 40]), 0), (np.array([], dtype=int), 3)]
    specs += [(np.array([7]), 12)]  # t itself: nothing to step
    t, dim = 12, 2

    def states() -> list[blt_noise.RowBuffers]:
        start = np.random.default_rng(4)
        return [
            blt_noise.RowBuffers(r, d, start.standard_normal((STRATEGY.buffers, len(r), dim)))
            for r, d in specs
        ]

    sinces = [rng.integers(d, t + 1, len(r)) for r, d in specs]
    grouped, alone = states(), states()
    got = blt_noise.replay_groups(STRATEGY, key(6), grouped, t, sinces, dim)
    for state, own, since, values in zip(alone, grouped, sinces, got, strict=True):
        expected = blt_noise.replay(STRATEGY, key(6), state, t, since, dim)
        assert values.tobytes() == expected.tobytes()
        assert own.buffers.tobytes() == state.buffers.tobytes() and own.done == state.done
