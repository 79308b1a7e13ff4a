"""Sparsity-preserving row selection (DP-AdaFEST, Ghazi et al. 2023, in federated form).

Each cohort member contributes ``c_k = min(1, B / sqrt(|S(k)|))`` to every row it touched
(|S(k)| counted over all tables), so its contribution vector has L2 norm <= B. Per table, the
cohort's histogram ``h[m] = sum_k c_k [m in S(k)]`` gets Gaussian noise of std sigma = z_sel B
and a row is selected when its noisy value is >= tau. An untouched row's noisy value is pure
noise, so each of the V - nnz untouched rows is selected independently with probability
p = P(N(0, sigma^2) >= tau): the number of such false positives is drawn from
Binomial(V - nnz, p) and that many untouched rows uniformly without replacement (rejection
against the touched rows and earlier draws), in O(touched + selected) time, never O(V) unless
the selection itself is dense; their noisy values are drawn from the noise conditioned on
exceeding tau. Exactly the distribution of thresholding noise on all V rows.

Everything here runs on the host, from a seeded torch ``Generator``: the same rows whatever the
backend or device.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from fedsub.numerics import segment_sum
from fedsub.submodel.transfer import CohortUpdate


def contributions(update: CohortUpdate, bound: float) -> torch.Tensor:
    """c_k = min(1, B / sqrt(|S(k)|)) per member (float64; 1 for a member with no rows)."""
    sizes = torch.zeros(len(update), dtype=torch.float64, device=update.clients.device)
    for owner in update.row_owner.values():
        if owner.device.type == "cpu":  # counts: exact integers whatever the order (faster)
            sizes += torch.bincount(owner, minlength=len(update)).to(torch.float64)
        else:  # (bincount reads its output's length back from a GPU)
            segment_sum.index_add_(sizes, owner, torch.ones_like(owner, dtype=torch.float64))
    return torch.clamp(bound / torch.clamp(sizes, min=1.0).sqrt(), max=1.0)


def histogram(
    inverse: torch.Tensor, owner: torch.Tensor, contribution: torch.Tensor, size: int
) -> torch.Tensor:
    """h over a table's distinct touched rows: the contributions of the members touching each
    (``inverse``: each entry's distinct row, ``owner``: its member)."""
    return segment_sum.segment_sum(inverse, contribution.index_select(0, owner), size)


def false_positive_probability(threshold_in_stds: float) -> float:
    """P(N(0, 1) >= tau / sigma)."""
    return 0.5 * math.erfc(threshold_in_stds / math.sqrt(2.0))


@functools.lru_cache(maxsize=16)
def _probability(p: float) -> torch.Tensor:
    """``p`` as the one-value float64 tensor ``torch.binomial`` reads (a run's selections
    share one: made once; never written)."""
    return torch.tensor([p], dtype=torch.float64)


def sample_untouched(
    touched: torch.Tensor, num_rows: int, count: int, generator: torch.Generator
) -> torch.Tensor:
    """``count`` distinct rows of [0, num_rows) outside ``touched`` (sorted, on the host),
    uniformly without replacement; sorted. Rejection sampling, O(count + touched), unless more
    than half the free rows are wanted (then the free rows are listed: O(V))."""
    free = num_rows - len(touched)
    if count > free:
        raise ValueError(f"{count} untouched rows wanted, {free} exist")
    if count == 0:
        return torch.zeros(0, dtype=torch.int64)
    if 2 * count > free:
        mask = torch.ones(num_rows, dtype=torch.bool)
        mask[touched] = False
        candidates = torch.nonzero(mask).squeeze(1)
        order = torch.randperm(len(candidates), generator=generator)[:count]
        return torch.sort(candidates[order]).values
    known = touched.numpy()
    drawn = np.zeros(0, dtype=np.int64)
    while True:
        wanted = count - len(drawn)
        batch = torch.randint(num_rows, (2 * wanted + 8,), generator=generator).numpy()
        spot = np.minimum(np.searchsorted(known, batch), max(len(known) - 1, 0))
        if len(known):
            batch = batch[known[spot] != batch]
        sequence = np.concatenate([drawn, batch])
        ordered = np.sort(sequence)
        if (ordered[1:] != ordered[:-1]).all():  # no row drawn twice: every draw kept
            drawn = sequence[:count]
        else:
            _, first = np.unique(sequence, return_index=True)  # keep each row's first draw
            drawn = sequence[np.sort(first)][:count]
        if len(drawn) == count:
            return torch.from_numpy(np.sort(drawn))


@dataclass(frozen=True)
class Selection:
    """A table's selected rows (sorted), where each selected touched row sits among the
    distinct touched rows (-1 for a false positive) and each row's noisy histogram value
    (>= the threshold)."""

    rows: torch.Tensor
    touched_position: torch.Tensor
    noisy_heat: torch.Tensor


def select(
    touched: torch.Tensor,
    heat: torch.Tensor,
    num_rows: int,
    std: float,
    threshold: float,
    generator: torch.Generator,
) -> Selection:
    """Threshold the noised histogram of the touched rows (``touched`` sorted distinct, host
    tensors) and add the false positives among the untouched rows (module docstring)."""
    # the draws from the generator (torch), the arithmetic on the host arrays (numpy: the same
    # float64 operations, each a cheaper call than torch's on a few values)
    z = torch.randn(len(touched), dtype=torch.float64, generator=generator).numpy()
    noisy = heat.to(torch.float64).numpy() + std * z
    kept = np.flatnonzero(noisy >= threshold)
    p = false_positive_probability(threshold / std)
    free = num_rows - len(touched)
    draws = torch.tensor([float(free)], dtype=torch.float64)
    count = int(torch.binomial(draws, _probability(p), generator=generator))
    extra = sample_untouched(touched, num_rows, count, generator)
    # the noise given that it reached the threshold: sigma * Phi^-1(1 - v), v ~ U(0, p]
    v = torch.rand(count, dtype=torch.float64, generator=generator).numpy()
    extra_heat = -std * torch.special.ndtri(torch.from_numpy(p * (1.0 - v))).numpy()
    rows = np.concatenate([touched.numpy()[kept], extra.numpy()])
    order = np.argsort(rows, kind="stable")
    position = np.concatenate([kept, np.full(count, -1, dtype=np.int64)])
    heat_values = np.concatenate([noisy[kept], extra_heat])
    return Selection(
        torch.from_numpy(rows[order]),
        torch.from_numpy(position[order]),
        torch.from_numpy(heat_values[order]),
    )


WINDOW_USERS = 2000  # capped_rule: the participations a window's histogram should count


def windowed_selections(rounds: int, window: int, refresh: int) -> int:
    """How many selections the windowed selection (dp/ftrl.py, ``dp.selection_window`` = w >
    1) makes in rounds 1..``rounds``, each from one released window's histogram: one at the
    first round of windows 1, 1 + r, 1 + 2r, ... (window j holds rounds j w + 1 .. (j + 1) w;
    ``refresh`` r = ``dp.selection_refresh``), each reading the window before it (windows 0,
    r, 2r, ...); the other windows' histograms are never read."""
    if window < 1 or refresh < 1:
        raise ValueError(f"window and refresh must be >= 1, got {window} and {refresh}")
    current = (rounds - 1) // window if rounds > 0 else 0  # the window round ``rounds`` is in
    return (current - 1) // refresh + 1 if current >= 1 else 0


HEAT_CAP_COHORT = 50  # capped_rule: the heat cap grows as sqrt(K / 50) beyond epsilon's
RULE_SELECTIONS = 3  # capped_rule: the most windowed selections a run makes (dp.selection_refresh)
SELECTION_SIGNAL = 1500  # capped_rule: a selection's w K / sqrt(S) it keeps (rule_selections)


@dataclass(frozen=True)
class CappedRule:
    """fedsub's settings of the capped sparse DP-FTRL-FedSubAvg (``capped_rule``): the
    ``dp.mechanism``, ``dp.selection_window``, ``dp.selection_share``,
    ``dp.selection_threshold``, ``dp.heat_cap``, ``dp.selection_bound``,
    ``dp.selection_max_rows`` and ``dp.selection_refresh`` to run it with."""

    mechanism: str
    window: int
    share: float
    threshold: float
    heat_cap: float
    bound: float
    max_rows: int
    refresh: int = 1

    def overrides(self, min_separation: int) -> list[str]:
        """These settings as config overrides (``Config.from_toml``'s, the CLI's ``--set``)
        for a run under the separation b the rule was computed for: private rows, and the
        refresh only when it is more than 1 (its default)."""
        return [
            f"dp.mechanism='{self.mechanism}'",
            f"dp.min_separation={min_separation}",
            "dp.rows='private'",
            f"dp.selection_window={self.window}",
            f"dp.selection_share={self.share}",
            f"dp.heat_cap={self.heat_cap}",
            f"dp.selection_threshold={self.threshold}",
            f"dp.selection_bound={self.bound}",
            f"dp.selection_max_rows={self.max_rows}",
            *([f"dp.selection_refresh={self.refresh}"] if self.refresh > 1 else []),
        ]


def rule_selections(participations: int, selections: int) -> int:
    """``capped_rule``'s number of selections S: the largest S <= min(3, ``selections``)
    (``RULE_SELECTIONS``; ``selections`` the windowed selections the window makes with refresh
    1) whose per-selection signal, the window's ``participations`` w K over sqrt(S), is at
    least ``SELECTION_SIGNAL`` (1,500): each selection is charged, so the selection noise grows
    as sqrt(S); 1 when even one selection falls short (its docstring says what this rests on)."""
    most = max(1, min(RULE_SELECTIONS, selections))
    # w K / sqrt(S) >= 1500 in integers: (w K)^2 >= 1500^2 S
    kept = [s for s in range(1, most + 1) if participations**2 >= SELECTION_SIGNAL**2 * s]
    return max(kept, default=1)


def rule_window(clients_per_round: int, rounds: int, min_separation: int) -> tuple[int, int]:
    """``capped_rule``'s window w and refresh r (its docstring)."""
    window = max(1, min(min_separation, math.ceil(WINDOW_USERS / clients_per_round), rounds // 3))
    if windowed_selections(rounds, window, 1) > RULE_SELECTIONS:
        window = max(1, min(min_separation, rounds // 3))
    if window == 1:
        return 1, 1
    every = windowed_selections(rounds, window, 1)
    chosen = rule_selections(window * clients_per_round, every)
    return window, max(1, math.ceil(every / chosen))


def capped_rule(
    epsilon: float, clients_per_round: int, rounds: int, min_separation: int, num_rows: int
) -> CappedRule:
    """fedsub's rule for the capped sparse DP-FTRL-FedSubAvg (issue 50; fedsub's, not a
    paper's), from public numbers only (the target epsilon, K, the rounds, the separation b
    and the table's rows V), so it spends no privacy and leaves epsilon as calibrated:

    - BLT noise (``ftrl-blt``);
    - the window w = max(1, min(b, ceil(2000 / K), rounds // 3)): a window's histogram counts
      w K >= 2,000 users' participations where b allows it (w <= b keeps its sensitivity a
      round's), and the run has at least three windows (the first updates no table row);
    - when that window would make more than 3 selections (``windowed_selections``: a user
      then adds to up to k_max of them, 25 at K = 500, b = 6), the window takes the whole
      separation, w = max(1, min(b, rounds // 3)): as a selection then costs the same
      whatever w, the longest window counts the most users against it;
    - the run makes S selections (``rule_selections``): the largest S <= 3 (and <= S1, the
      selections of that window with r = 1) whose per-selection signal w K / sqrt(S) is at
      least 1,500 participations (each selection is charged, so its noise grows as sqrt(S));
      S = 1 when none is; each selection serves r = ceil(S1 / S) windows
      (``dp.selection_refresh``), so the accounting charges at most S selections, not k_max.
      K = 50, b = 50: w 40, w K = 2,000, S = 1 (2,000 / sqrt(2) = 1,414 < 1,500), r = 3;
      K = 500, b = 6: w 6, w K = 3,000, S = 3 (3,000 / sqrt(3) = 1,732), r = 8; K = 1,000, b =
      30: w 30, S1 = 4, S = 3, r = 2 (2 selections made);
    - at most M = max(1, V // 100) rows a round (1% of the table);
    - the heat cap min(4, max(1, epsilon sqrt(K / 50))): FedSubAvg's coefficient D / h_m
      multiplies a row's noise too, so the cap is lowered with epsilon (at K = 50 and epsilon
      <= 1 the coefficient is at most 1: the selected rows take FedAvg's step), and raised
      with the cohort, whose sum holds more signal against the same noise (3.2 / 4 / 4 / 4
      at K = 500 and epsilon 1 / 2 / 4 / 8);
    - the threshold 2 selection-noise standard deviations (the cap, not the threshold,
      keeps the rows within M), the selection's share 0.5 of the budget and B = 6.

    The constants were chosen on a validation workload (the embedded default generated from
    data.seed 1, benchmarks/ftrl_rule_grid.py), never on the reported one: at K = 50, b = 50
    (the window, the cap, the threshold, the share; one selection rather than three, 10 runs
    a cell at epsilon 1, 2, 4, 8) and at K = 500, b = 6 (the refresh, three selections level
    with one, and the heat cap's growth with K), 150 rounds. The two validated points place
    the selection-signal threshold only between 1,414 and 1,732; 1,500 is a round number
    between them, and the criterion counts participations, not the noise multiplier (which
    grows with the participations per user). Between and beyond those points the rule is an
    assumption."""
    if epsilon <= 0 or clients_per_round < 1 or rounds < 1 or min_separation < 1 or num_rows < 1:
        raise ValueError(
            f"capped_rule needs epsilon > 0 and K, rounds, min_separation, num_rows >= 1; got "
            f"{epsilon}, {clients_per_round}, {rounds}, {min_separation}, {num_rows}"
        )
    window, refresh = rule_window(clients_per_round, rounds, min_separation)
    return CappedRule(
        mechanism="ftrl-blt",
        window=window,
        share=0.5,
        threshold=2.0,
        heat_cap=min(4.0, max(1.0, epsilon * math.sqrt(clients_per_round / HEAT_CAP_COHORT))),
        bound=6.0,
        max_rows=max(1, num_rows // 100),
        refresh=refresh,
    )


def largest(chosen: Selection, limit: int) -> Selection:
    """fedsub's cap on a selection (``dp.selection_max_rows``): its ``limit`` rows of the
    largest noisy histogram values (ties: the lower row), sorted by row; all of them when there
    are no more than ``limit`` (or ``limit`` is 0). It reads only the released noisy values, so
    it is post-processing of the selection and spends no privacy."""
    if limit <= 0 or len(chosen.rows) <= limit:
        return chosen
    heat, rows = chosen.noisy_heat.numpy(), chosen.rows.numpy()
    order = np.lexsort((rows, -heat))[:limit]  # by heat, descending; then by row
    keep = np.sort(order)  # the rows are sorted, so their positions sorted are the rows sorted
    return Selection(
        chosen.rows[torch.from_numpy(keep)],
        chosen.touched_position[torch.from_numpy(keep)],
        chosen.noisy_heat[torch.from_numpy(keep)],
    )
