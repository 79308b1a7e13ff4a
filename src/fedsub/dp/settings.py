"""A run's differential-privacy settings, resolved: the noise multiplier (given or calibrated
for the run's rounds), delta, the sampling, and the split of the noise between the row
selection and the update.

The split (rows = "private"): a share s of the budget 1/z^2 goes to the selection histogram and
the rest to the clipped update, 1/z_sel^2 = s / z^2 and 1/z_grad^2 = (1 - s) / z^2, so
1/z^2 = 1/z_sel^2 + 1/z_grad^2: the pair (histogram / B, update / C) with noise (z_sel, z_grad)
is one Gaussian mechanism of multiplier z, and the accountant composes it as such (DP-AdaFEST's
argument, Ghazi et al. 2023; their parameter is r = s' / (1 - s'), fedsub names the share).
With rows = "all" (DP-FedAvg) the update takes the whole budget: z_grad = z. Adaptive clipping's
noisy count (Andrew et al. 2021) takes a share a the same way (1/z_count^2 = a / z^2 for the
count of sensitivity 1/2), and the update keeps 1 - s - a.

``DpSettings`` holds the round's C and z with its records by concern: ``Accounting`` (what
epsilon is counted over), ``RowSelection`` (rows = "private") and ``AdaptiveClip`` (when on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from fedsub.dp import accountant as accounting
from fedsub.dp import blt_noise, ftrl_accounting, selection
from fedsub.dp.accountant import Accountant, Sampling
from fedsub.dp.participation import Pattern
from fedsub.dp.randomness import Randomness
from fedsub.errors import ConfigError
from fedsub.progress import phase

__all__ = [
    "Accountant",
    "Accounting",
    "AdaptiveClip",
    "Distributed",
    "DpSettings",
    "NoiseKey",
    "Randomness",
    "RowSelection",
    "Rows",
    "Sampling",
    "default_delta",
    "refusals",
    "resolve",
    "resolve_ftrl",
]

Rows = Literal["private", "all"]
UNREACHABLE = 4.75  # P(N(0, 1) >= 4.75) < 1e-6: a threshold this far out of reach selects nothing


def default_delta(num_clients: int) -> float:
    """1 / N^1.1: below 1/N, as user-level (eps, delta)-DP needs (delta ~ 1/N would allow
    publishing one user's data outright)."""
    return 1.0 / num_clients**1.1


@dataclass(frozen=True)
class Accounting:
    """What epsilon is counted over: the population, how each round's cohort is drawn from it,
    the rounds configured, the delta epsilon is reported at, and the budget."""

    delta: float
    accountant: Accountant
    sampling: Sampling
    num_clients: int  # N
    clients_per_round: int  # K (Poisson: the expected cohort, q = K / N)
    rounds: int  # the configured rounds (a target epsilon was calibrated for them)
    epsilon_budget: float | None = None  # stop before a round that would spend more
    # dp.mechanism = "ftrl-tree" (dp/ftrl.py): the participation pattern epsilon is accounted
    # for, with no sampling assumption; None: the sampled Gaussian mechanism of every round
    ftrl: Pattern | None = None
    # dp.mechanism = "ftrl-blt" (dp/ftrl_blt.py): the BLT strategy (jax-privacy's) whose noise
    # replaces the tree's; None: the tree
    blt: blt_noise.BltStrategy | None = None

    def ftrl_sensitivity(self, rounds: int) -> float:
        """DP-FTRL's sensitivity over ``rounds`` rounds (units of C) for the pattern: the
        tree's (dp/ftrl_accounting.py) or the BLT strategy's (jax-privacy's)."""
        assert self.ftrl is not None, "DP-FTRL's sensitivity"
        if self.blt is not None:
            return blt_noise.sensitivity(self.blt, rounds, self.ftrl)
        return ftrl_accounting.tree_sensitivity(rounds, self.ftrl)


@dataclass(frozen=True)
class RowSelection:
    """rows = "private": how the rows that get noise are chosen from the cohort's noisy
    contribution histogram (dp.selection_share, dp.selection_threshold, dp.selection_bound)."""

    share: float = 0.5  # s: the budget share of the row selection
    threshold: float = 3.0  # tau, in units of the selection noise's std
    bound: float = 1.0  # B: each client's contribution vector has L2 norm <= B
    # DP-FTRL only: the rows are selected once every `window` rounds from the histogram of
    # the window's cohorts (dp/ftrl.py, fedsub's windowed selection); 1: every round
    window: int = 1
    heat_cap: float = 0.0  # DP-FTRL, FedSubAvg: D / h_m <= heat_cap (0: no cap)
    # DP-FTRL only: at most this many rows per table of a selection, the largest noisy values
    # (post-processing; dp/selection.py ``largest``); 0: no cap
    max_rows: int = 0
    # DP-FTRL, windowed only: a selection serves this many windows (dp/ftrl.py); 1: each window
    refresh: int = 1


@dataclass(frozen=True)
class AdaptiveClip:
    """Adaptive clipping (Andrew et al. 2021): C follows the target quantile of the clients'
    update norms through a noisy count of the clients under it."""

    target_quantile: float = 0.5  # gamma
    clip_lr: float = 0.2  # eta_C: C <- C exp(-eta_C (b - gamma))
    count_share: float = 0.1  # a: the budget share of the noisy clipped-count


@dataclass(frozen=True)
class DpWeights:
    """[dp]'s client weights: uniform (``cap`` 0), or capped w_k = min(1, n_k / cap), and the
    public mean weight of the denominator D = K * ``mean``; a row's denominator is D times
    ``download_keep``, p: the probability that a member holding the row requests it (the
    private download's, privacy.level; 1 without a randomized download)."""

    cap: float = 0.0
    mean: float = 1.0
    download_keep: float = 1.0


@dataclass(frozen=True)
class Distributed:
    """privacy.level = "full": distributed DP over secure aggregation (dp/distributed.py), each
    client's discrete noise share calibrated for ``min_survivors`` (0: the whole cohort) of
    them."""

    min_survivors: int = 0


@dataclass(frozen=True)
class NoiseKey:
    """dp.randomness: where the noise streams' key comes from, a secret from the OS (the
    default) or ``seed`` (train.seed: reproducible, and then no guarantee; dp/randomness.py)."""

    randomness: Randomness = "secret"
    seed: int = 0


@dataclass(frozen=True)
class DpSettings:
    """What the mechanism and the accountant of a run need (all public numbers)."""

    clip: float  # C, the L2 bound of each client's whole update (adaptive: the initial C)
    noise_multiplier: float  # z, of the round as one Gaussian mechanism
    accounting: Accounting
    rows: Rows = "private"
    selection: RowSelection = field(default_factory=RowSelection)  # read when rows = "private"
    adaptive: AdaptiveClip | None = None  # None: C stays `clip`
    weights: DpWeights = field(default_factory=DpWeights)
    distributed: Distributed | None = None  # privacy.level = "full"; None: central noise
    key: NoiseKey = field(default_factory=NoiseKey)
    # dp.mechanism: the central mechanism's name in dp/mechanisms.py's MECHANISMS
    mechanism: str = "gaussian"

    @property
    def randomness(self) -> Randomness:
        """dp.randomness (kept in ``key``): "seeded" publishes the noise's key."""
        return self.key.randomness

    @property
    def survivors_needed(self) -> int:
        """K_min: the fewest clients whose shares a secure sum may be decoded from."""
        least = self.distributed.min_survivors if self.distributed is not None else 0
        return least or self.accounting.clients_per_round

    @property
    def selection_multiplier(self) -> float:
        """z_sel = z / sqrt(s) (rows = "private"); DP-FTRL: z sqrt(k_max / s), the run's
        budget share s over the k_max rounds a user can take part in (``ftrl_scales``)."""
        if self.accounting.ftrl is not None:
            return self.noise_multiplier * self.ftrl_scales[0] / math.sqrt(self.selection.share)
        return self.noise_multiplier / math.sqrt(self.selection.share)

    @property
    def update_multiplier(self) -> float:
        """z_grad = z / sqrt(1 - s - a): what the row selection (s, private rows) and the
        adaptive clip's count (a) leave of the budget; z when neither is used. DP-FTRL: the
        tree's node noise z sens / sqrt(1 - s) (``ftrl_scales``)."""
        share = self.selection.share if self.rows == "private" else 0.0
        share += self.adaptive.count_share if self.adaptive is not None else 0.0
        scale = self.ftrl_scales[1] if self.accounting.ftrl is not None else 1.0
        return self.noise_multiplier * scale / math.sqrt(1.0 - share)

    @property
    def ftrl_scales(self) -> tuple[float, float]:
        """DP-FTRL (dp/ftrl_accounting.py): z is the multiplier of the whole run as one
        Gaussian mechanism, 1 / z^2 = k_max / z_sel^2 + sens^2 / z_tree^2, split by the share s:
        k_max / z_sel^2 = s / z^2 and sens^2 / z_tree^2 = (1 - s) / z^2 (s = 0 with rows =
        "all"). (sqrt(k_max), sens) over the configured rounds; with dp.selection_refresh > 1
        the selection's k_max is ``selection_count``'s."""
        pattern, rounds = self.accounting.ftrl, self.accounting.rounds
        assert pattern is not None, "DP-FTRL's scales"
        sens = self.accounting.ftrl_sensitivity(rounds)
        return math.sqrt(self.selection_count(rounds)), sens

    def selection_count(self, rounds: int) -> int:
        """DP-FTRL: the most released selection histograms one user adds to in ``rounds``
        rounds (sensitivity B each): k_max, one per participation; with dp.selection_refresh
        r > 1 (windowed, fedsub's) also at most the selections made by then, each reading one
        window a user is in at most once (w <= b): min(k_max, ``windowed_selections``)."""
        pattern = self.accounting.ftrl
        assert pattern is not None, "DP-FTRL's selection count"
        most = pattern.most(rounds)
        s = self.selection
        if s.refresh <= 1 or s.window <= 1:
            return most
        return min(most, selection.windowed_selections(rounds, s.window, s.refresh))

    @property
    def count_std(self) -> float:
        """The clipped-count's noise (adaptive clipping only): each member adds b_k - 1/2
        (sensitivity 1/2), with 1/z_count^2 = a / z^2, so std = z / (2 sqrt(a))."""
        assert self.adaptive is not None, "the clipped count is adaptive clipping's"
        return self.noise_multiplier / (2.0 * math.sqrt(self.adaptive.count_share))

    @property
    def selection_std(self) -> float:
        """The selection noise's standard deviation, z_sel * B."""
        return self.selection_multiplier * self.selection.bound

    @property
    def histogram_threshold(self) -> float:
        """The selection threshold in histogram units: tau * z_sel * B."""
        return self.selection.threshold * self.selection_std

    def epsilon(self, rounds: int) -> float:
        """Epsilon at ``delta`` after ``rounds`` rounds (dp-accounting)."""
        a = self.accounting
        if a.ftrl is not None:  # DP-FTRL: the tree over the rounds so far, one Gaussian
            return ftrl_accounting.gaussian_epsilon(
                self.ftrl_multiplier(rounds), a.delta, a.accountant
            )
        return accounting.epsilon(
            self.noise_multiplier,
            rounds,
            a.delta,
            a.accountant,
            a.sampling,
            a.num_clients,
            a.clients_per_round,
            self.distributed is not None,
        )

    def ftrl_multiplier(self, rounds: int) -> float:
        """DP-FTRL: the effective noise multiplier of ``rounds`` rounds under the pattern
        (dp/ftrl_accounting.py)."""
        pattern = self.accounting.ftrl
        assert pattern is not None, "DP-FTRL's multiplier"
        selection = self.selection_multiplier if self.rows == "private" else None
        return ftrl_accounting.effective_multiplier(
            self.update_multiplier,
            selection,
            rounds,
            pattern,
            self.accounting.ftrl_sensitivity(rounds),
            self.selection_count(rounds),
        )

    @property
    def budget(self) -> float | None:
        """The epsilon a run may not exceed (``accounting.epsilon_budget``), or None."""
        return self.accounting.epsilon_budget

    def as_json(self) -> dict:
        """summary.json's ``dp`` record without the epsilon reached."""
        private = self.rows == "private"
        return {
            "delta": self.accounting.delta,
            "noise_multiplier": self.noise_multiplier,
            "accountant": self.accounting.accountant,
            "sampling": self.accounting.sampling,
            "clip": self.clip,
            "rows": self.rows,
            "selection_share": self.selection.share if private else None,
            "selection_threshold": self.histogram_threshold if private else None,
            "adaptive_clip": self.adaptive is not None,
            "noise": (
                "distributed-discrete-gaussian"
                if self.distributed is not None
                else "ftrl-blt"
                if self.accounting.blt is not None
                else "ftrl-tree"
                if self.accounting.ftrl is not None
                else "central-gaussian"
            ),
            # DP-FTRL: the participation pattern enforced and accounted (no sampling assumed)
            "participation": self.accounting.ftrl.as_json() if self.accounting.ftrl else None,
            "min_survivors": self.survivors_needed if self.distributed is not None else None,
            # seeded: the noise and cohorts derive from the published train.seed
            "randomness": self.randomness,
            # ftrl-blt: the strategy's parameters (jax-privacy's), public like the pattern
            **({"blt": self.accounting.blt.as_json()} if self.accounting.blt else {}),
        }


def resolve(
    *,
    noise_multiplier: float | None,
    target_epsilon: float | None,
    delta: float | None,
    accountant: Accountant,
    sampling: Sampling,
    num_clients: int,
    clients_per_round: int,
    rounds: int,
    epsilon_budget: float | None,
    distributed: bool = False,
) -> tuple[float, Accounting]:
    """z and the accounting: delta defaulted (1/N^1.1), z calibrated when a target epsilon is
    given (then the budget is that target, unless a budget is set)."""
    delta = default_delta(num_clients) if delta is None else delta
    if delta >= 1.0 / num_clients:
        raise ConfigError(
            f"dp.delta = {delta:g} is not below 1/N = {1.0 / num_clients:.3g} (N = "
            f"{num_clients} clients): at delta >= 1/N, publishing one randomly chosen user's "
            "data outright is (0, delta)-DP; leave dp.delta unset (1/N^1.1) or lower it"
        )
    if noise_multiplier is None:
        if target_epsilon is None:
            raise ValueError("give dp.noise_multiplier or dp.target_epsilon")
        label = f"calibrating dp.noise_multiplier for epsilon {target_epsilon:g} (dp-accounting)"
        with phase(label) as advance:
            noise_multiplier = accounting.calibrate(
                target_epsilon,
                rounds,
                delta,
                accountant,
                sampling,
                num_clients,
                clients_per_round,
                distributed,
                on_step=lambda: advance(1),
            )
        epsilon_budget = target_epsilon if epsilon_budget is None else epsilon_budget
    if epsilon_budget is not None and rounds > 0:
        first = accounting.epsilon(
            noise_multiplier,
            1,
            delta,
            accountant,
            sampling,
            num_clients,
            clients_per_round,
            distributed,
        )
        if first > epsilon_budget:
            raise ConfigError(
                f"dp.epsilon_budget = {epsilon_budget:g} cannot pay for one round: round 1 "
                f"alone spends epsilon {first:.4g} (z = {noise_multiplier:g}, delta = "
                f"{delta:.3g}); raise the budget or the noise multiplier"
            )
    return noise_multiplier, Accounting(
        delta, accountant, sampling, num_clients, clients_per_round, rounds, epsilon_budget
    )


def resolve_ftrl(
    *,
    noise_multiplier: float | None,
    target_epsilon: float | None,
    delta: float | None,
    accountant: Accountant,
    num_clients: int,
    clients_per_round: int,
    rounds: int,
    epsilon_budget: float | None,
    pattern: Pattern,
) -> tuple[float, Accounting]:
    """DP-FTRL's z and accounting (``dp.mechanism = "ftrl-tree"``, dp/ftrl_accounting.py):
    z is the multiplier of the whole run as one Gaussian mechanism (``DpSettings.ftrl_scales``
    turns it into the selection's and the tree's noise), so a target epsilon is met by
    dp-accounting's calibration of one Gaussian."""
    delta = default_delta(num_clients) if delta is None else delta
    if delta >= 1.0 / num_clients:
        raise ConfigError(
            f"dp.delta = {delta:g} is not below 1/N = {1.0 / num_clients:.3g} (N = "
            f"{num_clients} clients); leave dp.delta unset (1/N^1.1) or lower it"
        )
    if noise_multiplier is None:
        if target_epsilon is None:
            raise ValueError("give dp.noise_multiplier or dp.target_epsilon")
        noise_multiplier = ftrl_accounting.calibrate_gaussian(target_epsilon, delta, accountant)
        epsilon_budget = target_epsilon if epsilon_budget is None else epsilon_budget
    return noise_multiplier, Accounting(
        delta,
        accountant,
        "fixed",
        num_clients,
        clients_per_round,
        rounds,
        epsilon_budget,
        ftrl=pattern,
    )


def refusals(settings: DpSettings) -> list[str]:
    """Why the resolved settings cannot train (empty: they can): the row selection's
    threshold out of reach of any row. A row's histogram value is the sum over the cohort
    of min(1, B / sqrt(|S(k)|)) <= K min(1, B) (Poisson: K the expected cohort, plus five
    standard deviations of its size); a threshold that this value misses by more than
    ``UNREACHABLE`` selection-noise standard deviations selects the best row with probability
    below 1e-6 a round: the update's rows are then noise's false positives only."""
    if settings.rows != "private" or settings.distributed is not None:
        return []
    a, bound = settings.accounting, settings.selection.bound
    cohort = float(a.clients_per_round)
    if a.sampling == "poisson":
        cohort += 5 * math.sqrt(cohort)
    reach = cohort * min(1.0, bound)
    missed = (settings.histogram_threshold - reach) / settings.selection_std
    if missed <= UNREACHABLE:
        return []
    return [
        f"dp.selection_threshold = {settings.selection.threshold:g} selection-noise standard "
        f"deviations (histogram value {settings.histogram_threshold:.4g}) is out of reach: a "
        f"row every member of a cohort of {cohort:g} touches reaches at most {reach:.4g} "
        f"(contribution bound B = {bound:g}), so even it is selected with probability below "
        "1e-6 a round and no row of the update is kept; lower the threshold (default 3)"
    ]
