"""The keyed Gaussian noise stream of DP-FTRL (dp/tree_noise.py, dp/ziggurat.py), version 2:
its tables against Marsaglia and Tsang's (2000) recurrence written out here, each value against
the paper's algorithm written out entry by entry over the entry's AES words, the statistics of
10^6 draws against N(0, 1) (checks that reject a broken table or a dropped sign bit), position
independence, and the version kept in a run's private state (a run resumed from a checkpoint
written before versions continues with version 1 bit for bit; a new run records version 2)."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from fedsub.config import Config
from fedsub.dp import blt_noise, tree_noise, ziggurat
from fedsub.dp.ftrl import FtrlMechanism
from fedsub.dp.tree_noise import StreamKey, StreamVersionRecord
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.errors import FedsubError
from fedsub.numerics import seeding
from fedsub.runs import experiment

from . import test_dp_ftrl
from .test_dp import SMALL
from .test_dp_secret import straight_and_stopped

KEY = StreamKey(bytes(range(32)), 2)


# -- the tables: the paper's recurrence, written out ------------------------------------------


def test_the_tables_are_the_papers_recurrence_written_out() -> None:
    """Marsaglia and Tsang 2000, section 'The ziggurat for normal': n = 256 regions of area v,
    r = 3.6541528853610088 (the paper's), v = r f(r) + the tail's area, x_{i-1} = f^-1(v / x_i
    + f(x_i)); the top region closes at x = 0 (v / x_1 + f(x_1) = 1), every rectangle has
    area v, and the paper's printed v agrees."""
    r = 3.6541528853610088
    f = lambda x: math.exp(-x * x / 2)  # noqa: E731
    v = r * f(r) + math.sqrt(math.pi / 2) * math.erfc(r / math.sqrt(2))
    assert v == pytest.approx(0.00492867323399, abs=1e-13)  # the paper's printed v
    edges = [r]
    for _ in range(254):
        edges.append(math.sqrt(-2 * math.log(v / edges[-1] + f(edges[-1]))))
    x = [v / f(r), *reversed(edges)]  # x[0] the base as a rectangle, x[255] = r
    assert abs(v / x[1] + f(x[1]) - 1) < 1e-12  # the recurrence closes at the top
    np.testing.assert_allclose(ziggurat.X, x, rtol=1e-15)
    assert r == ziggurat.R and pytest.approx(v, rel=1e-15) == ziggurat.V
    np.testing.assert_allclose(ziggurat.INNER, [r, 0.0, *x[1:255]], rtol=1e-15)
    np.testing.assert_allclose(ziggurat.Y, [1.0, *(f(e) for e in x[1:])], rtol=1e-15)
    tops = [1.0, *(f(e) for e in x[1:])]
    areas = [x[i] * (tops[i - 1] - tops[i]) for i in range(2, 256)] + [x[1] * (1 - tops[1])]
    np.testing.assert_allclose(areas, v, rtol=1e-9)  # every rectangle has the base's area


# -- each value: the paper's algorithm over the entry's words, written out ---------------------


def aes_words(key: bytes, counter: list[int]) -> list[int]:
    """The two 64-bit words of AES-256(key, counter block), little-endian, written out with
    the cryptography library."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    block = np.array(counter, dtype="<u4").tobytes()
    out = Cipher(algorithms.AES(key), modes.ECB()).encryptor().update(block)
    return [int.from_bytes(out[:8], "little"), int.from_bytes(out[8:], "little")]


def written_out(key: bytes, row: int, level: int, node: int, j: int) -> tuple[float, int, str]:
    """Entry j of (row, level, node) by the paper's RNOR and nfix, one step at a time, over the
    entry's stream (Python floats; exp and log the C library's, as fedsub's rare steps take
    them): W0 = word j % 2 of block (j // 2, node, level, row), block k >= 1 at
    (j // 2 + (j % 2) 2^20 + k 2^21, node, level, row). Returns (value, blocks read, path)."""
    x_tab, inner, y = ziggurat.X, ziggurat.INNER, ziggurat.Y
    r = 3.6541528853610088

    def block(k: int) -> list[int]:  # k = 0: the pair's block, shared by its two entries
        tag = j // 2 + ((j % 2) * 2**20 + k * 2**21 if k else 0)
        return aes_words(key, [tag, node, level, row])

    def uniform(word: int) -> float:  # (top 52 bits + 1/2) / 2^52
        return ((word >> 12) + 0.5) / 2**52

    word, k, path = block(0)[j % 2], 0, ""
    while True:
        layer, negative, u = word & 255, word >> 8 & 1, word >> 11
        x = float(u) * (float(x_tab[layer]) / 2**53)
        if u < math.floor(inner[layer] / x_tab[layer] * 2**53):
            return (-x if negative else x), k, path + "q"
        if layer == 0:  # the tail: x = -ln U1 / r, y = -ln U2 until 2 y > x^2
            while True:
                k += 1
                u1, u2 = block(k)
                t = -math.log(uniform(u1)) / r
                s = -math.log(uniform(u2))
                if s + s > t * t:
                    return (-(r + t) if negative else r + t), k, path + "t"
        k += 1
        aux, word = block(k)
        drop = y[layer - 1] - y[layer]
        if y[layer] + uniform(aux) * drop < math.exp(-0.5 * x * x):
            return (-x if negative else x), k, path + "w"
        path += "r"  # rejected in the wedge: a new attempt


# found by a scan with ``written_out``: entries of KEY that take each path
PATHS = {
    "wedge": (27, 0, 0, 0),  # (row, level, node, position): accepted in its wedge at once
    "wedge rejected, then quick": (255, 0, 0, 0),
    "tail": (1483, 0, 0, 0),
    "three blocks or more": (52614, 0, 1, 0),  # rejected three times: "rrrq"
}


def test_values_are_the_papers_algorithm_over_each_entrys_words() -> None:
    """Every path of the algorithm (the fast one, a wedge accepted, a wedge rejected and a
    new attempt, the tail, more than the two blocks read at once) gives the written-out
    value, bit for bit, drawn among other entries, alone, and at other widths."""
    rows, levels, nodes = np.arange(300), np.zeros(300, int), np.full(300, 4)
    got = tree_noise.entry_noise(KEY, rows, levels, nodes, 3)
    paths = set()
    for i in range(0, 300, 7):
        for j in range(3):
            value, _, path = written_out(KEY, i, 0, 4, j)
            assert got[i, j] == value
            paths.add(path[-1])
    assert "q" in paths
    for name, (row, level, node, j) in PATHS.items():
        value, blocks, path = written_out(KEY, row, level, node, j)
        expected = {
            "wedge": path == "w",
            "wedge rejected, then quick": path.startswith("r") and path.endswith("q"),
            "tail": path.endswith("t"),
            "three blocks or more": blocks >= 3,
        }
        assert expected[name], (name, path, blocks)
        for dim in (j + 1, j + 2, 16):
            around = np.array([row + 1, row, 5])
            drawn = tree_noise.entry_noise(KEY, around, np.full(3, level), np.full(3, node), dim)
            assert drawn[1, j] == value
            alone = tree_noise.entry_noise(
                KEY, np.array([row]), np.array([level]), np.array([node]), dim
            )
            assert alone[0, j] == drawn[1, j]


# -- the statistics of 10^6 draws ---------------------------------------------------------------

N_ROWS, N_NODES = 50_000, 5  # 250,000 entries of width 4: 10^6 draws


def draws() -> np.ndarray:
    """10^6 draws of KEY: (nodes, rows, 4), every node of every row (rounds and rows)."""
    nodes = [(0, i) for i in range(N_NODES)]
    return tree_noise.every_node_noise(KEY, np.arange(N_ROWS), nodes, 4)


def failures(z: np.ndarray) -> list[str]:
    """The checks of N(0, 1) and independence that ``z`` (nodes, rows, dim) fails, each at
    about 4.5 standard errors (or p < 10^-5): none for a sound generator with this key."""
    flat = z.reshape(-1)
    n, out = len(flat), []
    if stats.kstest(flat, "norm").pvalue < 1e-5:
        out.append("Kolmogorov-Smirnov")
    if abs(flat.mean()) > 4.5 / math.sqrt(n):
        out.append("mean")
    if abs(flat.var() - 1) > 4.5 * math.sqrt(2 / n):
        out.append("variance")
    for sigmas in (2, 3, 4, ziggurat.R):  # two-sided tails, the base's tail beyond r among them
        p = 2 * stats.norm.sf(sigmas)
        if abs((abs(flat) > sigmas).sum() - n * p) > 4.5 * math.sqrt(n * p * (1 - p)):
            out.append(f"tail beyond {sigmas:.2f}")
    if abs((flat > 0).sum() - n / 2) > 4.5 * math.sqrt(n / 4):
        out.append("sign")
    edges = stats.norm.ppf(np.linspace(0, 1, 201))
    counts = np.histogram(flat, edges)[0]
    if stats.chisquare(counts).pvalue < 1e-5:
        out.append("chi-square over 200 bins")
    bound = 4.5 / math.sqrt(z[..., 0].size)
    pairs = {
        "neighbouring entries of a block": (z[..., 0], z[..., 1]),
        "neighbouring blocks": (z[..., 1], z[..., 2]),
        "neighbouring rows": (z[:, :-1, 0], z[:, 1:, 0]),
        "neighbouring rounds": (z[:-1, :, 3], z[1:, :, 3]),
        "squares of neighbours": (z[..., 0] ** 2, z[..., 1] ** 2),
    }
    for name, (a, b) in pairs.items():
        if abs(np.corrcoef(a.reshape(-1), b.reshape(-1))[0, 1]) > bound * 1.2:
            out.append(f"correlation of {name}")
    return out


def test_a_million_draws_are_standard_normal_and_independent() -> None:
    assert failures(draws()) == []


def test_the_checks_reject_a_broken_table_or_a_dropped_sign(monkeypatch) -> None:
    """The checks above can fail: tables from a wrong r, the rectangles 2% too wide, the
    sign bit dropped, or the wedges accepted without their test each fail some."""
    good = ziggurat._WIDTH.copy()
    for broken in ("r", "width", "sign", "wedge"):
        with monkeypatch.context() as patch:
            if broken == "r":
                _, x, _, _ = ziggurat.tables(3.7)
                patch.setattr(ziggurat, "_WIDTH", ziggurat._signed(x * ziggurat.SCALE))
            elif broken == "width":
                patch.setattr(ziggurat, "_WIDTH", good * 1.02)  # every rectangle 2% wide
            elif broken == "sign":
                patch.setattr(ziggurat, "_WIDTH", np.abs(good))
            else:
                every = np.r_[ziggurat.INNER[0] / ziggurat.X[0], np.ones(255)]  # no wedge test
                patch.setattr(ziggurat, "_BOUND", np.tile((every * 2.0**53).astype(np.int64), 2))
            assert failures(draws()), broken


# -- position independence ----------------------------------------------------------------------


def test_an_entrys_value_does_not_depend_on_what_else_is_drawn() -> None:
    """A row's values are the same drawn in the dense draw over every row, in any subset, in
    shuffled order, node by node or all nodes at once, and at any width (its first entries),
    rows whose entries take the slow path among them."""
    rng = np.random.default_rng(5)
    every = np.arange(3000)
    nodes = [(0, 3), (2, 1), (5, 0)]
    dense = tree_noise.every_node_noise(KEY, every, nodes, 5)
    for at, (level, index) in enumerate(nodes):
        np.testing.assert_array_equal(
            tree_noise.node_noise(KEY, every, level, np.array([index]), 5)[:, 0], dense[at]
        )
    slow = [27, 255, 1483]  # PATHS' rows (node 0, level 0): the wedge and the tail
    for size in (1, 7, 300):
        rows = np.concatenate([rng.choice(every, size, replace=False), slow])
        rng.shuffle(rows)
        for at, (level, index) in enumerate(nodes):
            levels, indices = np.full(len(rows), level), np.full(len(rows), index)
            for dim in (1, 2, 5):
                got = tree_noise.entry_noise(KEY, rows, levels, indices, dim)
                np.testing.assert_array_equal(got, dense[at][rows, :dim])
    wide = tree_noise.entry_noise(KEY, np.array(slow), np.zeros(3, int), np.zeros(3, int), 1)
    assert [written_out(KEY, r, 0, 0, 0)[2][-1] for r in slow] == ["w", "q", "t"]
    np.testing.assert_array_equal(wide[:, 0], [written_out(KEY, r, 0, 0, 0)[0] for r in slow])


def test_the_tree_and_blt_hold_their_identities_under_version_2(monkeypatch) -> None:
    """The DP-FTRL tests of the tree written for any key (the estimator written out, the
    dense tree telescoping and resuming, the sparse rows' noise, the vectorised difference)
    pass with version-2 keys too; the BLT's (dense = sparse bit for bit) likewise."""
    monkeypatch.setattr(test_dp_ftrl, "k", lambda *w: StreamKey(bytes(w) + bytes(32 - len(w)), 2))
    test_dp_ftrl.test_prefix_noise_is_the_written_out_estimator()
    test_dp_ftrl.test_dense_tree_increments_telescope_to_the_prefix()
    test_dp_ftrl.test_sparse_rows_get_the_dense_trees_noise()
    test_dp_ftrl.test_the_vectorized_difference_is_the_estimators()
    test_dp_ftrl.test_honaker_estimate_variance()
    pytest.importorskip("jax_privacy", reason="ftrl-blt's strategy is jax-privacy's")
    from . import test_dp_blt

    monkeypatch.setattr(test_dp_blt, "key", lambda *w: StreamKey(bytes(w) + bytes(32 - len(w)), 2))
    test_dp_blt.test_dense_noise_is_c_inverse_of_the_keyed_draws()
    test_dp_blt.test_a_resumed_dense_stream_and_the_sparse_rows_are_the_same_numbers()


# -- versions -----------------------------------------------------------------------------------


def test_keys_carry_their_version_and_the_versions_are_apart() -> None:
    """Version 1's keys are the derivation runs before versions used (written out here);
    version 2's have their own, so the two streams are independent; a plain key draws
    version 1; a key keeps its version through pickling; an unknown version is refused."""
    secret = seeding.Secret.fresh()
    for seed in (7, secret):
        for purpose, derive in ((7, tree_noise.table_key), (8, blt_noise.blt_key)):
            old = seeding.seed_sequence(seed, seeding.DP, purpose, 3).generate_state(8)
            v1, v2 = derive(seed, 3, 1), derive(seed, 3, 2)
            assert bytes(v1) == np.asarray(old, dtype="<u4").tobytes() and v1.version == 1
            assert len(v2) == 32 and bytes(v2) != bytes(v1) and v2.version == 2
            assert derive(seed, 3).version == tree_noise.STREAM_VERSION == 2
    plain = bytes(range(32))
    rows, zeros = np.arange(50), np.zeros(50, int)
    v1 = tree_noise.entry_noise(StreamKey(plain, 1), rows, zeros, zeros, 3)
    np.testing.assert_array_equal(tree_noise.entry_noise(plain, rows, zeros, zeros, 3), v1)
    v2 = tree_noise.entry_noise(KEY, rows, zeros, zeros, 3)
    assert not np.isin(v2, v1).any()
    again = pickle.loads(pickle.dumps(KEY))
    assert again == KEY and again.version == 2
    with pytest.raises(ValueError, match=r"version 3.*\(1, 2\)"):
        StreamKey(plain, 3)


def record(version: int = 2) -> tuple[FtrlMechanism, StreamVersionRecord]:
    mechanism = FtrlMechanism.__new__(FtrlMechanism)  # only the version's state is used
    mechanism.noise_version, mechanism.keys, mechanism.trees = version, {0: KEY}, {"w": None}
    return mechanism, StreamVersionRecord(mechanism)


def test_the_version_stage_round_trips_and_refuses_what_it_does_not_know() -> None:
    """The stage holds the version; a checkpoint without it (written before versions) loads
    as version 1 and drops what was derived with another; an unknown version or another
    tensor is refused, naming the file, the field and the versions known."""
    _, stage = record(2)
    saved = stage.state_tensors()
    assert {n: int(v) for n, v in saved.items()} == {"version": 2}
    other, loaded = record(1)
    loaded.load_state_tensors(saved)
    assert other.noise_version == 2 and other.keys == {} and other.trees == {}
    fresh, absent = record(2)
    absent.load_absent()
    assert fresh.noise_version == 1 and fresh.keys == {}
    for bad, message in (
        ({"version": torch.tensor(7)}, r"dp_noise_stream.safetensors's 'version' is 7: .*1, 2"),
        ({"version": torch.tensor(2), "x": torch.tensor(1)}, r"dp_noise_stream.safetensors holds"),
    ):
        with pytest.raises(ValueError, match=message):
            record()[1].load_state_tensors(bad)


TREE = [
    "train.rounds=6",
    "eval.every=1",
    "train.checkpoint_every=0",
    "dp.mechanism='ftrl-tree'",
    "dp.noise_multiplier=0.8",
    "dp.clip=0.5",
    "dp.min_separation=2",
]
MODES = {  # DP-FTRL-FedAvg, and DP-FTRL-FedSubAvg on the private rows
    "all": ["train.algorithms=['fedavg']", "dp.rows='all'"],
    "private": [
        "train.algorithms=['fedsubavg']",
        "dp.rows='private'",
        "dp.selection_threshold=1.0",
    ],
}


def model(folder: Path) -> bytes:
    (run,) = (p for p in folder.iterdir() if (p / "model.safetensors").exists())
    return (run / "model.safetensors").read_bytes()


def checkpoints(folder: Path) -> Path:
    (run,) = (p for p in folder.iterdir() if (p / "checkpoints").is_dir())
    return run / "checkpoints"


def older_fedsub(patch: pytest.MonkeyPatch) -> None:
    """fedsub as it ran before versions, as far as the noise goes: version 1's keys."""
    original = FtrlMechanism.__post_init__

    def version_1(self: FtrlMechanism) -> None:
        original(self)
        self.noise_version = 1

    patch.setattr(FtrlMechanism, "__post_init__", version_1)


def strip_version(checkpoints: Path) -> Path:
    """The newest checkpoint as fedsub wrote it before versions: no ``dp_noise_stream``."""
    newest = checkpoint_lib.latest(checkpoints)
    assert newest is not None
    (newest / "dp_noise_stream.safetensors").unlink()
    state = json.loads((newest / "state.json").read_text())
    state["stages"].remove("dp_noise_stream")
    (newest / "state.json").write_text(json.dumps(state))
    return newest


@pytest.mark.parametrize("rows", sorted(MODES))
def test_a_run_from_before_versions_resumes_with_version_1_bit_for_bit(tmp_path, rows) -> None:
    """A run of the older fedsub (version 1, no version in its checkpoint) stopped after
    round 3 and resumed by this one ends with the older fedsub's uninterrupted model, byte for
    byte (version 2 would give another); a new run records version 2 and resumes bit for bit;
    a checkpoint naming an unknown version is refused."""
    c = Config.from_toml(None, [*SMALL, *TREE, *MODES[rows]])
    with pytest.MonkeyPatch.context() as patch:
        older_fedsub(patch)
        straight_and_stopped(c, tmp_path / "v1", 3)
    stopped = tmp_path / "v1" / "stopped"
    strip_version(checkpoints(stopped))
    experiment.compare(c, stopped, resume=True)
    assert model(stopped) == model(tmp_path / "v1" / "straight")

    straight_and_stopped(c, tmp_path / "v2", 3)
    newest = checkpoint_lib.latest(checkpoints(tmp_path / "v2" / "stopped"))
    assert newest is not None
    saved = checkpoint_lib.load(newest)
    assert {n: int(v) for n, v in saved.stages["dp_noise_stream"].items()} == {"version": 2}
    assert model(tmp_path / "v2" / "straight") != model(tmp_path / "v1" / "straight")
    experiment.compare(c, tmp_path / "v2" / "stopped", resume=True)
    assert model(tmp_path / "v2" / "stopped") == model(tmp_path / "v2" / "straight")


def test_a_checkpoint_with_an_unknown_version_is_refused(tmp_path) -> None:
    from safetensors.torch import save_file

    c = Config.from_toml(None, [*SMALL, *TREE, *MODES["all"]])
    straight_and_stopped(c, tmp_path, 3)
    newest = checkpoint_lib.latest(checkpoints(tmp_path / "stopped"))
    assert newest is not None
    save_file({"version": torch.tensor(9)}, str(newest / "dp_noise_stream.safetensors"))
    with pytest.raises(FedsubError, match=r"dp_noise_stream.*'version' is 9: .*versions 1, 2"):
        experiment.compare(c, tmp_path / "stopped", resume=True)


def test_the_vectorised_and_the_one_at_a_time_steps_give_the_same_numbers(monkeypatch) -> None:
    """The entries not accepted at once take step 1 vectorised when many are pending and
    every step one at a time in Python when few are: a draw computed all one way or all the
    other gives the same numbers, bit for bit, tails and rejected wedges among them, and each
    is the paper's algorithm written out."""
    rows, zeros = np.arange(20_000), np.zeros(20_000, int)
    pending = np.flatnonzero(
        [written_out(KEY, r, 0, 0, 0)[2] != "q" for r in range(2_000)]
    )  # the first rows' entries not accepted at once (~1.5%)
    with monkeypatch.context() as patch:
        patch.setattr(ziggurat, "SCALAR", 0)  # every pending entry's step 1 vectorised
        vectorised = tree_noise.entry_noise(KEY, rows, zeros, zeros, 1)
    with monkeypatch.context() as patch:
        patch.setattr(ziggurat, "SCALAR", 10**9)  # every pending entry one at a time
        one_at_a_time = tree_noise.entry_noise(KEY, rows, zeros, zeros, 1)
    np.testing.assert_array_equal(vectorised, one_at_a_time)
    assert len(pending) > 15
    paths = {written_out(KEY, int(r), 0, 0, 0)[2] for r in pending}
    assert {"w", "t", "rq"} <= paths  # a wedge, a tail, a rejected wedge among them
    for r in pending:
        assert vectorised[r, 0] == written_out(KEY, int(r), 0, 0, 0)[0]


# found by a scan of rows 0 .. 3 * 10^6 (level 0, entry 0) with the written-out algorithm: the
# rare entries that leave the vectorised step 1 and go on one at a time
GOING_ON = {
    "a tail rejected twice (a third block)": (571138, 0, "t", 3),
    "a wedge rejected, then layer 1's wedge": (40299, 0, "rw", 2),
    "a wedge rejected, then the tail": (316628, 0, "rt", 2),
    "a wedge rejected three times (a third block)": (52614, 1, "rrrq", 3),
}


def test_entries_that_go_on_after_the_vectorised_step_read_their_own_later_blocks() -> None:
    """Among many pending entries (step 1 vectorised), an entry step 1 does not end goes on
    one at a time from the right block: a rejected wedge from block 2 with its new attempt's
    own kind (layer 1 a wedge, layer 0 the tail), a tail from block 1, and either reads its
    blocks beyond the two fetched ahead at their own numbers; drawn alone, every step goes one
    at a time (the new attempt's kind then decided inside that loop) to the same value."""
    for name, (row, node, path, blocks) in GOING_ON.items():
        value, read, written_path = written_out(KEY, row, 0, node, 0)
        assert (written_path, read) == (path, blocks), name
        rows = np.concatenate([np.arange(2_000), [row]])  # ~30 pending: > SCALAR
        nodes = np.concatenate([np.zeros(2_000, int), [node]])
        assert ziggurat.SCALAR < 20
        drawn = tree_noise.entry_noise(KEY, rows, np.zeros(len(rows), int), nodes, 1)
        alone = tree_noise.entry_noise(KEY, np.array([row]), np.zeros(1, int), np.array([node]), 1)
        assert (drawn[-1, 0], alone[0, 0]) == (value, value), name


def test_the_wedge_test_decides_as_the_c_librarys_exp_near_its_bound() -> None:
    """Where the wedge test's two sides are within 2^-40 (numpy's exp and the C library's
    could then disagree), the C library's exp decides it, as the one-at-a-time steps do."""
    x = np.array([0.3, 1.7, 2.9, 0.3])
    bound = np.array([math.exp(-0.5 * v * v) for v in x])
    value = np.array([bound[0], np.nextafter(bound[1], 0), np.nextafter(bound[2], 1), 0.5])
    assert ziggurat._below_exp(value, x).tolist() == [False, True, False, True]


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_a_draw_in_pieces_pools_their_pending_entries_and_gives_each_its_own_value(
    monkeypatch, dim
) -> None:
    """A draw larger than a piece (``CHUNK``: 64 entries here, so that the pieces' pending
    entries, tails and rejected wedges among them, go through one shared step at positions
    offset by their piece) gives every entry the value the paper's algorithm gives it alone
    (``written_out``) and the value of a draw in one piece, bit for bit."""
    rows = np.arange(2_000)
    levels, nodes = np.zeros(len(rows), int), np.zeros(len(rows), int)
    whole = tree_noise.entry_noise(KEY, rows, levels, nodes, dim)
    monkeypatch.setattr(tree_noise, "CHUNK", 64)
    pieces = tree_noise.entry_noise(KEY, rows, levels, nodes, dim)
    np.testing.assert_array_equal(pieces, whole)
    slow = [r for r in range(2_000) if written_out(KEY, r, 0, 0, 0)[2] != "q"]
    assert {written_out(KEY, r, 0, 0, 0)[2] for r in slow} >= {"w", "t", "rq"}
    assert [pieces[r, 0] for r in slow] == [written_out(KEY, r, 0, 0, 0)[0] for r in slow]


def test_a_rows_counter_draws_several_nodes_at_once_as_one_at_a_time() -> None:
    """``RowsCounter.nodes_noise`` (dp/ftrl.py's ``DenseTree``: a round's nodes in one draw)
    is ``noise`` of each node in turn, bit for bit, whatever it drew before with the blocks it
    keeps (more nodes, then fewer, then other levels: no block of an earlier draw left)."""
    counter = tree_noise.RowsCounter(700, 3)
    for nodes in ([(0, 6), (1, 3), (2, 1)], [(0, 8), (1, 4)], [(3, 0), (0, 2), (5, 1)], [(1, 9)]):
        together = counter.nodes_noise(KEY, nodes)
        assert together.shape == (len(nodes), 700, 3)
        for at, (level, node) in enumerate(nodes):
            alone = tree_noise.node_noise(KEY, np.arange(700), level, np.array([node]), 3)
            np.testing.assert_array_equal(together[at], alone[:, 0])
            np.testing.assert_array_equal(counter.noise(KEY, level, node), alone[:, 0])


def test_the_retry_blocks_are_the_counter_blocks_with_the_step_or_ed_in() -> None:
    """``_stepped`` (the retry counters of the entries not accepted at once, built as whole
    16-byte blocks) is ``blocks[:, None, :] | _STEP_TAGS[step : step + steps]`` byte for byte,
    from contiguous and strided counters, none to hundreds of blocks."""
    rng = np.random.default_rng(2)
    for count in (0, 1, 13, 700):
        blocks = rng.integers(0, 2**32, size=(2 * count, 4), dtype=np.uint64).astype(np.uint32)
        for counter in (blocks[:count], blocks[::2]):  # a strided one read through a copy
            for step, steps in ((1, 2), (3, 1), (7, 4)):
                expected = counter[:, None, :] | tree_noise._STEP_TAGS[step : step + steps]
                got = tree_noise._stepped(tree_noise._items(counter), step, steps)
                assert got.shape == expected.shape == (count, steps, 4)
                assert got.tobytes() == expected.tobytes()
