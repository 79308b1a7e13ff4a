"""One round's Gaussian mechanism on the cohort's updates (McMahan et al. 2018's DP-FedAvg,
and fedsub's sparsity-preserving form for submodels).

``DpMechanism.combine(update, round)`` replaces the round's aggregation:

0. adaptive clipping (``adaptive``, Andrew et al. 2021): the noisy share of members whose norm
   is under C moves C toward the target quantile for the next round (``adapt``);
1. every member's whole update clipped to L2 norm C (times a capped weight w_k <= 1);
2. summed per row and per dense parameter;
3. rows = "all": noise N(0, (z C)^2) on every row of every table and every dense entry (the
   update is dense, O(V) per round); rows = "private": rows selected from the noisy
   contribution histogram (dp/selection.py), noise N(0, (z_grad C)^2) on the selected rows and
   the dense parameters only, unselected rows left out of the update (unchanged bit for bit);
4. divided by the fixed denominator D = K * dp.weight_mean (the expected cohort times a public
   mean weight, 1 for uniform weights: q N for Poisson sampling, K for fixed-size cohorts;
   never the cohort's own weights nor the population's sample counts, so the sensitivity stays
   C / D and D reveals nothing);
5. FedSubAvg (``heat``): each selected row's N / n_m is estimated from the *noisy* histogram
   (n_m ~ N h_m / K), so its coefficient is D / h_m: the row's value is (sum + noise) / h_m.
   h_m >= the threshold for every selected row, which bounds the amplification of a cold row's
   noise by D / threshold. Post-processing of the mechanism's output: no extra budget.
6. Private download with randomized response (``keep`` = p < 1, ``privacy.level =
   "download"``): a held row reaches the sum with probability p, so without heat the rows'
   values are divided by p (the unbiasing ``privacy/private_rounds.py`` applies without DP);
   with the private heat the histogram counts the same requested rows, so (sum + noise) / h_m
   is already unbiased and nothing is divided. Post-processing: no extra budget.

The server optimizer then applies the update (post-processing). Noise comes from a torch
``Generator`` on the host keyed by (key, round), drawn in a fixed order (tables by name, then
dense parameters by name), so every backend and device draws the same numbers. The key is the
run's secret (``dp.randomness = "secret"``, dp/randomness.py), or train.seed when the run opted
into reproducible, unguaranteed streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fedsub.algorithms.aggregation import RowUnion, RowUpdate, ServerUpdate
from fedsub.dp import clipping, selection
from fedsub.dp.randomness import DpStreams
from fedsub.dp.settings import DpSettings
from fedsub.numerics import seeding, segment_sum
from fedsub.submodel.transfer import CohortUpdate, empty_update  # noqa: F401 (re-exported)


def round_generator(seed: seeding.Seed, round_index: int) -> torch.Generator:
    """The round's noise stream (host), the same for every backend and device; ``seed``: the
    run's secret, or train.seed in seeded mode."""
    # a SeedSequence of (seed, purpose, round), as seeding.rng keys its streams, without
    # building a numpy Generator (a round's noise is drawn by torch)
    state = seeding.seed_sequence(seed, seeding.DP, round_index).generate_state(1, np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(2)))


def gaussian(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    """N(0, std^2) entries, float64 on the host."""
    return torch.randn(shape, dtype=torch.float64, generator=generator).mul_(std)


@dataclass
class RoundStats:
    """What a round's mechanism did (for benchmarks and the docs' measurements)."""

    rows_changed: int = 0
    false_positives: int = 0
    touched_rows: int = 0
    clipped: int = 0
    members: int = 0
    largest_coefficient: float = 0.0


@dataclass
class DpMechanism:
    """The round's Gaussian mechanism (module docstring). ``table_rows``: V per table;
    ``population_counts``: every client's sample count (no longer read: the denominator's
    mean weight is the public dp.weight_mean);
    ``heat``: the algorithm's rule reads heat (FedSubAvg), so selected rows get the private
    coefficient D / h_m; ``keep``: step 6 of the module docstring; ``streams``: the key
    of the noise (the run's, shared with the cohort; default: the settings' own)."""

    settings: DpSettings
    table_rows: dict[str, int]
    population_counts: np.ndarray
    heat: bool = False
    keep: float = 1.0  # p: randomized-response download's probability that a held row is sent
    last: RoundStats = field(default_factory=RoundStats)
    union: RowUnion = field(default_factory=RowUnion)
    clip: float = 0.0  # this round's C (adaptive clipping moves it; 0: the settings' clip)
    # adaptive clipping: (round, C for the rounds after it), committed when a later round starts
    # (a round that screens out a member combines twice, from the same C)
    pending: tuple[int, float] | None = None
    # D = K * dp.weight_mean (K for uniform weights): fixed for the run, and public (the mean
    # of the population's capped weights would read every user's private sample count)
    denominator: float = field(init=False)
    streams: DpStreams | None = None
    # rows = "all": every row's ids by (rows, device), kept (``every_row``)
    every: dict[tuple[int, torch.device], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False
    )

    def __post_init__(self) -> None:
        if self.streams is None:
            self.streams = DpStreams(self.settings.key.randomness, self.settings.key.seed)
        self.clip = self.clip or self.settings.clip
        weights = self.settings.weights
        mean = weights.mean if weights.cap > 0 else 1.0
        self.denominator = self.settings.accounting.clients_per_round * mean

    def current_clip(self, round_index: int) -> float:
        """C for round ``round_index``: the adaptive update of an earlier round committed."""
        if self.pending is not None and self.pending[0] < round_index:
            self.clip, self.pending = self.pending[1], None
        return self.clip

    def adapt(
        self, norms: torch.Tensor, clip: float, round_index: int, generator: torch.Generator
    ) -> None:
        """Andrew et al.'s step: b = (sum_k (1[||delta_k|| <= C] - 1/2) + noise) / D + 1/2,
        C <- C exp(-eta_C (b - gamma)), used from the next round on."""
        adaptive = self.settings.adaptive
        assert adaptive is not None  # combine adapts only when adaptive clipping is on
        centered = float(((norms <= clip).to(torch.float64) - 0.5).sum())
        noisy = centered + float(gaussian((1,), self.settings.count_std, generator)[0])
        fraction = noisy / self.denominator + 0.5
        step = -adaptive.clip_lr * (fraction - adaptive.target_quantile)
        self.pending = (round_index, clip * math.exp(step))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Adaptive clipping's C for the next round (a checkpoint stage, ``dp_clip``)."""
        clip = self.pending[1] if self.pending is not None else self.clip
        return {"clip": torch.tensor([clip], dtype=torch.float64)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if set(tensors) != {"clip"} or tensors["clip"].shape != (1,):
            raise ValueError(f"adaptive clipping's state is one 'clip', got {sorted(tensors)}")
        self.clip, self.pending = float(tensors["clip"][0]), None

    def combine(self, update: CohortUpdate, round_index: int) -> ServerUpdate:
        """The round's noised, normalized update (module docstring)."""
        s = self.settings
        assert self.streams is not None  # set by __post_init__
        generator = round_generator(self.streams.key, round_index)
        clip = self.current_clip(round_index)
        squared = update.squared_norms()
        if s.adaptive is not None:  # drawn first: the other draws keep their order
            self.adapt(squared.sqrt(), clip, round_index, generator)
        factors = clipping.clip_factors(squared, clip)
        self.last = RoundStats(members=len(update), clipped=clipping.clipped(factors))
        clipped = self.scaled(update, factors)
        contribution = self.contributions(update)
        tables = {
            table: self._table(clipped, table, contribution, clip, generator)
            for table in sorted(self.table_rows)
        }
        dense = {}
        for name in sorted(clipped.dense_deltas):
            stacked = clipped.dense_deltas[name]
            noise = gaussian(tuple(stacked.shape[1:]), s.update_multiplier * clip, generator)
            summed = stacked.sum(0) + noise.to(stacked.device, stacked.dtype)
            dense[name] = summed / self.denominator
        return ServerUpdate(tables, dense)

    def scaled(self, update: CohortUpdate, factors: torch.Tensor) -> CohortUpdate:
        """Each member's update times its clip factor and its capped weight (step 1); without
        a cap every weight is 1 and is not multiplied in (the same numbers)."""
        cap = self.settings.weights.cap
        if cap > 0:
            factors = factors * clipping.capped_weights(update.weights, cap).to(factors.device)
        return clipping.scaled(update, factors)

    def contributions(self, update: CohortUpdate) -> torch.Tensor:
        """Each member's histogram contribution c_k (dp/selection.py); rows = "all" selects
        nothing, so it reads none (an empty tensor)."""
        if self.settings.rows == "all":
            return torch.zeros(0, dtype=torch.float64)
        return selection.contributions(update, self.settings.selection.bound)

    def every_row(self, update: CohortUpdate, table: str, noise: torch.Tensor) -> RowUpdate:
        """rows = "all": every row of ``table``, its clipped deltas summed (zero when untouched)
        plus ``noise`` (every row's, on the host: float64, or rounded to the deltas' dtype
        already), over D p. The sums are the
        per-row sums ``_sums`` gives, taken in the same entry order (so the same numbers) but
        straight into the table-sized tensor the noise is added to, without the distinct
        rows."""
        rows, deltas = update.rows[table], update.table_deltas[table]
        num_rows, device = self.table_rows[table], deltas.device
        full = deltas.new_zeros((num_rows, deltas.shape[1]))
        segment_sum.index_add_(full, rows, deltas)
        known = update.unions.get(table) if update.unions else None
        if known is not None:  # the backend's distinct rows (a GPU: no host read)
            self.last.touched_rows += len(known[0])
        elif device.type == "cpu":  # the same count, marked in numpy (fewer calls' overhead)
            marked = np.zeros(num_rows, dtype=bool)
            marked[rows.numpy()] = True
            self.last.touched_rows += int(np.count_nonzero(marked))
        else:
            touched = torch.zeros(num_rows, dtype=torch.bool, device=device)
            touched[rows] = True
            self.last.touched_rows += int(touched.sum())
        full += noise.to(device, deltas.dtype)
        self.last.rows_changed += num_rows
        # divided in place (no second copy); every row's ids made once per table and device
        # (a tensor no reader writes: a RowUpdate's rows are read only)
        return RowUpdate(self._every(num_rows, device), full.div_(self.denominator * self.keep))

    def _every(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """0 .. num_rows - 1 on ``device`` (int64), made once and kept."""
        every = self.every.get((num_rows, device))
        if every is None:
            every = self.every[(num_rows, device)] = torch.arange(num_rows, device=device)
        return every

    def _sums(
        self, update: CohortUpdate, table: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The table's distinct touched rows (sorted), each entry's position among them, and
        the per-row sums of the clipped deltas."""
        rows, deltas = update.rows[table], update.table_deltas[table]
        known = update.unions.get(table) if update.unions else None
        distinct, inverse = known if known is not None else self.union(rows)
        sums = deltas.new_zeros((len(distinct), deltas.shape[1]))
        segment_sum.index_add_(sums, inverse, deltas)
        return distinct, inverse, sums

    def _table(
        self,
        update: CohortUpdate,
        table: str,
        contribution: torch.Tensor,
        clip: float,
        generator: torch.Generator,
    ) -> RowUpdate:
        s, num_rows = self.settings, self.table_rows[table]
        if s.rows == "all":
            dim = update.table_deltas[table].shape[1]
            noise = gaussian((num_rows, dim), s.update_multiplier * clip, generator)
            return self.every_row(update, table, noise)
        distinct, inverse, sums = self._sums(update, table)
        dim, device, dtype = sums.shape[1], sums.device, sums.dtype
        self.last.touched_rows += len(distinct)
        heat = selection.histogram(
            inverse, update.row_owner[table], contribution.to(device), len(distinct)
        )
        chosen = selection.select(
            distinct.cpu(), heat.cpu(), num_rows, s.selection_std, s.histogram_threshold, generator
        )
        # a false positive (position -1) reads the zero row appended after the sums
        position = chosen.touched_position.numpy()
        fresh = position < 0
        index = torch.from_numpy(np.where(fresh, len(distinct), position)).to(device)
        padded = torch.cat([sums, sums.new_zeros((1, dim))])
        noise = gaussian((len(chosen.rows), dim), s.update_multiplier * clip, generator)
        values = padded.index_select(0, index) + noise.to(device, dtype)
        self.last.rows_changed += len(chosen.rows)
        self.last.false_positives += int(fresh.sum())
        if self.heat:  # (sum + noise) / D * (D / h_m)
            divisor = chosen.noisy_heat.to(device, torch.float64)
            if len(divisor):
                coefficient = float(self.denominator / divisor.min())
                self.last.largest_coefficient = max(self.last.largest_coefficient, coefficient)
            return RowUpdate(chosen.rows.to(device), values / divisor.to(dtype).unsqueeze(1))
        return RowUpdate(chosen.rows.to(device), values / (self.denominator * self.keep))
