"""DP-FTRL for federated training (``dp.mechanism = "ftrl-tree"``): Kairouz et al. 2021,
"Practical and Private (Deep) Learning without Sampling or Shuffling" (ICML, arXiv
2103.00039), with correlated noise from tree aggregation and Honaker's online estimator
(dp/tree_noise.py), accounted for the participation pattern that runs, with no sampling
assumption (dp/ftrl_accounting.py, enforced by dp/participation.py).

The paper's server keeps the noisy prefix sums of the (clipped, summed) updates, and the
model is the initial model plus the noisy prefix sum (FTRL with the squared-distance
regulariser; fedsub's server optimizer applies it with its learning rate: with plain server
SGD and no momentum the model after t rounds is exactly theta_0 + lr (s_t + N(t)) / D). The
mechanism hands the server the difference of consecutive noisy prefix sums, so the noise
added to the model telescopes: after t rounds it is N(t), the tree's noise (variance
O(log t) node noises), not the sum of t fresh draws.

Round t's update, with the settings' clip C, the tree's node noise sigma = z_grad C and the
fixed denominator D (dp/mechanism.py steps 1, 2 and 4 unchanged):

- rows = "all" (DP-FTRL-FedAvg), every row and dense parameter: (x_t + sigma (N(t) -
  N(t - 1))) / D, N from a buffer of the O(log t) pending nodes per row (``DenseTree``,
  O(V) state, like the dense update it noises);
- rows = "private" (fedsub's sparse form, DP-FTRL-FedSubAvg): the rows selected from the
  noisy contribution histogram (dp/selection.py, its own noise and budget share) get (x_t +
  sigma (N_r(t) - N_r(t_r))) / D, t_r the last round row r was selected (0: never), so the
  row's value holds the noisy prefix sum of its selected rounds' contributions; the other
  rows are left unchanged. The leaves of a row's tree are its contributions in the rounds it
  was selected (zero otherwise), which only lowers a user's contribution, so the sensitivity
  is the dense tree's. N_r is computed from the row's own streams (O(t) node draws per
  selected row, no O(V) state: only each selected row's last round is kept); the dense
  parameters take the dense path. FedSubAvg's private heat divides the row's update by the
  noisy h_m instead of D (dp/mechanism.py step 5): the noise of successive rounds is then
  scaled differently and no longer telescopes exactly (fedsub's variant; the privacy, a
  post-processing of the tree's release, is unchanged).

Windowed selection (``dp.selection_window`` = w > 1, fedsub's design, not the paper's): the
rows are selected once every w rounds, at a window's first round, from the noisy histogram of
the previous window's w cohorts (the first window updates no table row), and every selected
row is updated in every round of the window (so its noise telescopes, t_r = t - 1). With w <=
min_separation a user is in at most one cohort of a window, so a window's histogram has the
sensitivity B of one round's and a user reaches at most k_max of them: the accounting is
unchanged, while a row's count gathers w cohorts (w K users) against one selection noise.
FedSubAvg's coefficient is then D / (h_m / w), capped at ``dp.heat_cap`` (h_m >= D /
heat_cap) when set, which bounds how much it amplifies a cold row's noise. With
``dp.selection_refresh`` = r > 1 (fedsub's) a selection serves r windows and only the
histograms of windows 0, r, 2r, ... are read, so a user adds to at most min(k_max, S) released
histograms, S the selections made (``selection.windowed_selections``): the accounting charges
that many instead of k_max (settings ``selection_count``), which lets a cohort that comes back
often (large K) spend less of the budget on the selection.

Capped selection (``dp.selection_max_rows`` = M > 0, fedsub's, per-round or windowed): of a
table's selected rows only the M of the largest noisy histogram values are kept
(``selection.largest``), so at most M rows a table are noised a round. It reads only the
released noisy histogram, so it is post-processing and the accounting is unchanged.

Privacy: the tree releases each complete node's noisy sum once (Honaker's estimates and the
differences are post-processing), so the run is one Gaussian mechanism of sensitivity
``ftrl_accounting.tree_sensitivity`` C. The noise streams are keyed by the run's secret
(dp/randomness.py); seeded runs say they guarantee nothing. Adaptive clipping and distributed
DP are refused with it (config.py).

Resume: the ``dp_ftrl`` checkpoint stage holds the selected rows' last rounds and, with a
window, the rounds gathered of the window being read (touched rows, un-noised histograms) and
the selection serving the current windows, so a run stopped mid-window resumes bit for bit.
The histograms are computed in the clear: like the run's secret (``dp_secret``) they live only
in the checkpoints, which the operator keeps private, never in a file a run publishes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from fedsub.algorithms.aggregation import RowUpdate, ServerUpdate
from fedsub.dp import clipping, selection
from fedsub.dp.mechanism import DpMechanism, RoundStats, round_generator
from fedsub.dp.tree_noise import (
    STREAM_VERSION,
    Key,
    RowsCounter,
    every_node_noise,
    prefix_difference,
    table_key,
)
from fedsub.numerics import seeding
from fedsub.submodel.transfer import CohortUpdate

STAGE = "dp_ftrl"  # the checkpoint stage of the selected rows' last rounds


def weight(level: int) -> float:
    """Honaker's 1 / (2 - 2^-l): a node estimate's weight on its b."""
    return 1.0 / (2.0 - 2.0**-level)


class NoiseStream(Protocol):
    """The correlated noise of every row of one stream (``DenseTree``; ``ftrl-blt``:
    dp/blt_noise.py's ``DenseBlt``)."""

    def increment(self, t: int) -> np.ndarray:
        """The noise of round ``t`` of every row, in units of sigma: (rows, dim) float64."""
        ...


@dataclass
class DenseTree:
    """The tree noise of every row of one stream (a table, or a dense parameter flattened to
    rows of one value), in units of sigma: the b of the nodes of the rounds' decomposition
    (TF Privacy's ``EfficientTreeAggregator`` buffer), O(log t) arrays. A fresh or resumed
    tree rebuilds its buffer by folding the streams' rounds again (``_replay``)."""

    key: Key
    rows: int
    dim: int
    done: int = 0  # rounds folded in
    stack: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    last: tuple[int, np.ndarray] | None = None  # (t, N(t) - N(t - 1)) of the latest round
    kept: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)  # _ahead
    counter: RowsCounter | None = field(default=None, repr=False)  # _fresh_nodes (a table)

    def increment(self, t: int) -> np.ndarray:
        """N(t) - N(t - 1), (rows, dim) float64."""
        if self.last is not None and self.last[0] == t:  # a round combined twice
            return self.last[1]
        if self.done != t - 1:  # fresh (t > 1) or resumed: the buffer of round t - 1
            self._replay(t - 1)
        level, index = 0, t - 1
        noise = self._fresh_nodes(t)
        # in place on arrays this round owns (``noise`` draws fresh ones; the popped nodes
        # leave the stack): the same operations on the same numbers as
        # step = 0 - left w_l ... + b w_top and b = noise + 0.5 (left + b), without the
        # temporaries (a zero can differ in its sign only, which adds as nothing)
        b, step = noise(0), None
        while self.stack and self.stack[-1][0] == level:
            _, _, left = self.stack.pop()  # leaves the decomposition: its estimate goes
            if step is None:
                step = np.multiply(left, -weight(level))
            else:
                step -= left * weight(level)
            index >>= 1
            level += 1
            left += b
            left *= 0.5
            left += noise(level)
            b = left
        self.stack.append((level, index, b))
        if step is None:
            step = b * weight(level)
        else:
            step += b * weight(level)
        self.done, self.last = t, (t, step)
        return step

    def _replay(self, rounds: int) -> None:
        """The buffer after ``rounds`` rounds, folded again from round 1 (a resumed run, or a
        tree started late): the same operations in the same order as the run that was not
        stopped, so the same numbers to the last bit. The buffer written from its formula
        (``subtree_sum``) equals it only to rounding, and a last bit flipped by a resume is
        a run that does not resume bit for bit. O(rounds) draws, once."""
        self.stack, self.done, self.last = [], 0, None
        for r in range(1, rounds + 1):
            self.increment(r)

    def _fresh_nodes(self, t: int) -> Callable[[int], np.ndarray]:
        """The noise of the node at each level that round ``t`` completes ((level, (t - 1) >>
        level), level 0 its leaf), by level, each a fresh array. A small stream (a dense
        parameter: a few rows) draws them ahead (``_ahead``), a table all of them in one call
        (into the counter blocks it keeps, ``RowsCounter.nodes_noise``); the same numbers."""
        merged = 0  # the levels merged: the complete subtrees on top of the stack
        while merged < len(self.stack) and self.stack[-1 - merged][0] == merged:
            merged += 1
        nodes = [(level, (t - 1) >> level) for level in range(merged + 1)]
        if self.rows * self.dim > SMALL_STREAM:
            if self.counter is None:
                self.counter = RowsCounter(self.rows, self.dim)
            fresh = self.counter.nodes_noise(self.key, nodes)  # the round's own arrays
            return lambda level: fresh[level]
        drawn = self._ahead(np.arange(self.rows), nodes, t)
        return lambda level: drawn[level].copy()  # kept: the round's arrays are its own

    def _ahead(self, every: np.ndarray, nodes: list[tuple[int, int]], t: int) -> list:
        """The noise of ``nodes``, drawn with the nodes of the next rounds in one call when
        the stream is tiny (a bias: ``AHEAD_ENTRIES``), then kept: a call's fixed cost once
        every few dozen rounds instead of every round. Each node's noise is its own (a
        function of the key, row, level and node only), so the same numbers."""
        if any(n not in self.kept for n in nodes):
            rounds = range(t, t + max(1, AHEAD_ENTRIES // (self.rows * self.dim)))
            wanted = [(lv, (r - 1) >> lv) for r in rounds for lv in range(_completed(r))]
            wanted = list(dict.fromkeys([*nodes, *wanted]))
            drawn = every_node_noise(self.key, every, wanted, self.dim)
            self.kept = dict(zip(wanted, drawn, strict=True))
        return [self.kept[n] for n in nodes]


AHEAD_ENTRIES = 64  # DenseTree / DenseBlt: a tiny stream's entries drawn ahead in one call
# rows = "all" on the CPU: the deltas' dtypes whose noise is rounded straight from float64 by
# numpy as torch's .to rounds it (round to nearest even, once)
HOST_NOISE = {torch.float32: np.float32, torch.float64: np.float64}


def _completed(r: int) -> int:
    """How many levels' nodes round ``r`` completes (its leaf and the merges above it: one
    more than the trailing zeros of r)."""
    return (r & -r).bit_length()


SMALL_STREAM = 4096  # DenseTree: the entries of a stream whose round draws in one call


def _merged(
    known: np.ndarray, rounds: np.ndarray, rows: np.ndarray, new_rounds: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The rows ``known`` (sorted, distinct) with their ``rounds``, and ``rows`` (distinct)
    with ``new_rounds``: every row of either once, sorted, a row of ``rows`` with its new
    round. The rows already known take theirs in place (``rounds`` is updated: a window's
    rounds after its first select the same rows again, and nothing else is written); the new
    ones are placed by binary search (a round's few selected rows among the many kept)."""
    if len(rows) > 1 and not (rows[1:] > rows[:-1]).all():  # a selection in any order
        order = np.argsort(rows, kind="stable")
        rows, new_rounds = rows[order], new_rounds[order]
    at = np.searchsorted(known, rows)
    present = at < len(known)
    present[present] = known[at[present]] == rows[present]
    rounds[at[present]] = new_rounds[present]
    if present.all():
        return known, rounds
    fresh = ~present
    place = at[fresh] + np.arange(int(fresh.sum()))  # where each new row lands in the merge
    total = len(known) + len(place)
    others = np.ones(total, dtype=bool)
    others[place] = False
    merged_rows, merged_rounds = np.empty(total, known.dtype), np.empty(total, rounds.dtype)
    merged_rows[place], merged_rounds[place] = rows[fresh], new_rounds[fresh]
    merged_rows[others], merged_rounds[others] = known, rounds
    return merged_rows, merged_rounds


def _made_once(key: seeding.Seed, round_index: int) -> Callable[[], torch.Generator]:
    """Round ``round_index``'s generator (``round_generator``), made at the first call and
    the same one at every later call (a plain closure: ``functools.cache`` of a partial
    costs more than the rounds that never draw save)."""
    made: list[torch.Generator] = []

    def generator() -> torch.Generator:
        if not made:
            made.append(round_generator(key, round_index))
        return made[0]

    return generator


@dataclass(frozen=True)
class WindowRows:
    """A window's selection as each of its rounds reads it: the rows (numpy and on the
    device), its false positives, FedSubAvg's divisor (the capped noisy heat per round, in
    the update's dtype, one per row; None without heat) and its largest coefficient."""

    picked: np.ndarray
    rows: torch.Tensor
    false_positives: int
    divisor: torch.Tensor | None
    coefficient: float


@dataclass
class FtrlMechanism(DpMechanism):
    """DP-FTRL's round (module docstring); ``combine`` as ``DpMechanism``'s."""

    trees: dict[str, NoiseStream] = field(default_factory=dict)
    # rows = "private": per table, each selected row's last round (sorted rows, rounds)
    selected: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    pending_rows: tuple[int, dict[str, tuple[np.ndarray, np.ndarray]]] | None = None
    # dp.selection_window > 1: per table, this window's rounds' (touched rows, histogram), and
    # the selection of the current window by (table, selection key); both checkpointed (the
    # dp_ftrl stage: a run resumed mid-window continues bit for bit)
    window_parts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )
    window_selected: dict[tuple[str, int], selection.Selection] = field(default_factory=dict)
    keys: dict[int, Key] = field(default_factory=dict, repr=False)  # the streams' AES keys
    # per table, the window's selection as its rounds read it (``_window_kept``)
    window_rows: dict[str, tuple] = field(default_factory=dict, repr=False)
    noise_version: int = STREAM_VERSION  # the keys' noise stream (tree_noise.StreamVersionRecord)
    _sigma: tuple[float, float] = field(default=(-1.0, 0.0), repr=False)  # (clip, sigma)
    _selection_noise: tuple[float, float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.settings.adaptive is not None:
            raise ValueError("DP-FTRL runs with a fixed clip (adaptive clipping is refused)")

    def key(self, stream: int) -> Key:
        assert self.streams is not None
        if stream not in self.keys:  # derived once (a SeedSequence), then reused
            self.keys[stream] = table_key(self.streams.key, stream, self.noise_version)
        return self.keys[stream]

    @property
    def sigma(self) -> float:
        """The tree's node noise z_grad C (the settings' accounting computed once per clip:
        DP-FTRL's clip is fixed)."""
        if self._sigma[0] != self.clip:
            self._sigma = (self.clip, self.settings.update_multiplier * self.clip)
        return self._sigma[1]

    @property
    def selection_noise(self) -> tuple[float, float]:
        """The selection's noise std and threshold in histogram units (the settings'
        ``selection_std`` and ``histogram_threshold``, computed once: they read the run's
        accounting, fixed for the run like DP-FTRL's clip)."""
        if self._selection_noise is None:
            s = self.settings
            self._selection_noise = (s.selection_std, s.histogram_threshold)
        return self._selection_noise

    def _dense_tree(self, name: str, stream: int, rows: int, dim: int) -> NoiseStream:
        if name not in self.trees:
            self.trees[name] = DenseTree(self.key(stream), rows, dim)
        return self.trees[name]

    def _commit(self, round_index: int) -> None:
        """The rows selected in an earlier round become their last rounds."""
        if self.pending_rows is None or self.pending_rows[0] >= round_index:
            return
        for table, (rows, rounds) in self.pending_rows[1].items():
            old_rows, old_rounds = self.selected.get(table, (np.zeros(0, np.int64),) * 2)
            self.selected[table] = _merged(old_rows, old_rounds, rows, rounds)
        self.pending_rows = None

    def last_rounds(self, table: str, rows: np.ndarray) -> np.ndarray:
        """Each row's last selected round before now (0: never)."""
        known, rounds = self.selected.get(table, (np.zeros(0, np.int64),) * 2)
        if len(known) == 0:
            return np.zeros(len(rows), dtype=np.int64)
        at = np.searchsorted(known, rows)
        hit = (at < len(known)) & (known[np.minimum(at, len(known) - 1)] == rows)
        return np.where(hit, rounds[np.minimum(at, len(known) - 1)], 0)

    def sparse_noise(self, table: str, rows: np.ndarray, t: int, dim: int) -> np.ndarray:
        """sigma (N_r(t) - N_r(t_r)) for the selected ``rows`` (module docstring)."""
        key = self.key(sorted(self.table_rows).index(table))
        since = self.last_rounds(table, rows)
        return self.sigma * prefix_difference(key, rows, t, since, dim)

    def combine(self, update: CohortUpdate, round_index: int) -> ServerUpdate:
        s = self.settings
        assert self.streams is not None
        self._commit(round_index)
        # the selection's noise and false positives: the torch stream of dp/mechanism.py, made
        # at its first draw (a dense round or a window's later rounds draw none) and then the
        # same generator for every table in turn
        generator = _made_once(self.streams.key, round_index)
        clip = self.current_clip(round_index)
        factors = clipping.clip_factors(update.squared_norms(), clip)
        self.last = RoundStats(members=len(update), clipped=clipping.clipped(factors))
        clipped = self.scaled(update, factors)
        contribution = (
            self.contributions(update)
            if self.reads_heat(round_index)
            else torch.zeros(0, dtype=torch.float64)  # read by no selection (``reads_heat``)
        )
        chosen: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        tables = {
            table: self._ftrl_table(clipped, table, contribution, round_index, generator, chosen)
            for table in sorted(self.table_rows)
        }
        dense = {}
        for position, name in enumerate(sorted(clipped.dense_deltas)):
            stacked = clipped.dense_deltas[name]
            shape = tuple(stacked.shape[1:])
            size = math.prod(shape)  # 1 for a scalar
            tree = self._dense_tree(name, len(self.table_rows) + position, size, 1)
            noise = torch.from_numpy(self.sigma * tree.increment(round_index)).reshape(shape)
            dense[name] = (stacked.sum(0) + noise.to(stacked.device, stacked.dtype)) / (
                self.denominator
            )
        if s.rows == "private":
            self.pending_rows = (round_index, chosen)
        return ServerUpdate(tables, dense)

    def _ftrl_table(
        self,
        update: CohortUpdate,
        table: str,
        contribution: torch.Tensor,
        round_index: int,
        generator: Callable[[], torch.Generator],
        chosen_rows: dict[str, tuple[np.ndarray, np.ndarray]],
    ) -> RowUpdate:
        s, num_rows = self.settings, self.table_rows[table]
        if s.rows == "all":
            return self._dense_table(update, table, round_index)
        distinct, inverse, sums = self._sums(update, table)
        dim, device, dtype = sums.shape[1], sums.device, sums.dtype
        self.last.touched_rows += len(distinct)
        heat = (
            selection.histogram(
                inverse, update.row_owner[table], contribution.to(device), len(distinct)
            )
            if self.reads_heat(round_index)
            else None  # a windowed round whose histogram no selection reads (``reads_heat``)
        )
        if s.selection.window > 1:
            window = self._window_rows(table, distinct, heat, round_index, generator)
            return self._window_update(table, window, distinct, sums, round_index, chosen_rows)
        assert heat is not None  # a selection every round reads every round's histogram
        std, threshold = self.selection_noise
        chosen = selection.largest(
            selection.select(distinct.cpu(), heat.cpu(), num_rows, std, threshold, generator()),
            s.selection.max_rows,
        )
        position = chosen.touched_position.numpy()
        fresh = position < 0
        index = torch.from_numpy(np.where(fresh, len(distinct), position)).to(device)
        padded = torch.cat([sums, sums.new_zeros((1, dim))])
        picked = chosen.rows.numpy().astype(np.int64)
        noise = torch.from_numpy(self.sparse_noise(table, picked, round_index, dim))
        values = padded.index_select(0, index) + noise.to(device, dtype)
        chosen_rows[table] = (picked, np.full(len(picked), round_index, dtype=np.int64))
        self.last.rows_changed += len(picked)
        self.last.false_positives += int(fresh.sum())
        if self.heat:  # capped on the host (numpy's max is torch's clamp), then moved once
            divisor = self.capped(chosen.noisy_heat.numpy())
            if len(divisor):  # D / min(h_m): a float64 division either way, the same number
                coefficient = self.denominator / float(divisor.min())
                self.last.largest_coefficient = max(self.last.largest_coefficient, coefficient)
            scale = torch.from_numpy(divisor).to(device, dtype).unsqueeze(1)
            return RowUpdate(chosen.rows.to(device), values / scale)
        return RowUpdate(chosen.rows.to(device), values / (self.denominator * self.keep))

    def _dense_table(self, update: CohortUpdate, table: str, round_index: int) -> RowUpdate:
        """rows = "all": every row of ``table``, its sum plus sigma times its tree's (or
        BLT's) increment (``every_row``)."""
        deltas = update.table_deltas[table]
        stream = sorted(self.table_rows).index(table)
        tree = self._dense_tree(table, stream, self.table_rows[table], deltas.shape[1])
        increment = tree.increment(round_index)
        if deltas.device.type == "cpu" and deltas.dtype in HOST_NOISE:
            # sigma * increment in float64, rounded once to the deltas' dtype as torch's .to
            # rounds it (every_row's cast is then none): one pass, no float64 copy
            into = np.empty(increment.shape, dtype=HOST_NOISE[deltas.dtype])
            noise = torch.from_numpy(np.multiply(increment, self.sigma, out=into))
        else:
            noise = torch.from_numpy(self.sigma * increment)
        return self.every_row(update, table, noise)

    def reads_heat(self, round_index: int) -> bool:
        """Whether round ``round_index``'s histogram is read: with rows = "private", always
        without a window; with one, only in the windows whose histograms a selection reads
        (0, r, 2r, ...: ``_window_rows``); the other rounds skip the contributions and the
        histogram (nothing they release reads them: the same numbers)."""
        window = self.settings.selection.window
        if self.settings.rows == "all":
            return False
        if window <= 1:
            return True
        return ((round_index - 1) // window) % self.settings.selection.refresh == 0

    def capped(self, heat: np.ndarray) -> np.ndarray:
        """h_m (float64, on the host), raised to D / heat_cap when a cap is set (dp.heat_cap:
        the coefficient D / h_m at most heat_cap)."""
        cap = self.settings.selection.heat_cap
        return np.maximum(heat, self.denominator / cap) if cap > 0 else heat

    def _window_rows(
        self,
        table: str,
        distinct: torch.Tensor,
        heat: torch.Tensor | None,
        round_index: int,
        generator: Callable[[], torch.Generator],
    ) -> selection.Selection:
        """The windowed selection (fedsub's): the rows of round ``round_index``'s window, chosen
        once at its first round from the noisy histogram of the previous window's cohorts (a
        user at most once in it: w <= min_separation), with their noisy heat per round. With
        ``dp.selection_refresh`` = r > 1 a selection serves r windows (windows 1..r read window
        0, r + 1..2r read window r, ...; ``selection.windowed_selections``)."""
        s, w = self.settings, self.settings.selection.window
        refresh = self.settings.selection.refresh
        window = (round_index - 1) // w
        parts = self.window_parts.setdefault(table, {})
        if window % refresh == 0:  # only windows 0, r, 2r, ... are ever read (dp.selection_refresh)
            assert heat is not None  # reads_heat: these rounds compute it
            parts[round_index] = (distinct.cpu(), heat.cpu())  # a round combined twice: replaced
        # the selection's key: windows 1..r share one, r + 1..2r the next, ...
        key = (table, (window + refresh - 1) // refresh)
        if key not in self.window_selected:
            before = [parts.pop(r) for r in sorted(parts) if (r - 1) // w == window - 1]
            for r in [r for r in parts if (r - 1) // w < window - 1]:
                del parts[r]  # older than the previous window (a resumed run)
            rows = torch.cat([b[0] for b in before]) if before else distinct.cpu()[:0]
            values = (
                torch.cat([b[1] for b in before]) if before else torch.zeros(0, dtype=torch.float64)
            )
            union, inverse = torch.unique(rows, return_inverse=True)
            summed = torch.zeros(len(union), dtype=torch.float64)
            summed.index_add_(0, inverse, values.to(torch.float64))
            if window == 0:  # the first window: nothing to select from yet
                empty = torch.zeros(0, dtype=torch.int64)
                chosen = selection.Selection(empty, empty, torch.zeros(0, dtype=torch.float64))
            else:
                std, threshold = self.selection_noise
                chosen = selection.select(
                    union, summed, self.table_rows[table], std, threshold, generator()
                )
                chosen = selection.largest(chosen, s.selection.max_rows)
            self.window_selected = {k: v for k, v in self.window_selected.items() if k[0] != table}
            self.window_selected[key] = chosen
        return self.window_selected[key]

    def _window_update(
        self,
        table: str,
        chosen: selection.Selection,
        distinct: torch.Tensor,
        sums: torch.Tensor,
        round_index: int,
        chosen_rows: dict[str, tuple[np.ndarray, np.ndarray]],
    ) -> RowUpdate:
        """Every row of the window's selection: its sum this round (0 if untouched) plus the
        tree's noise since its last update; FedSubAvg divides by the noisy heat per round."""
        device, dim, dtype = sums.device, sums.shape[1], sums.dtype
        kept = self._window_kept(table, chosen, device, dtype)
        picked = kept.picked
        touched = distinct.cpu().numpy()
        at = np.searchsorted(touched, picked)
        hit = at < len(touched)  # a round that touches none of the table's rows: no hit
        hit[hit] = touched[at[hit]] == picked[hit]
        index = torch.from_numpy(np.where(hit, at, len(touched))).to(device)
        padded = torch.cat([sums, sums.new_zeros((1, dim))])
        noise = torch.from_numpy(self.sparse_noise(table, picked, round_index, dim))
        values = padded.index_select(0, index) + noise.to(device, dtype)
        chosen_rows[table] = (picked, np.full(len(picked), round_index, dtype=np.int64))
        self.last.rows_changed += len(picked)
        self.last.false_positives += kept.false_positives
        if kept.divisor is not None:  # the window's noisy heat, per round
            self.last.largest_coefficient = max(self.last.largest_coefficient, kept.coefficient)
            return RowUpdate(kept.rows, values / kept.divisor)
        return RowUpdate(kept.rows, values / (self.denominator * self.keep))

    def _window_kept(
        self, table: str, chosen: selection.Selection, device: torch.device, dtype: torch.dtype
    ) -> WindowRows:
        """What every round of a window reads of its selection (``WindowRows``), computed at
        the first round that reads it and kept while the selection serves (the same
        operations on the same numbers)."""
        cached = self.window_rows.get(table)
        if cached is not None and cached[0] is chosen and cached[1] == (device, dtype):
            return cached[2]
        picked = chosen.rows.numpy().astype(np.int64)
        divisor, coefficient = None, 0.0
        if self.heat:
            window = self.settings.selection.window
            heat = self.capped(chosen.noisy_heat.numpy() / window)
            if len(heat):
                coefficient = self.denominator / float(heat.min())
            divisor = torch.from_numpy(heat).to(device, dtype).unsqueeze(1)
        fresh = int((chosen.touched_position < 0).sum())
        kept = WindowRows(picked, torch.from_numpy(picked).to(device), fresh, divisor, coefficient)
        self.window_rows[table] = (chosen, (device, dtype), kept)
        return kept

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Each table's selected rows and their last rounds, the pending round's included;
        with a window, the rounds of the window being gathered (touched rows and their
        un-noised histogram) and the selection serving the current windows, so a run resumed
        mid-window continues bit for bit. The histograms are secret like the run's secret (in
        the same checkpoint, never in a file a run publishes: module docstring)."""
        self._commit(2**40)
        out = {FORMAT_TENSOR: torch.tensor(STATE_FORMAT)}
        for table, (rows, rounds) in self.selected.items():
            out[f"last.{table}.rows"] = torch.from_numpy(rows.copy())
            out[f"last.{table}.rounds"] = torch.from_numpy(rounds.copy())
        for table, parts in self.window_parts.items():
            for r, (rows_, heat) in parts.items():
                out[f"window.{table}.{r}.rows"] = rows_.clone()
                out[f"window.{table}.{r}.heat"] = heat.clone()
        for (table, key), chosen in self.window_selected.items():
            for name in SELECTION_FIELDS:
                out[f"selection.{table}.{key}.{name}"] = getattr(chosen, name).clone()
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.pending_rows = None
        self.window_parts, self.window_selected = {}, {}
        if FORMAT_TENSOR not in tensors:  # written before the window was kept: last rounds
            tables = {name.rsplit(".", 1)[0] for name in tensors}
            self.selected = {t: _rows_rounds(tensors, f"{t}.") for t in tables}
            return  # (a window resumed from it selects again from the rounds it sees)
        if int(tensors[FORMAT_TENSOR]) != STATE_FORMAT:
            raise ValueError(
                f"the dp_ftrl stage's format is {int(tensors[FORMAT_TENSOR])}, this fedsub "
                f"reads {STATE_FORMAT} (or the older one without {FORMAT_TENSOR!r})"
            )
        kinds = _by_kind(tensors)
        self.selected = {t: _rows_rounds(g, "") for (t,), g in kinds["last"].items()}
        for (table, r), g in kinds["window"].items():
            self.window_parts.setdefault(table, {})[int(r)] = (g["rows"], g["heat"])
        for (table, key), g in kinds["selection"].items():
            fields = (g[name] for name in SELECTION_FIELDS)
            self.window_selected[(table, int(key))] = selection.Selection(*fields)


# the dp_ftrl stage: FORMAT_TENSOR (no dot, so never a name of the older stage, which held only
# "{table}.rows" / "{table}.rounds") and names "{kind}.{table}[.{round or key}].{field}", parsed
# from the right (a table's name may hold dots)
FORMAT_TENSOR, STATE_FORMAT = "format", 2
KIND_PARTS = {"last": 1, "window": 2, "selection": 2}  # the parts after the table
SELECTION_FIELDS = ("rows", "touched_position", "noisy_heat")  # selection.Selection's


def _by_kind(tensors: dict[str, torch.Tensor]) -> dict[str, dict[tuple[str, ...], dict]]:
    """The stage's tensors by kind, then by (table[, round or key]), then by field; on the CPU
    (a checkpoint restores each tensor where the model is)."""
    out: dict[str, dict[tuple[str, ...], dict]] = {kind: {} for kind in KIND_PARTS}
    for name, value in tensors.items():
        if name == FORMAT_TENSOR:
            continue
        kind, _, rest = name.partition(".")
        split = rest.rsplit(".", KIND_PARTS.get(kind, 0))
        if kind not in KIND_PARTS or len(split) != KIND_PARTS[kind] + 1 or not split[0]:
            raise ValueError(f"the dp_ftrl stage holds {name!r}, not a name it writes")
        *group, field_name = split
        out[kind].setdefault(tuple(group), {})[field_name] = value.cpu()
    return out


def _rows_rounds(tensors: dict[str, torch.Tensor], prefix: str) -> tuple[np.ndarray, np.ndarray]:
    rows, rounds = tensors[f"{prefix}rows"], tensors[f"{prefix}rounds"]
    return rows.cpu().numpy().copy(), rounds.cpu().numpy().copy()
