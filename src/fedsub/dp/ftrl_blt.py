"""DP-FTRL with BLT correlated noise (``dp.mechanism = "ftrl-blt"``): dp/ftrl.py's round (the
clip, the fixed denominator, the private rows, the windowed selection, the enforced
participation pattern) with the tree's noise replaced by a buffered-linear-Toeplitz strategy's
(McMahan, Xu and Zhang 2024, arXiv 2408.08868; dp/blt_noise.py).

Round t adds sigma y_t to every noised row, y = C^-1 z (so the model carries A x + A C^-1 z):
with rows = "all" every row's y_t from its m buffers (``DenseBlt``); with rows = "private" a
selected row r gets sigma (y_{t_r + 1} + ... + y_t), t_r its last selected round, computed from
its own keyed stream (the buffers of the previous selection's rows are kept, the others replay
from round 1; a window's rounds after its first, the same rows again, step those buffers in
place). Privacy: the release is post-processing of C x + z, one Gaussian mechanism of
sensitivity ``blt_noise.sensitivity`` C for the enforced pattern (dp/settings.py), plus the
row selection's histogram as for the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fedsub.dp import blt_noise
from fedsub.dp.blt_noise import BltStrategy, DenseBlt, RowBuffers
from fedsub.dp.ftrl import FtrlMechanism, NoiseStream
from fedsub.dp.tree_noise import Key, node_noise

STRATEGY_STAGE = "dp_blt_strategy"  # the checkpoint stage holding the strategy run so far


@dataclass
class BltMechanism(FtrlMechanism):
    """DP-FTRL's round with BLT noise (module docstring)."""

    # rows = "private": per table, the buffers of the rows computed last (a cache: a resumed
    # run replays from round 1, the same numbers)
    row_buffers: dict[str, RowBuffers] = field(default_factory=dict)
    # per table, (first round, rows, z of those rounds) drawn for a window's rounds (_window_z)
    window_z: dict[str, tuple[int, np.ndarray, np.ndarray]] = field(
        default_factory=dict, repr=False
    )

    @property
    def strategy(self) -> BltStrategy:
        strategy = self.settings.accounting.blt
        assert strategy is not None, "ftrl-blt's strategy is resolved with its accounting"
        return strategy

    def key(self, stream: int) -> Key:
        assert self.streams is not None
        if stream not in self.keys:
            self.keys[stream] = blt_noise.blt_key(self.streams.key, stream, self.noise_version)
        return self.keys[stream]

    def _dense_tree(self, name: str, stream: int, rows: int, dim: int) -> NoiseStream:
        if name not in self.trees:
            self.trees[name] = DenseBlt(self.strategy, self.key(stream), rows, dim)
        return self.trees[name]

    def sparse_noise(self, table: str, rows: np.ndarray, t: int, dim: int) -> np.ndarray:
        """sigma (y_{t_r + 1} + ... + y_t) for the selected ``rows``."""
        key = self.key(sorted(self.table_rows).index(table))
        since = self.last_rounds(table, rows)
        strategy, out = self.strategy, np.zeros((len(rows), dim))
        cached = self.row_buffers.get(table)
        if _same_rows_stepped(cached, rows, since, t, dim):  # a window's rounds after its first
            assert cached is not None
            z = self._window_z(table, key, rows, t, dim)
            products = np.empty_like(cached.buffers)
            out += blt_noise.advance(strategy, cached.buffers, z, products)
            cached.done = t  # the buffers stepped in place: the rows' state after round t
            return self.sigma * out
        kept = np.zeros(len(rows), dtype=bool)
        if cached is not None and cached.buffers.shape[2] == dim:
            at = np.searchsorted(cached.rows, rows)
            inside = at < len(cached.rows)
            hit = inside & (cached.rows[np.minimum(at, len(cached.rows) - 1)] == rows)
            kept = hit & (since >= cached.done)
        states, groups = [], []
        for group in (np.flatnonzero(kept), np.flatnonzero(~kept)):
            if not len(group):
                continue
            if group is not None and kept[group[0]]:
                assert cached is not None
                where = np.searchsorted(cached.rows, rows[group])
                state = RowBuffers(rows[group], cached.done, cached.buffers[:, where].copy())
            else:
                state = blt_noise.fresh(strategy, rows[group], dim)
            states.append(state)
            groups.append(group)
        sinces = [since[group] for group in groups]  # both groups' z from one AES call
        replayed = blt_noise.replay_groups(strategy, key, states, t, sinces, dim)
        for group, values in zip(groups, replayed, strict=True):
            out[group] = values
        if states:
            merged = np.concatenate([s.rows for s in states])
            order = np.argsort(merged, kind="stable")
            buffers = np.concatenate([s.buffers for s in states], axis=1)[:, order]
            self.row_buffers[table] = RowBuffers(merged[order], t, buffers)
        return self.sigma * out

    def _window_z(self, table: str, key: Key, rows: np.ndarray, t: int, dim: int) -> np.ndarray:
        """z_t of a window's ``rows`` (stepped in every round of the window): drawn for the
        window's remaining rounds in one call and kept, a keystream call's fixed cost once a
        window instead of every round; each entry is its own (key, row, round), so the same
        numbers. The draw reaches the last round of the window holding t (a run stopped
        mid-window drew the rest in vain: at most a window of the selected rows)."""
        first, kept_rows, drawn = self.window_z.get(table, (0, rows[:0], np.zeros((0, 0, dim))))
        if not (first <= t < first + drawn.shape[1] and np.array_equal(kept_rows, rows)):
            w = max(self.settings.selection.window, 1)
            rounds = np.arange(t, ((t - 1) // w + 1) * w + 1)
            first, kept_rows, drawn = t, rows.copy(), node_noise(key, rows, 0, rounds, dim)
            self.window_z[table] = (first, kept_rows, drawn)
        return drawn[:, t - first]


def _same_rows_stepped(
    cached: RowBuffers | None, rows: np.ndarray, since: np.ndarray, t: int, dim: int
) -> bool:
    """Whether ``rows`` are exactly the rows whose buffers were kept after round t - 1 and
    each was selected then (the windowed selection's rounds after a window's first): round t
    is then one step of those buffers, in place, the numbers ``replay`` gives."""
    return (
        cached is not None
        and cached.done == t - 1
        and cached.buffers.shape[2] == dim
        and len(cached.rows) == len(rows)
        and bool((cached.rows == rows).all())
        and bool((since == t - 1).all())
    )


@dataclass
class StrategyRecord:
    """The BLT strategy a run started with, as a checkpoint stage: jax-privacy optimises it
    anew when a run resumes, and a resume on another platform or jax-privacy version could
    get other parameters, mixing two strategies' noise under one accounting. A resumed run
    whose strategy differs is refused (the parameters are public, like the pattern)."""

    strategy: BltStrategy

    def state_tensors(self) -> dict[str, torch.Tensor]:
        s = self.strategy
        return {"decay": torch.tensor(s.decay, dtype=torch.float64),
                "scale": torch.tensor(s.scale, dtype=torch.float64)}  # fmt: skip

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        saved = BltStrategy(
            tuple(float(v) for v in tensors["decay"].tolist()),
            tuple(float(v) for v in tensors["scale"].tolist()),
        )
        if saved != self.strategy:
            raise ValueError(
                f"the run started with the BLT strategy {saved.as_json()}, and jax-privacy "
                f"optimised {self.strategy.as_json()} for this resume (another platform or "
                "jax-privacy version): resume where the run started, with the same versions"
            )
