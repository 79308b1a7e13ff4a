"""Buffered-linear-Toeplitz (BLT) correlated noise for DP-FTRL, per row and without O(V) state
(``dp.mechanism = "ftrl-blt"``; dp/ftrl.py's ``BltMechanism`` uses it).

McMahan, Xu and Zhang 2024, "A Hassle-free Algorithm for Private Learning in Practice: Don't
Use Tree Aggregation, Use BLTs" (arXiv 2408.08868), after Dvijotham et al. 2024 ("Efficient
and Near-Optimal Noise Generation for Streaming Differential Privacy", arXiv 2404.16706): the
matrix mechanism releases C x + z (z ~ N(0, sigma^2) per round), and the model gets
x_t + (C^-1 z)_t each round, so it carries the prefix sum A x plus A C^-1 z. The strategy C
is lower-triangular Toeplitz with BLT parameters: buffer decays theta_j and output scales
omega_j (j < m, m buffers),

    C[t, t] = 1,   C[t, s] = sum_j omega_j theta_j^(t - s - 1)   (s < t),

and its inverse is applied online with m buffers (2408.08868 Algorithm 3, jax-privacy's
``StreamingMatrixBuilder.build_inverse``):

    y_t = z_t - sum_j omega_j buf_j,   buf_j <- theta_j buf_j + y_t   (buf_j = 0 at t = 1).

The strategy and its sensitivity come from jax-privacy (the maintained library of the paper's
authors; an optional extra, ``pip install 'fedsub[blt]'``): ``buffered_toeplitz.optimize`` for
the run's rounds and participation pattern (the paper's min-separation optimisation, Section
3), and ``toeplitz.minsep_sensitivity_squared`` for its sensitivity under that pattern
(Theorem 2 of arXiv 2405.13763: C's coefficients are non-negative and non-increasing, so the
worst user takes part every b rounds; tests/test_dp_blt.py checks it against a brute force
over every allowed participation set). The optimiser runs once per (rounds, pattern, buffers)
on the CPU (tens of seconds); its result is kept in fedsub's cache folder for the versions of
jax and jax-privacy that computed it, and jax's compiled code there too. So is each
sensitivity (``sensitivity``: jax compiles it once per number of rounds, and a run reports
every round's epsilon).

The noise: z_t of a row is ``tree_noise.entry_noise`` at (row, level 0, node t) under the
table's own AES-256 key (purpose ``BLT_PURPOSE``, apart from the tree's), so a row's y_t needs
only its z_1..z_t: a row's noise is computable on its own, and the private rows
(``rows = "private"``) draw only the selected rows, replaying the recurrence from round 1
(O(t) per row, batched in one AES call) or from the buffers kept for the rows of the previous
selection. Every path does the same floating-point operations in the same order, so the dense
stream over every row and the sparse rows are the same numbers, bit for bit
(tests/test_dp_blt.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedsub.dp.participation import Pattern
from fedsub.dp.tree_noise import (
    STREAM_VERSION,
    Key,
    RowsCounter,
    entry_noise,
    node_noise,
    stream_key,
)
from fedsub.files.atomic_files import write_atomic
from fedsub.files.cache_folder import cache_folder
from fedsub.numerics import seeding

__all__ = [
    "BLT_PURPOSE",
    "BltStrategy",
    "DenseBlt",
    "RowBuffers",
    "advance",
    "blt_key",
    "optimized",
    "replay",
    "sensitivity",
]

BLT_PURPOSE = 8  # the spawn key of the BLT's streams under seeding.DP (the tree's is 7)
INSTALL = "pip install 'fedsub[blt]' (jax-privacy, with jax on the CPU)"


@dataclass(frozen=True)
class BltStrategy:
    """A BLT strategy C by its parameters (module docstring): theta_j (``decay``) and
    omega_j (``scale``), as jax-privacy's ``BufferedToeplitz`` holds them."""

    decay: tuple[float, ...]
    scale: tuple[float, ...]

    @property
    def buffers(self) -> int:
        return len(self.decay)

    @functools.cached_property
    def decay_column(self) -> np.ndarray:
        """theta_j as an (m, 1, 1) array (the recurrence's broadcast; computed once)."""
        return np.asarray(self.decay).reshape(-1, 1, 1)

    @functools.cached_property
    def scale_column(self) -> np.ndarray:
        """omega_j as an (m, 1, 1) array."""
        return np.asarray(self.scale).reshape(-1, 1, 1)

    @functools.cached_property
    def step_column(self) -> np.ndarray:
        """omega_j and theta_j as a (2, m, 1, 1) array (``_recur_rounds``: both products of
        the buffers in one multiply)."""
        return np.stack([self.scale_column, self.decay_column])

    def coefficients(self, rounds: int) -> np.ndarray:
        """C's first column (its Toeplitz coefficients) over ``rounds`` rounds: 1, then
        sum_j omega_j theta_j^(i - 1)."""
        out = np.ones(max(rounds, 0))
        powers = np.arange(max(rounds - 1, 0))[:, None]
        if rounds > 1 and self.buffers:
            out[1:] = (np.asarray(self.decay) ** powers * np.asarray(self.scale)).sum(axis=1)
        elif rounds > 1:
            out[1:] = 0.0
        return out

    def as_json(self) -> dict:
        return {"buf_decay": list(self.decay), "output_scale": list(self.scale)}


def _jax_privacy():
    """jax and jax-privacy's matrix factorisation modules (an optional extra), with jax's
    persistent compilation cache in fedsub's cache folder unless the user set one (a run's
    start-up compiles the optimiser and one sensitivity per round length: about half of it
    is saved on the next run)."""
    try:
        import jax
        from jax_privacy.matrix_factorization import buffered_toeplitz, toeplitz
    except ImportError as error:
        raise ImportError(
            f"dp.mechanism = 'ftrl-blt' takes its strategy from jax-privacy: {INSTALL}"
        ) from error
    if getattr(jax.config, "jax_compilation_cache_dir", None) is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_folder() / "jax"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return jax, buffered_toeplitz, toeplitz


@functools.lru_cache(maxsize=16)
def optimized(rounds: int, pattern: Pattern, buffers: int = 0) -> BltStrategy:
    """jax-privacy's BLT for ``rounds`` rounds under ``pattern`` (``buffered_toeplitz.optimize``
    with its max-error loss, arXiv 2408.08868): ``buffers`` buffers, or (0) the number it
    chooses (up to 10). Kept in fedsub's cache folder by the request and the versions of jax
    and jax-privacy (``_stored``): the optimiser takes tens of seconds, and gives the same
    parameters again for the same request on the same versions."""
    request = {
        "rounds": rounds,
        "min_separation": max(pattern.min_separation, 1),
        "max_participations": pattern.max_participations or None,
        "buffers": buffers,
        "versions": _versions(),
    }
    stored = _stored(request)
    if stored is not None:
        return stored
    strategy = _optimize(rounds, pattern, buffers)
    _store(request, strategy)
    return strategy


def _versions() -> dict[str, str]:
    return dict(_installed_versions())


@functools.cache
def _installed_versions() -> tuple[tuple[str, str], ...]:
    """The installed jax and jax-privacy versions, read once a process: importlib.metadata
    parses their metadata files (about 0.5 ms a call), and a run asks at every round's
    epsilon (``sensitivity``'s request)."""
    try:
        return tuple((name, importlib.metadata.version(name)) for name in ("jax", "jax-privacy"))
    except importlib.metadata.PackageNotFoundError:  # not installed: _optimize says how
        return ()


def _strategy_file(request: dict) -> Path:
    digest = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:32]
    return cache_folder() / "blt" / f"{digest}.json"


def _stored(request: dict) -> BltStrategy | None:
    """The strategy kept for ``request``, or None (none kept, or a file that does not read
    back as one for this very request: it is optimised again)."""
    try:
        kept = json.loads(_strategy_file(request).read_text())
        if kept["request"] != request:
            return None
        return BltStrategy(
            tuple(float(v) for v in kept["buf_decay"]),
            tuple(float(v) for v in kept["output_scale"]),
        )
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):  # RuntimeError: no home
        return None


def _store(request: dict, strategy: BltStrategy) -> None:
    """Keep ``strategy`` for ``request`` (a cache that cannot be written is not used)."""
    if not request["versions"]:
        return
    with contextlib.suppress(OSError, RuntimeError):
        write_atomic(
            _strategy_file(request), json.dumps({"request": request, **strategy.as_json()})
        )


def _optimize(rounds: int, pattern: Pattern, buffers: int) -> BltStrategy:
    """jax-privacy's optimiser itself (``optimized``)."""
    jax, buffered_toeplitz, _ = _jax_privacy()
    count = {"min_buffers": buffers, "max_buffers": buffers} if buffers else {}
    with jax.enable_x64(True):
        blt = buffered_toeplitz.optimize(
            n=rounds,
            min_sep=max(pattern.min_separation, 1),
            max_participations=pattern.max_participations or None,
            **count,
        )
        decay = tuple(float(v) for v in np.asarray(blt.buf_decay))
        scale = tuple(float(v) for v in np.asarray(blt.output_scale))
    return BltStrategy(decay, scale)


@functools.lru_cache(maxsize=256)
def sensitivity(strategy: BltStrategy, rounds: int, pattern: Pattern) -> float:
    """The L2 sensitivity (in units of the clip C) of C x over the first ``rounds`` rounds
    for a user of ``pattern``: jax-privacy's ``toeplitz.minsep_sensitivity_squared``."""
    if rounds <= 0:
        return 0.0
    coefficients = strategy.coefficients(rounds)
    # jax-privacy's own preconditions, checked here: its checks need concrete arrays, and
    # the call below is compiled (once per length, instead of op by op: 5x faster)
    if (coefficients < 0).any() or (np.diff(coefficients) > 0).any():
        raise ValueError(
            f"a BLT strategy's coefficients must be non-negative, non-increasing: {strategy}"
        )
    request = {
        "sensitivity_rounds": rounds,
        "strategy": strategy.as_json(),
        "min_separation": max(pattern.min_separation, 1),
        "max_participations": pattern.max_participations or None,
        "versions": _versions(),
    }
    kept = _stored_value(request)
    if kept is not None:
        return kept
    jax, _, _ = _jax_privacy()
    with jax.enable_x64(True):
        squared = _compiled_sensitivity(pattern)(coefficients)
        value = math.sqrt(float(squared))
    _store_value(request, value)
    return value


def _stored_value(request: dict) -> float | None:
    """The sensitivity kept for ``request`` (``sensitivity``: jax compiles its computation
    for each number of rounds, about 18 ms, and a run asks for every round's epsilon), or
    None (none kept, or a file that does not read back as this very request's)."""
    try:
        kept = json.loads(_strategy_file(request).read_text())
        if kept["request"] != request:
            return None
        return float(kept["value"])
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):  # RuntimeError: no home
        return None


def _store_value(request: dict, value: float) -> None:
    """Keep ``value`` for ``request`` (as ``_store``; json keeps a float exactly)."""
    if not request["versions"]:
        return
    with contextlib.suppress(OSError, RuntimeError):
        write_atomic(_strategy_file(request), json.dumps({"request": request, "value": value}))


@functools.lru_cache(maxsize=16)
def _compiled_sensitivity(pattern: Pattern):
    """jax-privacy's ``toeplitz.minsep_sensitivity_squared`` for ``pattern``, jit-compiled
    (its input checks are ``sensitivity``'s)."""
    jax, _, toeplitz = _jax_privacy()
    return jax.jit(
        functools.partial(
            toeplitz.minsep_sensitivity_squared,
            min_sep=max(pattern.min_separation, 1),
            max_participations=pattern.max_participations or None,
            skip_checks=True,
        )
    )


def blt_key(seed: seeding.Seed, table: int, version: int = STREAM_VERSION) -> Key:
    """The AES-256 key of stream number ``table``'s BLT noise for noise stream ``version``
    (as ``tree_noise.table_key``, purpose ``BLT_PURPOSE``)."""
    return stream_key(seed, BLT_PURPOSE, table, version)


@dataclass
class RowBuffers:
    """The recurrence's state of some rows after round ``done``: buf_j of each row,
    (m, len(rows), dim)."""

    rows: np.ndarray
    done: int
    buffers: np.ndarray


def replay(
    strategy: BltStrategy, key: Key, state: RowBuffers, t: int, since: np.ndarray, dim: int
) -> np.ndarray:
    """Step ``state`` (in place) through rounds state.done + 1 .. t and return, per row,
    sum of y_i over state.done < since_r < i <= t (in units of sigma): (len(rows), dim). The
    z of every round and row come from one AES call."""
    return replay_groups(strategy, key, [state], t, [since], dim)[0]


def replay_groups(
    strategy: BltStrategy,
    key: Key,
    states: list[RowBuffers],
    t: int,
    sinces: list[np.ndarray],
    dim: int,
) -> list[np.ndarray]:
    """``replay`` of each of ``states`` (rows from different rounds: those kept from the
    previous selection, those from round 1) with the z of them all from one AES call (each
    entry is its own: the same numbers as a call per state)."""
    if not states:
        return []
    entries = [_replayed(state, t) for state in states]
    flat_rows = np.concatenate(
        [np.repeat(s.rows, len(r)) for s, r in zip(states, entries, strict=True)]
    )
    flat_rounds = np.concatenate(
        [np.tile(r, len(s.rows)) for s, r in zip(states, entries, strict=True)]
    )
    drawn = entry_noise(key, flat_rows, np.zeros(len(flat_rows), np.int64), flat_rounds, dim)
    outs, start = [], 0
    for state, rounds, since in zip(states, entries, sinces, strict=True):
        out, size = np.zeros((len(state.rows), dim)), len(state.rows) * len(rounds)
        if size:
            z = drawn[start : start + size].reshape(len(state.rows), len(rounds), dim)
            _recur(strategy, state.buffers, z, np.asarray(since), state.done + 1, out)
            state.done, start = t, start + size
        outs.append(out)
    return outs


def _replayed(state: RowBuffers, t: int) -> np.ndarray:
    """The rounds ``replay`` steps ``state`` through: state.done + 1 .. t (none without
    rows)."""
    return np.arange(state.done + 1, t + 1) if len(state.rows) else np.zeros(0, np.int64)


def _recur(
    strategy: BltStrategy,
    buffers: np.ndarray,
    z: np.ndarray,
    since: np.ndarray,
    first: int,
    out: np.ndarray,
) -> None:
    """The recurrence of ``replay`` over z's rounds (first, first + 1, ...), in place on
    ``buffers`` (m, rows, dim) and ``out``: per round y = z_i - omega_0 buf_0 - omega_1 buf_1
    - ..., then buf_j <- theta_j buf_j + y, and y added to ``out`` for the rows with since_r <
    i. Every entry sees the same floating-point operations in the same order as the
    recurrence written buffer by buffer, so every path's numbers stay the same, bit for bit
    (``_recur_rounds``, ``_add_counted``); rounds go in chunks of bounded memory."""
    if not strategy.buffers:
        _add_counted(out, z.transpose(1, 0, 2), since, first)
        return
    rows, rounds, dim = z.shape
    chunk = max(1, CHUNK_ENTRIES // max(1, (strategy.buffers + 1) * rows * dim))
    for start in range(0, rounds, chunk):
        ys = _recur_rounds(strategy, buffers, z[:, start : start + chunk])
        _add_counted(out, ys, since, first + start)


CHUNK_ENTRIES = 1 << 18  # _recur: the float64 entries of a chunk's scratch (2 MiB)


def _recur_rounds(strategy: BltStrategy, buffers: np.ndarray, z: np.ndarray) -> np.ndarray:
    """y of each of z's rounds ((rows, rounds, dim) -> (rounds, rows, dim)), stepping
    ``buffers`` in place: 2 + m numpy calls a round. One multiply gives both omega_j buf_j
    and theta_j buf_j of the buffers before the round (``BltStrategy.step_column``), y = z -
    p_0 - p_1 - ... is subtracted one product after another (never reordered), and buf_j
    <- theta_j buf_j + y is the add of y to the kept product: per entry the operations of
    ``advance``, so its numbers."""
    ys = np.empty((z.shape[1], *buffers.shape[1:]))
    products = np.empty((2, *buffers.shape))  # [omega_j buf_j, theta_j buf_j]
    scaled, decayed = products[0], products[1]
    later = list(scaled[1:])  # p_1 .. p_{m-1}, views made once
    first = scaled[0]
    multiply, subtract, add = np.multiply, np.subtract, np.add
    column = strategy.step_column
    by_round = np.ascontiguousarray(z.transpose(1, 0, 2))  # each round's z in one block
    for y, z_round in zip(ys, by_round, strict=True):
        multiply(buffers, column, out=products)
        subtract(z_round, first, out=y)
        for product in later:
            subtract(y, product, out=y)
        add(decayed, y, out=buffers)
    return ys


def _add_counted(out: np.ndarray, ys: np.ndarray, since: np.ndarray, first: int) -> None:
    """Add to ``out`` (rows, dim) each round's y ((rounds, rows, dim), rounds first, first +
    1, ...) of the rows with since_r < round, in round order: ``np.add.accumulate`` over
    ``out`` then the rounds (an accumulation is never reordered: the sums of ``out += y``
    round after round), a row's uncounted rounds (before its since_r: it counts every round
    after) adding +0.0 (what leaving them out gives, as ``out`` starts +0.0 and no sum of
    these is -0.0 unless ``out`` is)."""
    stack = np.concatenate([out[None], ys])
    if len(since) and since.max() >= first:  # some row does not count every round
        counted = since[:, None] < np.arange(first, first + len(ys))
        stack[1:][~counted.T] = 0.0
    out[...] = np.add.accumulate(stack, axis=0)[-1]


def advance(
    strategy: BltStrategy, buffers: np.ndarray, z: np.ndarray, products: np.ndarray
) -> np.ndarray:
    """One round of the recurrence (``_recur``), in place on ``buffers`` (m, rows, dim):
    y = z - omega_0 buf_0 - omega_1 buf_1 - ..., then buf_j <- theta_j buf_j + y; returns y
    (``products``: scratch of the buffers' shape)."""
    if not strategy.buffers:
        return z
    np.multiply(buffers, strategy.scale_column, out=products)
    y = z - products[0]
    for product in products[1:]:
        y -= product
    buffers *= strategy.decay_column
    buffers += y
    return y


def fresh(strategy: BltStrategy, rows: np.ndarray, dim: int) -> RowBuffers:
    """The state before round 1 (every buffer 0)."""
    return RowBuffers(rows, 0, np.zeros((strategy.buffers, len(rows), dim)))


@dataclass
class DenseBlt:
    """The BLT noise of every row of one stream, in units of sigma: the m buffers of every
    row (O(m V) state, like ``ftrl.DenseTree``'s O(log t)). A fresh or resumed stream replays
    the rounds before from the keyed noise (the same numbers)."""

    strategy: BltStrategy
    key: Key
    rows: int
    dim: int
    state: RowBuffers | None = None
    last: tuple[int, np.ndarray] | None = field(default=None)
    products: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)  # scratch
    # (first round, z of rounds first, first + 1, ...: (rows, rounds, dim)) drawn ahead (_z)
    ahead: tuple[int, np.ndarray] = field(
        default_factory=lambda: (0, np.zeros((0, 0, 0))), repr=False
    )
    counter: RowsCounter | None = field(default=None, repr=False)  # _z (a table)

    def increment(self, t: int) -> np.ndarray:
        """y_t of every row, (rows, dim) float64."""
        if self.last is not None and self.last[0] == t:  # a round combined twice
            return self.last[1]
        if self.state is None or self.state.done != t - 1:
            self.state = fresh(self.strategy, np.arange(self.rows), self.dim)
            replay(self.strategy, self.key, self.state, t - 1, np.full(self.rows, t), self.dim)
        # round t alone: replay's draw and step for every row, without its per-row bookkeeping
        # (every row counts round t), the same operations on the same numbers
        z = self._z(t)
        if self.state.buffers.size and self._ahead() == 1:  # z drawn for this round alone
            step = self._advance(z)  # advance's operations, in place on z
        else:
            if self.products.shape != self.state.buffers.shape:
                self.products = np.empty_like(self.state.buffers)
            step = np.zeros((self.rows, self.dim))
            step += advance(self.strategy, self.state.buffers, z, self.products)
        self.state.done, self.last = t, (t, step)
        return step

    def _advance(self, z: np.ndarray) -> np.ndarray:
        """``advance`` with y computed in ``z`` (this round's own) and one buffer's product at
        a time in a scratch of one buffer's size: the same operations on the same numbers
        (0 + y, which ``increment`` returns otherwise, differs from y only in a zero's sign,
        which adds as nothing)."""
        assert self.state is not None
        buffers, strategy = self.state.buffers, self.strategy
        if self.products.shape != z.shape:
            self.products = np.empty_like(z)
        scratch = self.products
        for j, scale in enumerate(strategy.scale_column):
            np.multiply(buffers[j], scale, out=scratch)
            z -= scratch
        buffers *= strategy.decay_column
        buffers += z
        return z

    def _z(self, t: int) -> np.ndarray:
        """z_t of every row, (rows, dim): a tiny stream (a bias) draws the next rounds' with
        it in one call (``AHEAD_ENTRIES``) and keeps them, a call's fixed cost once every
        few dozen rounds; each entry is its own (key, row, round), so the same numbers."""
        assert self.state is not None
        ahead = self._ahead()
        if ahead == 1:  # a round a call, into the counter blocks kept (the same numbers)
            if self.counter is None:
                self.counter = RowsCounter(self.rows, self.dim)
            return self.counter.noise(self.key, 0, t)
        first, drawn = self.ahead
        if not first <= t < first + drawn.shape[1]:
            rounds = np.arange(t, t + ahead)
            self.ahead = (t, node_noise(self.key, self.state.rows, 0, rounds, self.dim))
            first, drawn = self.ahead
        return drawn[:, t - first]

    def _ahead(self) -> int:
        """The rounds of z ``_z`` draws in one call (1: a table's, this round's alone)."""
        return max(1, AHEAD_ENTRIES // (self.rows * self.dim))


AHEAD_ENTRIES = 64  # DenseBlt: a tiny stream's entries drawn ahead in one call (ftrl's too)
