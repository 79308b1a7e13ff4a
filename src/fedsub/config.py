"""Configuration: a TOML file with sections [data], [model], [train], [execution], [privacy],
[masking], [eval], [dp], [tracking], [clock] and
[algorithms.<name>], validated on load.

Every key has a type and an allowed range; an unknown key, a wrong type or an out-of-range value
raises ``ConfigError`` naming the key and what is allowed. ``--set section.key=value`` overrides
any key (the value is read as a TOML value, or as a plain string when it is not one).
"""

from __future__ import annotations

import codecs
import copy
import dataclasses
import math
import os
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from fedsub import moved_keys
from fedsub.algorithms.compose import RECIPE_KEYS, composed_table, parse_composed, recipe_of
from fedsub.algorithms.registry import (
    Composed,
    algorithm_names,
    check_combination,
    check_table_placement,
    check_table_sharding,
    options_class,
    split_name,
)
from fedsub.clock.settings import ClockConfig
from fedsub.clock.settings import config_refusals as clock_refusals
from fedsub.clock.settings import inert_keys as clock_inert_keys
from fedsub.data.registry import DATASETS, dataset_names
from fedsub.device import resolve_device
from fedsub.dp.accountant import Accountant
from fedsub.dp.accountant import Sampling as DpSampling
from fedsub.dp.mechanisms import (
    MECHANISMS,
    Calibration,
    DpAsked,
    ParticipationAsked,
    SelectionAsked,
)
from fedsub.engine.backends import backend_names
from fedsub.engine.captured_step import compile_unavailable
from fedsub.engine.runtime import IN_PROCESS
from fedsub.engine.schedule import LrSchedule, Sampling
from fedsub.errors import ArgumentError, ConfigError
from fedsub.keys import flat_values, parse_section
from fedsub.masking.schemes import SCHEMES as MASKING_SCHEMES
from fedsub.models.registry import model_names, model_spec
from fedsub.privacy.levels import DOWNLOADS as PRIVATE_DOWNLOADS
from fedsub.privacy.levels import LEVELS as PRIVACY_LEVELS
from fedsub.privacy.levels import heat_source_for, reaches


@dataclass(frozen=True)
class DataConfig:
    name: str = field(default="synthetic-sparse", metadata={"choices": dataset_names})
    """The dataset (`fedsub list datasets`); its options are further `[data]` keys."""
    path: str | None = None
    """Files on disk, for datasets read from files. A relative path is relative to the current
    directory (not the config's folder); the run's config.toml stores it absolute."""
    seed: int = field(default=0, metadata={"min": 0})
    """Data generation and split seed."""
    options: Any = None  # the dataset's own options dataclass, filled from the remaining keys


@dataclass(frozen=True)
class ModelConfig:
    name: str = field(default="sparse-lr", metadata={"choices": model_names})
    """The model (`fedsub list models`); its other keys are the chosen model's options."""
    options: Any = None  # the model's own options dataclass (its ModelSpec), from the other keys


# [model] keys every model accepted before each model had its own options: still accepted
# (and ignored) by a model that does not take them, so older configs and run folders load
LEGACY_MODEL_KEYS = ("init_std", "embedding_dim", "widths", "scaler")


@dataclass(frozen=True)
class ClientStepConfig:
    """[train]'s keys of a client's local step: the learning rate and its schedule over rounds,
    weight decay, gradient clipping and momentum (a group: the keys stay in [train])."""

    lr: float = field(default=0.1, metadata={"min_exclusive": 0.0})
    """The client learning rate (`[algorithms.<name>] lr` overrides it per algorithm)."""
    lr_schedule: str = field(
        default="constant",
        metadata={"choices": lambda: list(typing.get_args(LrSchedule))},
    )
    """`constant`, `inverse-round` (lr / (1 + t), t = round index, seed 004), `inverse-time` (lr /
    (1 + lr_decay t), seed 004's appendix C.2) or `exponential` (lr * lr_decay^t, x0.999 in the
    authors' Amazon code)."""
    lr_decay: float = field(default=0.999, metadata={"min_exclusive": 0.0, "max": 1.0})
    """The decay of the `exponential` and `inverse-time` schedules."""
    weight_decay: float = field(default=0.0, metadata={"min": 0.0})
    """Local L2 weight decay."""
    clip_norm: float = field(default=0.0, metadata={"min": 0.0})
    """Per-client gradient clipping by global norm; 0 = off."""
    momentum: float = field(default=0.0, metadata={"min": 0.0, "max": 1.0})
    """Local SGD momentum (buffers start at 0 every round)."""


@dataclass(frozen=True)
class TrainConfig:
    """[train]: the algorithms, the rounds and their cohorts, each client's local work (its step
    rule grouped in ``client_step``), checkpoints and the screening of updates."""

    algorithms: list[str] = field(
        default_factory=lambda: ["fedavg", "fedsubavg"],
        metadata={"algorithm_names": True, "nonempty": True},  # checked by check_algorithms
    )
    """The algorithms to train (see Algorithms); `name@scheme` for Li et al.'s schemes."""
    rounds: int = field(default=100, metadata={"min": 1})
    """Communication rounds."""
    clients_per_round: int = field(default=50, metadata={"min": 1})
    """K, the clients sampled per round; at most the number of clients (checked on load)."""
    local_steps: int = field(default=10, metadata={"min": 1})
    """I, the local SGD steps per client and round."""
    batch_size: int = field(default=5, metadata={"min": 1})
    """B, the local batch size."""
    client_step: ClientStepConfig = field(default_factory=ClientStepConfig)
    """lr, lr_schedule, lr_decay, weight_decay, clip_norm, momentum (keys of [train])."""
    seed: int = field(default=0, metadata={"min": 0})
    """Client schedule, local shuffles, model init."""
    sampling: str = field(
        default="fixed", metadata={"choices": lambda: list(typing.get_args(Sampling))}
    )
    """`fixed`: the algorithm's scheme draws the cohort (K clients); `poisson`: each client joins
    a round independently with probability q = K / N (the cohort's size varies; differential
    privacy's accountant then uses Poisson subsampling)."""
    heat: str = field(default="samples", metadata={"choices": lambda: ["clients", "samples"]})
    """FedSubAvg's heat: `samples` (sample-weighted, the default) or `clients` (Algorithm 1 of the
    paper: N / n_m)."""
    checkpoint_every: int = field(default=10, metadata={"min": 0})
    """Rounds between checkpoints; 0 = only when stopped (Ctrl-C, SIGTERM)."""
    max_update_norm: float = field(default=0.0, metadata={"min": 0.0})
    """Reject client updates with a larger norm; 0 = no limit."""


@dataclass(frozen=True)
class ExecutionConfig:
    """How and where a run executes: the number type, the backend, the device and the
    settings that make it faster or repeatable (moved from `[train]`; the old keys still
    load)."""

    dtype: str = field(default="float32", metadata={"choices": lambda: ["float32", "float64"]})
    """The parameters' floating-point type."""
    backend: str = field(default="batched", metadata={"choices": backend_names})
    """`batched`: the cohort steps together; `sequential`: client by client, the reference."""
    device: str = field(default="cpu", metadata={"validate": resolve_device})
    """Where the model, the server state and the training data live: `cpu`, `cuda`, `cuda:N` or
    `auto` (cuda when available, else cpu). A GPU this machine lacks is refused; every model,
    algorithm and masking scheme runs there. float32 means IEEE float32 there too: a run turns
    TensorFloat-32 off (numerics/float32.py)."""
    deterministic: bool = False
    """true: torch.use_deterministic_algorithms for the run and the round's scatter-adds as sorted
    segment sums (no atomics; numerics/segment_sum.py): a GPU run repeats bit for bit, and a killed
    and resumed run equals an uninterrupted one bit for bit (its scatter-adds are slower: 2-5x on
    one CPU thread; CPU runs were deterministic already)."""
    table_placement: str = field(default="device", metadata={"choices": lambda: ["device", "host"]})
    """`host`: the embedding tables, their per-row server state and heat coefficients stay in host
    memory (pinned on a GPU run) and only each round's cohort rows (the union of its S(k)) travel to
    the device and back (engine/placement.py), so a table larger than the GPU trains; the server
    step must be row-local (fedavg, fedsubavg, the -lazy adaptive servers; full-model fedadam /
    fedyogi / fedadagrad, server momentum and SCAFFOLD are refused)."""
    table_sharding: str = field(default="none", metadata={"choices": lambda: ["none", "rows"]})
    """`rows` (under torchrun only): each of the P processes holds a contiguous 1/P of every table's
    rows, with their server state and heat coefficients; a round fetches the cohort's rows from
    their owners and routes the row updates back (fedsub/sharding), so no process holds a whole
    table. The same model as one process (bit for bit with deterministic = true). Row-local
    algorithms only (fedavg, fedsubavg, the -lazy adaptive servers); refused with masking,
    privacy, [dp], SCAFFOLD, full-model adaptive servers, Scheme II and CentralSGD."""
    compile: str = field(default="off", metadata={"choices": lambda: ["off", "on", "cuda-graphs"]})
    """`on`: the batched backend's local step (embed, head, loss, gradients, client rule, update)
    captured as one program with torch.compile (inductor; on a GPU as CUDA graphs), its rows and ids
    padded to size classes (engine/captured_step.py); same model (float64 1e-10, float32 1e-5
    relative); refused on torch older than 2.13 (2.11's compiler fails on the step).
    `cuda-graphs` (CUDA devices only, any torch): a round's eager local steps recorded once per
    size class with torch.cuda.graph and replayed, no compiler (engine/cuda_graphs.py); the eager
    model up to the order of the GPU's atomic adds; DIN included. LSTM and sparse LR run eagerly
    (warned; DIN too with `on`). Both refused with backend `sequential`, masking or
    deterministic."""
    threads: int = field(default=0, metadata={"min": 0, "max": 4096})
    """torch intra-op threads (at most 4096); 0 = torch's default. Small cohorts of sparse models
    run faster on 1: handing tiny kernels between threads costs more than the kernels."""


@dataclass(frozen=True)
class PrivacyConfig:
    """Private submodel learning (fedsub.privacy): what the server may learn of each client's
    rows, and where its heat counts come from (moved from `[train]`; the old keys still
    load)."""

    level: str = field(default="none", metadata={"choices": lambda: list(PRIVACY_LEVELS)})
    """The privacy level (fedsub.privacy.levels): `none`, `heat`, `download` or `full`."""
    heat_source: str = field(
        default="exact",
        metadata={"choices": lambda: ["exact", "secagg", "sketch", "randomized-response"]},
    )
    """How the server learns the heat counts: `exact`, `secagg` (secure aggregation per group),
    `sketch` (count-min sketch through secure aggregation) or `randomized-response` (local
    differential privacy)."""
    rr_epsilon: float = field(default=2.0, metadata={"min_exclusive": 0.0})
    """Randomized response's local differential privacy epsilon."""
    sketch_eps: float = field(default=0.001, metadata={"min_exclusive": 0.0, "max": 1.0})
    """Count-min sketch error, relative to the total count."""
    sketch_delta: float = field(default=0.01, metadata={"min_exclusive": 0.0, "max": 0.5})
    """... and its failure probability."""
    secagg_group: int = field(default=50, metadata={"min": 2})
    """Clients per secure-aggregation group; at most the number of clients."""
    download: str = field(
        default="randomized-response", metadata={"choices": lambda: list(PRIVATE_DOWNLOADS)}
    )
    """Private download: `randomized-response` or `buckets`."""
    download_epsilon: float = field(default=4.0, metadata={"min_exclusive": 0.0, "max": 50.0})
    """Randomized response's local epsilon per row (q follows from it and p)."""
    download_keep: float = field(default=0.9, metadata={"min_exclusive": 0.0, "max_exclusive": 1.0})
    """p: the probability that a row the client holds is requested."""
    download_bucket: int = field(default=64, metadata={"min": 1})
    """Buckets: requests are padded to download_bucket, 2x, 4x, ... rows."""
    secagg_clip: float = field(default=1.0, metadata={"min_exclusive": 0.0, "max": 1e6})
    """`full`: the fixed-point range [-clip, clip] of a weighted delta value."""
    randomness: str = field(default="secret", metadata={"choices": lambda: ["secret", "seeded"]})
    """The coins of private download (its coins and decoys) and of the `randomized-response`
    heat source: `secret` (each client's own; in process one run secret kept only in
    checkpoints) or `seeded` (from `train.seed`: repeatable, and the download then hides
    nothing, the heat estimate decodes back into the exact counts)."""

    @property
    def effective_heat_source(self) -> str:
        """The heat source the level uses (fedsub.privacy.levels' ``heat_source_for``): from
        `heat` up, exact heat becomes `secagg` (a private source the user chose is kept)."""
        return heat_source_for(self.level, self.heat_source)


@dataclass(frozen=True)
class MaskingConfig:
    """Sub-model training on width-sliceable models (seed 003; fedsub.masking; moved from
    `[train]`, the old keys still load)."""

    scheme: str = field(default="none", metadata={"choices": lambda: list(MASKING_SCHEMES)})
    """The masking scheme: `none`, `static` (HeteroFL), `rolling` (FedRolex), `shuffled`
    (Algorithm 2), `random`, `bernoulli` (Algorithm 1)."""
    capacities: list[float] = field(
        default_factory=lambda: [1.0, 0.5, 0.25, 0.125, 0.0625],
        metadata={"min_exclusive": 0.0, "max": 1.0, "nonempty": True},
    )
    """The capacity levels of sub-model training."""
    capacity_proportions: list[float] = field(default_factory=list, metadata={"min_exclusive": 0.0})
    """Shares of the capacities; [] = equal."""
    capacity_assignment: str = field(
        default="fixed", metadata={"choices": lambda: ["fixed", "per-round", "memory"]}
    )
    """`fixed` (dealt once in those proportions), `per-round` (redrawn) or `memory` (dealt once,
    the largest levels to the clients with the most memory in [clock]'s device profiles; needs
    clock.mode other than `off`)."""
    average: str = field(
        default="scheme", metadata={"choices": lambda: ["scheme", "trainers", "all"]}
    )
    """`scheme` (each scheme's own paper's: `all` for `bernoulli` and `shuffled`, `trainers` for
    the others), `trainers` (HeteroFL / FedRolex: each entry averaged over the clients that
    trained it) or `all` (seed 003's Algorithms 1-2: untrained entries count as the old value in a
    mean over all the round's clients)."""


@dataclass(frozen=True)
class TrackingConfig:
    """Experiment tracking (runs/tracking.py): every round's metrics and the config written to
    TensorBoard and MLflow by the libraries themselves (`pip install 'fedsub[tracking]'`). Not
    part of what a run computes: every number is the same with it on or off."""

    tensorboard: bool = False
    """true: TensorBoard event files, one folder per algorithm (`tensorboard --logdir` it)."""
    tensorboard_dir: str = ""
    """Where the event files go (one subfolder per algorithm); "" = the run folder's
    `<algorithm>/tensorboard/` (a run without a folder must set it)."""
    mlflow: bool = False
    """true: one MLflow run per algorithm, its metrics by round and the config as parameters."""
    mlflow_uri: str = ""
    """The MLflow tracking URI (`sqlite:///mlflow.db`, `http://host:5000`); "" = a SQLite store
    in the run folder, `sqlite:///<out>/mlflow.db` (a run without a folder must set it)."""
    mlflow_experiment: str = "fedsub"
    """The MLflow experiment the runs go to (made when missing)."""
    run_name: str = ""
    """The runs' name prefix: each run is named `<run_name><algorithm>`; "" = the algorithm (a
    sweep's value before it: `train.lr=0.1: fedavg`)."""


@dataclass(frozen=True)
class EvalConfig:
    every: int = field(default=5, metadata={"min": 1})
    """Evaluate every this many rounds (and at round 0 and the last)."""
    train_loss_samples: int = field(default=10_000, metadata={"min": 1})
    """A fixed random subset of training samples for the train loss (more than the training set: all
    of it)."""
    target_train_loss: float | str | None = field(
        default=None, metadata={"min_exclusive": 0.0, "choices": lambda: ["central-min"]}
    )
    """Optional: rounds to target = the first round with train loss <= this; `central-min`: the
    lowest train loss CentralSGD reaches within the horizon."""
    target_test_auc: float | None = field(default=None, metadata={"min": 0.0, "max": 1.0})
    """Optional: ... with test AUC >= this (both given: both must hold; refused when the data have
    no test split or the task no AUC)."""
    regularized_loss: bool = False
    """Report the train loss with weight decay's L2 term, loss + (train.weight_decay / 2) ||w||^2:
    the objective whose gradient weight decay follows (seed 004's F(w) = CE + lambda ||w||^2 is
    train.weight_decay = 2 lambda). Off: the plain loss of the samples."""
    gradient_norms: bool = False
    """Log ||grad f||^2 and grad f^T D grad f (D = the heat coefficients) at each evaluation."""
    divergence_factor: float = field(default=10.0, metadata={"min": 0.0})
    """A run diverges at an evaluation whose train loss is NaN, Inf or above this many times the
    round-0 train loss (engine/guards.py: divergence_reason); 0 = NaN / Inf only."""


@dataclass(frozen=True)
class DpRowSelectionConfig:
    """[dp]'s keys of where the update's noise goes (a group: the keys stay in [dp])."""

    rows: str = field(default="private", metadata={"choices": lambda: ["private", "all"]})
    """`private`: rows selected privately each round from the cohort's noisy contribution
    histogram, noise only on them, the others unchanged (fedsub's sparsity-preserving form,
    after DP-AdaFEST); `all`: DP-FedAvg's noise on every row of every table (O(V) per round)."""
    selection_share: float = field(
        default=0.5, metadata={"min_exclusive": 0.0, "max_exclusive": 1.0}
    )
    """rows = private: the share s of the round's budget 1/z^2 spent on the row selection
    (1/z_sel^2 = s/z^2, 1/z_grad^2 = (1 - s)/z^2)."""
    selection_threshold: float = field(default=3.0, metadata={"min": 0.0})
    """rows = private: a row is selected when its noisy histogram value reaches this many
    selection-noise standard deviations (z_sel B); each untouched row is a false positive with
    probability P(N(0,1) >= this)."""
    selection_bound: float = field(default=1.0, metadata={"min_exclusive": 0.0})
    """rows = private: B, each client's contribution to the histogram is min(1, B /
    sqrt(|S(k)|)) on each row it touched (L2 norm <= B)."""
    heat_cap: float = field(default=0.0, metadata={"min": 0.0})
    """mechanism = "ftrl-tree", FedSubAvg: cap the private heat coefficient D / h_m at this many
    times FedAvg's 1 (h_m <- max(h_m, D / heat_cap)), bounding how much it amplifies a cold
    row's noise (fedsub's); 0: no cap (the threshold bounds it by D / threshold)."""
    selection_window: int = field(default=1, metadata={"min": 1})
    """mechanism = "ftrl-tree", rows = private: select the rows once every w rounds from the
    noisy histogram of the last window's w cohorts (each user at most once in it, so it costs
    what one round's selection costs; w <= min_separation), and update those rows in every
    round of the next window (fedsub's windowed selection); 1: a selection every round."""
    selection_max_rows: int = field(default=0, metadata={"min": 0})
    """mechanism = "ftrl-tree", rows = private: keep at most this many rows per table of each
    selection, those of the largest noisy histogram values (fedsub's cap on the rows noised a
    round; post-processing of the noisy histogram, so it costs no privacy); 0: no cap."""
    selection_refresh: int = field(default=1, metadata={"min": 1})
    """mechanism = "ftrl-*", rows = private, selection_window > 1: one selection serves this
    many windows (r), so only every r-th window's histogram is read and a user adds to at most
    min(k_max, the selections made) of them, which the accounting charges instead of k_max
    (fedsub's; it lets a large cohort, whose users come back often, spend less on the
    selection); 1: a selection every window."""


@dataclass(frozen=True)
class DpWeightsConfig:
    """[dp]'s keys of the clients' weights and the fixed denominator (a group: the keys stay in
    [dp])."""

    weight_cap: float = field(default=0.0, metadata={"min": 0.0})
    """0: every sampled client weighs 1; else w_k = min(1, n_k / weight_cap) (McMahan et al.'s
    capped weights), the fixed denominator K times `weight_mean`."""
    weight_mean: float = field(default=1.0, metadata={"min_exclusive": 0.0, "max": 1.0})
    """weight_cap > 0: the mean capped weight the fixed denominator D = K * weight_mean assumes,
    a public number you choose (never computed from the users' sample counts, which are
    private); 1 (D = K) never adds less noise than stated, and scales the average down by the
    true mean weight."""


@dataclass(frozen=True)
class DpTrustConfig:
    """[dp]'s keys of what the guarantee trusts: where its random choices come from and which
    data you declare public (a group: the keys stay in [dp])."""

    randomness: str = field(default="secret", metadata={"choices": lambda: ["secret", "seeded"]})
    """Where the random choices the guarantee relies on come from (the noise, the cohorts, the
    row selection's false positives, adaptive clipping's count noise): `secret`, drawn from the
    operating system's entropy when the run starts and kept only in its checkpoints (a resumed
    run continues it; two runs of one config differ); `seeded`, from `train.seed`, so a run
    repeats bit for bit, but anyone who reads the seed in config.toml can redraw and subtract
    the noise: its epsilon is NOT a guarantee (tests and reproductions only)."""

    public_test: bool = False
    """true: you declare the test split public (data of no user the guarantee protects, e.g. a
    released benchmark's test set): the test metrics, their best and the rounds to target are
    then post-processing of the released models, covered by epsilon, and summary.* says so.
    false: they are computed on the users' held-out data, not covered. fedsub cannot check the
    declaration: it is yours."""


@dataclass(frozen=True)
class DpParticipationConfig:
    """[dp]'s keys of who takes part (a group: the keys stay in [dp])."""

    min_survivors: int = field(default=0, metadata={"min": 0})
    """privacy.level = "full" (distributed DP): K_min, the fewest clients a secure sum may be
    decoded from; each client's discrete noise share is calibrated so that K_min shares reach
    the accounted noise, and secure aggregation's threshold is raised to K_min (fewer survivors
    cannot be unmasked). 0: the whole cohort (any dropout aborts the round)."""
    min_separation: int = field(default=0, metadata={"min": 0})
    """mechanism = "ftrl-tree": b, each user takes part at most once every b rounds (two of its
    rounds r < r' have r' - r >= b); the cohort draw skips a user inside its window, on every
    runtime, and epsilon is accounted for exactly this pattern (no sampling assumed). 0 or 1:
    no separation."""
    max_participations: int = field(default=0, metadata={"min": 0})
    """mechanism = "ftrl-tree": k, each user takes part in at most k rounds of the run (the
    cohort draw skips it afterwards); 0: as many as min_separation allows."""
    # --- ftrl-blt (dp/ftrl_blt.py) ---
    blt_buffers: int = field(default=0, metadata={"min": 0, "max": 10})
    """mechanism = "ftrl-blt": the number of buffers m of the BLT strategy jax-privacy optimises
    for train.rounds and the pattern (each noised row keeps m values per coordinate); 0: the
    number jax-privacy's optimiser chooses (up to 10)."""
    # --- end ftrl-blt ---


@dataclass(frozen=True)
class DpAdaptiveClipConfig:
    """[dp]'s keys of adaptive clipping (a group: the keys stay in [dp])."""

    adaptive_clip: bool = False
    """true: adaptive clipping (Andrew et al. 2021): `clip` is the initial C, which then follows
    the `target_quantile` of the clients' update norms through a noisy count of the clients
    under it (its noise takes `count_share` of the budget; epsilon is unchanged)."""
    target_quantile: float = field(default=0.5, metadata={"min": 0.0, "max": 1.0})
    """Adaptive clipping's gamma: the share of clients whose update should be under C."""
    clip_lr: float = field(default=0.2, metadata={"min_exclusive": 0.0})
    """Adaptive clipping's eta_C: C <- C exp(-eta_C (b - gamma)), b the noisy share under C."""
    count_share: float = field(default=0.1, metadata={"min_exclusive": 0.0, "max_exclusive": 1.0})
    """Adaptive clipping: the share a of the round's budget 1/z^2 spent on the count."""


@dataclass(frozen=True)
class DpConfig:
    """[dp]: the mechanism, its clip and noise (given or calibrated), the accounting and the
    budget; the row selection and adaptive clipping keys grouped (``row_selection``,
    ``adaptive_clipping``)."""

    mechanism: str = field(default="none", metadata={"choices": lambda: ["none", *MECHANISMS]})
    """User-level differential privacy (fedsub.dp; docs: Differential privacy): `none` (no noise,
    today's numbers bit for bit) or `gaussian` (each client's whole update clipped to `clip`,
    Gaussian noise on the sum, a fixed denominator, epsilon from dp-accounting on every
    evaluated round); or `ftrl-tree`, DP-FTRL (Kairouz et al. 2021): the same clip and fixed
    denominator, correlated noise from tree aggregation (Honaker's online estimate) so the model
    carries the noisy prefix sum of the updates, epsilon accounted for the participation pattern
    `min_separation` / `max_participations` that the cohort draw enforces, with no sampling
    assumption; or `ftrl-blt`, the same DP-FTRL with a buffered-linear-Toeplitz noise strategy
    (McMahan et al. 2024, "Don't use tree aggregation, use BLTs") optimised by jax-privacy for
    the rounds and the pattern (`blt_buffers`; pip install 'fedsub[blt]')."""
    clip: float = field(default=1.0, metadata={"min_exclusive": 0.0})
    """C: the L2 bound of each client's whole update (row deltas and dense deltas together)."""
    noise_multiplier: float | None = field(default=None, metadata={"min_exclusive": 0.0})
    """z: the noise's std over C on the sum (one Gaussian mechanism per round). Give it or
    `target_epsilon`, not both."""
    target_epsilon: float | None = field(default=None, metadata={"min_exclusive": 0.0})
    """Calibrate z so that `train.rounds` rounds spend this epsilon at `delta` (dp-accounting's
    calibrate_dp_mechanism); it is then also the run's budget."""
    delta: float | None = field(default=None, metadata={"min_exclusive": 0.0, "max_exclusive": 1.0})
    """The delta epsilon is reported at; default 1 / N^1.1 (N clients), below 1/N."""
    accountant: str = field(default="rdp", metadata={"choices": lambda: ["rdp", "pld"]})
    """dp-accounting's `rdp` or `pld` accountant (`pld` needs train.sampling = "poisson": it has
    no sampled-without-replacement event)."""
    row_selection: DpRowSelectionConfig = field(default_factory=DpRowSelectionConfig)
    """rows, selection_share, selection_threshold, selection_bound (keys of [dp])."""
    weights: DpWeightsConfig = field(default_factory=DpWeightsConfig)
    """weight_cap, weight_mean (keys of [dp])."""
    epsilon_budget: float | None = field(default=None, metadata={"min_exclusive": 0.0})
    """Stop before the round that would spend more than this epsilon (default: `target_epsilon`
    when given, else no budget)."""
    adaptive_clipping: DpAdaptiveClipConfig = field(default_factory=DpAdaptiveClipConfig)
    """adaptive_clip, target_quantile, clip_lr, count_share (keys of [dp])."""
    participation: DpParticipationConfig = field(default_factory=DpParticipationConfig)
    """min_survivors, min_separation, max_participations (keys of [dp])."""
    trust: DpTrustConfig = field(default_factory=DpTrustConfig)
    """randomness, public_test (keys of [dp])."""

    @property
    def min_survivors(self) -> int:
        """dp.min_survivors (kept in the ``participation`` group)."""
        return self.participation.min_survivors


@dataclass(frozen=True)
class Config:
    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    eval: EvalConfig
    algorithms: dict[str, Any] = field(default_factory=dict)  # base name -> options
    dp: DpConfig = field(default_factory=DpConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    clock: ClockConfig = field(default_factory=ClockConfig)  # the virtual clock (fedsub/clock)

    @classmethod
    def from_toml(
        cls, source: str | os.PathLike[str] | None = None, overrides: typing.Sequence[str] = ()
    ) -> Config:
        """A config from a TOML file (a path, or a str naming an existing file or ending in
        ``.toml``), from TOML text, or (``None``) fedsub's embedded default; ``overrides``
        are ``--set`` texts (``"train.rounds=2"``). Every key is checked: an error names it.

        >>> import fedsub
        >>> config = fedsub.Config.from_toml('[train]\\nrounds = 2', ["train.lr=0.5"])
        >>> config.train.rounds, config.train.client_step.lr
        (2, 0.5)
        """
        if source is not None and not isinstance(source, (str, os.PathLike)):
            raise ArgumentError(
                "Config.from_toml(source): source must be a TOML file's path, TOML text or "
                f"None, got {type(source).__name__}"
            )
        overrides = _override_texts(overrides)
        if source is None or isinstance(source, os.PathLike) or _names_a_file(source):
            return load(None if source is None else Path(source), overrides)
        try:
            raw = tomllib.loads(source.removeprefix("\ufeff"))  # a BOM read as text
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config text: not valid TOML: {error}") from None
        raw = moved_keys.in_sections(raw, where="config text")
        try:
            return parse(apply_overrides(raw, list(overrides)))
        except ConfigError as error:
            if str(error).startswith("--set "):
                raise
            culprit = _culprit(raw, list(overrides), str(error), None, {})
            culprit = culprit.replace("default config", "config text")
            raise ConfigError(f"{culprit}: {error}") from None

    @classmethod
    def from_dict(cls, raw: typing.Mapping[str, Any]) -> Config:
        """A config from TOML-shaped data: ``{"train": {"rounds": 2}, ...}`` (a missing key
        takes its built-in default), checked as a file's keys are.

        >>> import fedsub
        >>> fedsub.Config.from_dict({"model": {"name": "embedding-lr"}}).model.name
        'embedding-lr'
        """
        if not isinstance(raw, typing.Mapping):
            raise ArgumentError(
                "Config.from_dict(raw): raw must be a dict of TOML tables such as "
                f'{{"train": {{"rounds": 2}}}}, got {type(raw).__name__}'
            )
        return parse(copy.deepcopy(dict(raw)))

    def to_toml(self) -> str:
        """Every key, defaults included, as TOML (what a run folder's config.toml holds)."""
        return to_toml(self)

    def algorithm_options(self, name: str) -> Any:
        """A preset's options, or a composed algorithm's ``Composed`` (build_algorithm takes
        either)."""
        base, _ = split_name(name, self.composed_names())
        return self.algorithms.get(base) or options_class(base)()

    def composed_names(self) -> list[str]:
        return [n for n, v in self.algorithms.items() if isinstance(v, Composed)]


SECTIONS: dict[str, type | None] = {
    "data": DataConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "execution": ExecutionConfig,
    "privacy": PrivacyConfig,
    "masking": MaskingConfig,
    "eval": EvalConfig,
    "dp": DpConfig,
    "tracking": TrackingConfig,
    "clock": ClockConfig,
    "algorithms": None,  # [algorithms.<name>] tables, validated by each algorithm's options
}


def parse(raw: dict[str, Any], note: moved_keys.Note = moved_keys.note) -> Config:
    """The config of ``raw`` (TOML tables), every key checked; a key that moved out of
    ``[train]`` is read at its new place, with ``note`` (moved_keys.py)."""
    raw = moved_keys.in_sections(raw, note)
    unknown = sorted(set(raw) - set(SECTIONS), key=str)
    if unknown:
        raise ConfigError(
            f"unknown section [{unknown[0]}]; allowed sections: {', '.join(SECTIONS)}"
        )
    for section, table in raw.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{section} must be a [section] table, got {table!r}")
    data_raw = dict(raw.get("data", {}))
    common = {f.name for f in dataclasses.fields(DataConfig)} - {"options"}
    data = parse_section(DataConfig, "data", {k: v for k, v in data_raw.items() if k in common})
    options = parse_section(
        DATASETS[data.name].options,
        "data",
        {k: v for k, v in data_raw.items() if k not in common},
        context=f" (neither a common key nor an option of dataset {data.name!r})",
    )
    if data.path is not None and not DATASETS[data.name].reads_path:
        raise ConfigError(
            f"data.path = {data.path!r} is not read: dataset {data.name!r} is generated, or "
            "names its files in its own keys; remove data.path"
        )
    config = Config(
        data=dataclasses.replace(data, options=options),
        model=parse_model(raw.get("model", {})),
        train=parse_section(TrainConfig, "train", raw.get("train", {})),
        eval=parse_section(EvalConfig, "eval", raw.get("eval", {})),
        algorithms=parse_algorithms(raw.get("algorithms", {})),
        dp=parse_section(DpConfig, "dp", raw.get("dp", {})),
        execution=parse_section(ExecutionConfig, "execution", raw.get("execution", {})),
        privacy=parse_section(PrivacyConfig, "privacy", raw.get("privacy", {})),
        masking=parse_section(MaskingConfig, "masking", raw.get("masking", {})),
        tracking=parse_section(TrackingConfig, "tracking", raw.get("tracking", {})),
        clock=parse_section(ClockConfig, "clock", raw.get("clock", {})),
    )
    check_inert(config)
    check_clock(config)
    check_masking(config)
    check_algorithms(config)
    check_privacy(config)
    check_compile(config)
    check_dp(config)
    check_sharding(config)
    return config


def parse_model(table: dict[str, Any]) -> ModelConfig:
    """``[model]``: ``name``, then the other keys as the options of that model's spec
    (``models/registry.py``: its ``options`` dataclass says their types and ranges)."""
    model = parse_section(ModelConfig, "model", {k: v for k, v in table.items() if k == "name"})
    spec = model_spec(model.name)
    own = {f.name for f in dataclasses.fields(spec.options)}
    keys = {k: v for k, v in table.items() if k != "name"}
    options = parse_section(
        spec.options,
        "model",
        {k: v for k, v in keys.items() if k in own or k not in LEGACY_MODEL_KEYS},
        context=f" (not an option of model {model.name!r}: `fedsub list models`)",
    )
    return dataclasses.replace(model, options=options)


def check_compile(config: Config) -> None:
    """``execution.compile`` (``on`` or ``cuda-graphs``) captures the batched backend's local
    steps with fixed shapes: refuse the settings whose steps are not that one program."""
    x, scheme = config.execution, config.masking.scheme
    if x.compile == "off":
        return
    old_torch = compile_unavailable()
    refusals = [
        (
            x.backend != "batched",
            f'execution.backend = {x.backend!r} runs clients one by one; use backend "batched"',
        ),
        (
            scheme != "none",
            f"masking.scheme = {scheme!r} trains each round's slice groups (their sizes "
            'and shapes change every round) as separate cohorts; use scheme "none"',
        ),
        (
            x.deterministic,
            "execution.deterministic = true sums in a fixed order with sorted segment sums, whose "
            "sizes depend on the values; use deterministic = false",
        ),
        (x.compile == "on" and old_torch is not None, str(old_torch)),
    ]
    for condition, reason in refusals:
        if condition:
            raise ConfigError(f'execution.compile = "{x.compile}" cannot be used here: {reason}')


def check_sharding(config: Config) -> None:
    """``execution.table_sharding = "rows"``: refuse what needs a whole table in one process or a
    step that is not row-local (the algorithms themselves: ``check_algorithms``)."""
    x, privacy, masking = config.execution, config.privacy, config.masking
    if x.table_sharding != "rows":
        return
    refusals = [
        (
            masking.scheme != "none",
            f"masking.scheme = {masking.scheme!r} aggregates width slices per client",
        ),
        (privacy.level != "none", f"privacy.level = {privacy.level!r} aggregates on one process"),
        (config.dp.mechanism != "none", "[dp] adds noise to every row of every table"),
        (
            x.table_placement != "device",
            "execution.table_placement = 'host' is not combined with it",
        ),
        (config.eval.gradient_norms, "eval.gradient_norms = true reads whole tables"),
        (config.eval.regularized_loss, "eval.regularized_loss = true sums over whole tables"),
        (
            config.eval.target_train_loss == "central-min",
            "eval.target_train_loss = 'central-min' trains CentralSGD (one pooled client)",
        ),
    ]
    for condition, reason in refusals:
        if condition:
            raise ConfigError(
                f'execution.table_sharding = "rows" cannot be used here: {reason}; use '
                'execution.table_sharding = "none"'
            )


def check_privacy(config: Config) -> None:
    """Private download and secure aggregation change what the server holds of each client:
    refuse settings that need a client's own update (width slices, the server's norm
    screening) or a cohort too small to hide one (the sum of one client is its update)."""
    t, level, scheme = config.train, config.privacy.level, config.masking.scheme
    if level in ("download", "full") and scheme != "none":
        raise ConfigError(
            f"privacy.level = {level!r} cannot be combined with masking.scheme = "
            f"{scheme!r}: width slices are aggregated per client; use level none or heat"
        )
    if level != "none" and config.execution.table_placement == "host":
        raise ConfigError(
            f"privacy.level = {level!r} cannot be combined with execution.table_placement = "
            '"host" yet: the private round aggregates on the device; use table_placement '
            '"device" or level "none"'
        )
    if level == "full" and t.max_update_norm > 0:
        raise ConfigError(
            f"train.max_update_norm = {t.max_update_norm:g} needs each client's update norm, "
            'which privacy.level = "full" hides from the server (secure aggregation clips '
            "values to privacy.secagg_clip instead); set it to 0"
        )
    if level == "full" and t.clients_per_round < 2:
        raise ConfigError(
            f'privacy.level = "full" needs train.clients_per_round >= 2, got '
            f"{t.clients_per_round}: the secure sum of one client is its update"
        )


def check_dp(config: Config) -> None:
    """``[dp]``: a noise multiplier or a target epsilon (one), and nothing beside the Gaussian
    mechanism that shows the server a client's data or that this runtime has not been made
    private yet (the algorithms themselves: ``check_algorithms``)."""
    d, t = config.dp, config.train
    check_poisson_schemes(config)
    if d.mechanism == "none":
        check_no_dp_keys(d)
        return
    if (d.noise_multiplier is None) == (d.target_epsilon is None):
        raise ConfigError(
            f"[dp] mechanism = {d.mechanism!r} needs exactly one of dp.noise_multiplier (z) and "
            f"dp.target_epsilon (z calibrated for train.rounds); got noise_multiplier = "
            f"{d.noise_multiplier}, target_epsilon = {d.target_epsilon}"
        )
    sampled = MECHANISMS.get_or_refuse(d.mechanism).sampled  # its accounting counts on it
    if d.accountant == "pld" and t.sampling != "poisson" and sampled:
        raise ConfigError(
            "dp.accountant = 'pld' needs train.sampling = 'poisson': dp-accounting's PLD "
            "accountant has no event for fixed-size cohorts (sampled without replacement); "
            "use accountant 'rdp' or sampling 'poisson'"
        )
    for condition, reason in dp_refusals(config):
        if condition:
            raise ConfigError(f"[dp] mechanism = {d.mechanism!r} cannot be used here: {reason}")


def check_poisson_schemes(config: Config) -> None:
    """``train.sampling = "poisson"`` draws the cohort itself: no algorithm's scheme may draw
    its own (checked beside [dp], whose accountant reads the sampling)."""
    t = config.train
    if t.sampling == "poisson":
        schemes = [
            n for n in t.algorithms if split_name(n, config.composed_names())[1] != "default"
        ]
        if schemes:
            raise ConfigError(
                f'train.sampling = "poisson" cannot be combined with algorithm {schemes[0]!r}: '
                "its scheme draws its own cohort; use the default scheme"
            )


def dp_refusals(config: Config) -> list[tuple[bool, str]]:
    """What a DP mechanism cannot run with, in the order they are reported: what would show
    the server a client's data beside the noise, what this runtime has not made private yet,
    budget shares that leave nothing for the update, the clip's and DP-FTRL's own."""
    d, p = config.dp, config.privacy
    rows, adaptive = d.row_selection, d.adaptive_clipping
    refusals = [
        *distributed_refusals(config),
        (
            p.heat_source != "exact",
            f"privacy.heat_source = {p.heat_source!r}: under DP FedSubAvg's heat comes from "
            "the private row selection, so no heat source is used; leave it 'exact'",
        ),
        (
            config.masking.scheme != "none",
            f"masking.scheme = {config.masking.scheme!r}: differential privacy with width "
            "slices is not yet supported",
        ),
        (
            config.execution.table_placement != "device",
            "execution.table_placement = 'host' is not yet supported with differential privacy",
        ),
        (
            config.eval.gradient_norms,
            "eval.gradient_norms = true logs the exact heat coefficients' gradient norms: exact "
            "heat in the clear next to a DP claim; set it to false",
        ),
        (
            config.eval.target_train_loss == "central-min",
            "eval.target_train_loss = 'central-min' trains CentralSGD on the pooled data "
            "(server-side pooled data, no privacy); give a number",
        ),
        (
            adaptive.adaptive_clip
            and adaptive.count_share + (rows.selection_share if rows.rows == "private" else 0.0)
            >= 1,
            f"dp.count_share = {adaptive.count_share:g} and dp.selection_share = "
            f"{rows.selection_share:g} "
            "leave no budget for the update; their sum must be below 1",
        ),
        *clip_refusals(config),
        (
            rows.rows == "private" and rows.selection_threshold == 0,
            "dp.selection_threshold = 0 selects every untouched row with probability 1/2 and "
            "lets FedSubAvg's private heat coefficient D / h_m grow without bound; use > 0",
        ),
    ]
    return refusals + mechanism_refusals(config)


def dp_asked(config: Config) -> DpAsked:
    """What the config asks of [dp] and of the rounds around it, as a mechanism's accounting
    and refusals read it (dp/mechanisms.py). The casts: ``check_dp`` checked the choices."""
    d, t = config.dp, config.train
    calibration = Calibration(
        d.noise_multiplier,
        d.target_epsilon,
        d.delta,
        cast(Accountant, d.accountant),
        d.epsilon_budget,
    )
    return DpAsked(
        calibration,
        cast(DpSampling, t.sampling),
        t.clients_per_round,
        t.rounds,
        config.privacy.level == "full",
        d.adaptive_clipping.adaptive_clip,
        SelectionAsked(
            d.row_selection.rows,
            d.row_selection.selection_window,
            d.row_selection.selection_max_rows,
            d.row_selection.selection_refresh,
        ),
        ParticipationAsked(
            d.participation.min_separation,
            d.participation.max_participations,
            d.participation.blt_buffers,
        ),
    )


OPTIONAL_DP_KEYS: dict[str, tuple[Callable[[DpConfig], bool], str]] = {
    "dp.heat_cap": (lambda d: d.row_selection.heat_cap > 0, ""),
    "dp.selection_window": (
        lambda d: d.row_selection.selection_window > 1,
        " (the sampled Gaussian's accounting charges one selection per round)",
    ),
    "dp.min_separation": (
        lambda d: d.participation.min_separation > 0,
        " (it bounds the participation the mechanism is accounted for)",
    ),
    "dp.max_participations": (
        lambda d: d.participation.max_participations > 0,
        " (it bounds the participation the mechanism is accounted for)",
    ),
    "dp.selection_max_rows": (lambda d: d.row_selection.selection_max_rows > 0, ""),
    "dp.selection_refresh": (lambda d: d.row_selection.selection_refresh > 1, ""),
    "dp.blt_buffers": (lambda d: d.participation.blt_buffers > 0, ""),
}
"""[dp] keys only some mechanisms read (``MechanismSpec.keys``): when set, and why one that
does not read them refuses them (they would be silently ignored)."""


def mechanism_refusals(config: Config) -> list[tuple[bool, str]]:
    """What the chosen mechanism cannot run with (its spec's ``refusals``), and the optional
    [dp] keys set that it does not read (``OPTIONAL_DP_KEYS``)."""
    spec = MECHANISMS.get_or_refuse(config.dp.mechanism)
    refusals = []
    for key, (is_set, why) in OPTIONAL_DP_KEYS.items():
        readers = [repr(name) for name, other in MECHANISMS.items() if key in other.keys]
        where = " or ".join(readers) if readers else "none"
        refusals.append(
            (
                key not in spec.keys and is_set(config.dp),
                f"{key} applies to mechanism = {where} only{why}",
            )
        )
    return [*refusals, *spec.refusals(dp_asked(config))]


DTYPE_EPSILON = {"float32": 2.0**-23, "float64": 2.0**-52}  # execution.dtype's eps at 1.0


def check_no_dp_keys(dp: DpConfig) -> None:
    """dp.mechanism = "none": any other [dp] key away from its default would be silently
    ignored (no noise, no epsilon), so it is refused, naming dp.mechanism."""
    defaults = flat_values(DpConfig())
    changed = [k for k, v in flat_values(dp).items() if k != "mechanism" and v != defaults[k]]
    if changed:
        keys = ", ".join(f"dp.{k}" for k in changed)
        raise ConfigError(
            f"{keys} set while dp.mechanism = 'none': no differential privacy would run (no "
            "noise, no epsilon); set dp.mechanism = 'gaussian', or remove "
            f"{'it' if len(changed) == 1 else 'them'}"
        )


def clip_refusals(config: Config) -> list[tuple[bool, str]]:
    """What the clip and the weights cannot be: train.max_update_norm beside [dp] (it logs
    exact per-client norms), dp.weight_mean without a weight cap, and a clip so small that no
    update can move the model: a round moves it by at most C (the
    clipped mean; adaptive clipping's C grows at most exp(clip_lr) a round, noise aside), so
    all train.rounds rounds together move any weight by less than one unit in the last place
    of 1.0 in the run's dtype when C times their sum is below that dtype's epsilon."""
    d, t = config.dp, config.train
    adaptive = d.adaptive_clipping
    other = [
        (
            t.max_update_norm > 0,
            f"train.max_update_norm = {t.max_update_norm:g} screens each client's update by its "
            "exact norm and writes the rejected clients' ids and norms to rejections.jsonl, a "
            "release no epsilon covers; dp.clip bounds every update's norm: set it to 0",
        ),
        (
            d.weights.weight_cap == 0 and d.weights.weight_mean != 1.0,
            f"dp.weight_mean = {d.weights.weight_mean:g} is the mean of capped weights; it "
            "applies with dp.weight_cap > 0 only (uniform weights: D = K)",
        ),
    ]
    growth = adaptive.clip_lr * (t.rounds - 1) if adaptive.adaptive_clip else 0.0
    log_reach = math.log(d.clip) + math.log(max(t.rounds, 1)) + growth  # C R e^(lr (R - 1))
    reach = math.exp(min(log_reach, 700.0))
    resolution = DTYPE_EPSILON[config.execution.dtype]
    return [
        *other,
        (
            reach < resolution,
            f"dp.clip = {d.clip:g} lets all {t.rounds} rounds move the model by at most "
            f"{reach:.3g} in all, below {config.execution.dtype}'s resolution at 1.0 "
            f"({resolution:.3g}): every update vanishes; use a clip near the updates' norms "
            "(e.g. 0.1 to 10)",
        ),
    ]


def distributed_refusals(config: Config) -> list[tuple[bool, str]]:
    """What distributed DP over secure aggregation (privacy.level = "full", fedsub/dp/
    distributed.py) cannot do, and why; nothing at the other levels."""
    d, t = config.dp, config.train
    if config.privacy.level != "full":
        return [(d.min_survivors > 0, "dp.min_survivors applies to privacy.level = 'full' only")]
    why = "privacy.level = 'full' (distributed DP, noise added by the clients): "
    return [
        (
            d.row_selection.rows != "all",
            why + "dp.rows = 'private' thresholds the cohort's contribution histogram, which "
            "no party sees under secure aggregation; set dp.rows = 'all' (noise on every value "
            "of the round's public row union)",
        ),
        (
            t.sampling != "fixed",
            why + "the clients' noise shares are calibrated for a cohort size, which Poisson "
            "sampling leaves random; use train.sampling = 'fixed'",
        ),
        (
            d.adaptive_clipping.adaptive_clip,
            why + "adaptive clipping's noisy count would need its own secure sum; set "
            "dp.adaptive_clip = false",
        ),
        (
            d.weights.weight_cap > 0,
            why + "the denominator of capped weights needs every client's sample count, which "
            "no client sends at this level; set dp.weight_cap = 0 (uniform weights)",
        ),
        (
            d.min_survivors > t.clients_per_round,
            f"dp.min_survivors = {d.min_survivors} exceeds train.clients_per_round = "
            f"{t.clients_per_round}",
        ),
    ]


def check_algorithms(config: Config) -> None:
    """Every name in train.algorithms is a preset or composed in [algorithms.<name>], and its
    pieces combine with each other and with the training settings on the in-process engine
    (registry.check_combination, the one place incompatible pieces are refused)."""
    t = config.train
    twice = next((n for i, n in enumerate(t.algorithms) if n in t.algorithms[:i]), None)
    if twice is not None:
        raise ConfigError(f"train.algorithms lists {twice!r} twice; give each algorithm once")
    for name in t.algorithms:
        try:
            _, scheme = split_name(name, config.composed_names())
        except ValueError as error:
            raise ConfigError(f"train.algorithms = {name!r} is not allowed: {error}") from None
        check_combination(
            name,
            recipe_of(name, config.algorithms),
            scheme=scheme,
            momentum=t.client_step.momentum,
            masking=config.masking.scheme,
            privacy=config.privacy.level,
            runtime=IN_PROCESS,
            dp=config.dp.mechanism,
            dp_rows=config.dp.row_selection.rows,
        )
        check_table_placement(
            name, config.algorithm_options(name), config.execution.table_placement
        )
        check_table_sharding(name, config.algorithm_options(name), config.execution.table_sharding)


def check_clock(config: Config) -> None:
    """``[clock]``'s refusals (fedsub/clock/hooks.py says why each combination is refused)."""
    c = config.clock
    refusals = clock_refusals(
        c,
        dp_on=config.dp.mechanism != "none",
        private_level=config.privacy.level != "none",
        masking=config.masking.scheme != "none",
    )
    if config.masking.capacity_assignment == "memory" and not c.on:
        refusals.append(
            (
                True,
                "masking.capacity_assignment = 'memory' reads the clients' memory from "
                "[clock]'s device profiles: set clock.mode",
            )
        )
    if c.mode == "fedbuff" and config.execution.table_placement == "host":
        refusals.append(
            (
                True,
                'clock.mode = "fedbuff" cannot be combined with execution.table_placement = '
                '"host": its buffer is aggregated on the device',
            )
        )
    if c.on and config.execution.table_sharding != "none":
        refusals.append((True, "[clock] cannot be combined with execution.table_sharding"))
    for refused, why in refusals:
        if refused:
            raise ConfigError(why)
    for key, why in clock_inert_keys(c):
        raise ConfigError(f"{key} does nothing here: {why} leaves it unused; remove {key}")


def check_masking(config: Config) -> None:
    """Sub-model masking needs a width-sliceable model (its algorithms are checked by
    ``check_algorithms``)."""
    m = config.masking
    if m.capacity_proportions and len(m.capacity_proportions) != len(m.capacities):
        raise ConfigError(
            f"masking.capacity_proportions has {len(m.capacity_proportions)} entries but "
            f"masking.capacities has {len(m.capacities)}; give one proportion per capacity"
        )
    if m.scheme == "none":
        return
    if not model_spec(config.model.name).sliceable:
        sliceable = [n for n in model_names() if model_spec(n).sliceable]
        raise ConfigError(
            f"masking.scheme = {m.scheme!r} needs a width-sliceable model "
            f"({', '.join(sliceable)}); model.name is {config.model.name!r}"
        )


def inert_keys(config: Config) -> list[tuple[str, str]]:
    """The ``[masking]`` / ``[privacy]`` keys that the rest of ``config`` leaves unused, each
    with the key that switches it off (a value other than the default there does nothing)."""
    m, p = config.masking, config.privacy
    source = p.effective_heat_source
    unused = {
        "masking.scheme = 'none'": (
            ("masking", k) for k in ("capacities", "capacity_proportions",
                                     "capacity_assignment", "average")
        ) if m.scheme == "none" else (),
        f"privacy.level = {p.level!r} (private download starts at 'download')": (
            ("privacy", k) for k in ("download", "download_epsilon", "download_keep",
                                     "download_bucket")
        ) if not reaches(p.level, "download") else (),
        f"privacy.level = {p.level!r} and the heat source is {source!r} (privacy.randomness "
        "keys the private download's coins and the randomized-response heat's)": (
            [("privacy", "randomness")]
            if not reaches(p.level, "download") and source != "randomized-response" else ()
        ),
        f"privacy.download = {p.download!r}": (
            [("privacy", "download_epsilon"), ("privacy", "download_keep")]
            if p.download == "buckets" else [("privacy", "download_bucket")]
        ) if reaches(p.level, "download") else (),
        f"privacy.level = {p.level!r} (secure aggregation's clip is level 'full''s)": (
            [("privacy", "secagg_clip")] if p.level != "full" else ()
        ),
        f"the heat source is {source!r}": [
            ("privacy", k)
            for k, used in (("rr_epsilon", "randomized-response"), ("sketch_eps", "sketch"),
                            ("sketch_delta", "sketch"))
            if source != used
        ],
    }  # fmt: skip
    return [(f"{s}.{k}", why) for why, keys in unused.items() for s, k in keys]


def check_inert(config: Config) -> None:
    """Refuse a ``[masking]`` / ``[privacy]`` key set to a value other than its default where
    the rest of the config leaves it unused (``train(mask_average='all')`` without masking):
    an option that does nothing is a mistake the user should hear of."""
    for dotted, why in inert_keys(config):
        section, key = dotted.split(".")
        part = getattr(config, section)
        value = getattr(part, key)
        if value != getattr(type(part)(), key):
            raise ConfigError(
                f"{dotted} = {value!r} does nothing here: {why}; remove {dotted}, or set "
                "what it applies to"
            )


def parse_algorithms(raw: dict[str, Any]) -> dict[str, Any]:
    """``[algorithms.<name>]`` tables: a preset's options (such as fedprox's ``mu``), or an
    algorithm composed of pieces (aggregation / client / server keys; algorithms/compose.py)."""
    parsed = {}
    for name, table in raw.items():
        if not isinstance(table, dict):
            raise ConfigError(f"algorithms.{name} must be a table of options, got {table!r}")
        if name in algorithm_names() and not set(RECIPE_KEYS) & set(table):
            parsed[name] = parse_section(options_class(name), f"algorithms.{name}", table)
        elif name in algorithm_names() or set(RECIPE_KEYS) & set(table):
            parsed[name] = parse_composed(name, table, parse_section)
        else:
            raise ConfigError(
                f"[algorithms.{name}] is not an algorithm; choose from "
                f"{', '.join(algorithm_names())}, or compose one with "
                f"{' / '.join(RECIPE_KEYS)} keys"
            )
    return parsed


UNSET = object()  # ``--set key=none``: the key is removed, so it takes its built-in default


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value is TOML or a plain string,
    or ``UNSET`` for a bare ``none`` (TOML has no null; ``"none"`` in quotes is the string)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    dotted, value_text = text.split("=", 1)
    section, dot, key = dotted.strip().partition(".")
    if section == "algorithms":
        section, dot, key = dotted.strip().rpartition(".")
    if not dot or not key or section.split(".")[0] not in SECTIONS:
        raise ConfigError(
            f"--set {text!r}: the key must be section.key with section one of {', '.join(SECTIONS)}"
        )
    if value_text.strip().lower() == "none":
        return section, key, UNSET
    try:
        value = tomllib.loads(f"v = {value_text}")["v"]
    except tomllib.TOMLDecodeError:
        value = value_text
    return section, key, value


def apply_overrides(
    raw: dict[str, Any], overrides: list[str], note: moved_keys.Note = moved_keys.note
) -> dict[str, Any]:
    """``raw`` with each ``--set`` applied in order (``none`` removes the key); ``raw``'s
    keys and the ``--set`` keys that moved out of ``[train]`` at their new place (noted).
    A later ``--set`` of a key overrides an earlier one, but not under its other name: an
    old ``train`` key and its new place both set are refused naming both."""
    merged = copy.deepcopy(moved_keys.in_sections(raw, note))
    given: dict[tuple[str, str], str] = {}  # a --set's place -> the text that set it
    for text in overrides:
        section, key, value = parse_override(text)
        place = moved_keys.moved_override(section, key, None)
        earlier = given.setdefault(place, text)
        if parse_override(earlier)[:2] != (section, key):
            raise ConfigError(
                f"--set {_shown(earlier)} and --set {_shown(text)} set the same key under its "
                f"old and new name ({moved_keys.current_name(f'{section}.{key}')}); give "
                "only the new one"
            )
        section, key = moved_keys.moved_override(section, key, note)
        table: Any = merged
        for part in ["algorithms", section.split(".", 1)[1]] if "." in section else [section]:
            table = table.setdefault(part, {}) if isinstance(table, dict) else None
        if not isinstance(table, dict):
            raise ConfigError(f"--set {_shown(text)}: [{section}] is not a table in the config")
        if value is UNSET:
            table.pop(key, None)
        else:
            table[key] = value
    return merged


def read_toml(path: Path) -> dict[str, Any]:
    """The file's TOML tables; UTF-8 with or without the byte-order mark some Windows editors
    write first (TOML itself forbids it, so tomllib alone would refuse such a file)."""
    if path.is_dir():
        inside = path / "config.toml"
        hint = f" (a run folder's config is {inside})" if inside.is_file() else ""
        raise ConfigError(f"{path} is a directory, not a config file; give a TOML file{hint}")
    try:
        with open(path, "rb") as handle:
            data = handle.read()
        if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            raise ConfigError(f"{path}: the file is UTF-16 (its byte-order mark); save it as UTF-8")
        return tomllib.loads(data.decode("utf-8-sig"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot be read: {error}") from None


def load(
    path: Path | None,
    overrides: typing.Sequence[str] = (),
    named: typing.Mapping[str, str] | None = None,
) -> Config:
    """The config at ``path`` (or fedsub's embedded default) with ``--set`` overrides applied.

    An error names its cause: the ``--set`` that introduced it (or, for an override in
    ``named``, the flag it came from, e.g. ``--algorithm X``), else the file."""
    raw = read_toml(path if path is not None else default_config_path())
    raw = moved_keys.in_sections(raw, where=str(path or "default config"))
    try:
        return parse(apply_overrides(raw, list(overrides)))
    except ConfigError as error:
        if str(error).startswith("--set "):  # already names its --set
            raise
        culprit = _culprit(raw, list(overrides), str(error), path, named or {})
        raise ConfigError(f"{culprit}: {error}") from None


def _culprit(
    raw: dict[str, Any],
    overrides: list[str],
    message: str,
    path: Path | None,
    named: typing.Mapping[str, str],
) -> str:
    """Who to blame for ``message``: the first ``--set`` (or named flag) after which it
    appears, else the file when it is there without any."""
    where = str(path) if path is not None else "default config"
    shown = [named.get(text, f"--set {_shown(text)}") for text in overrides]
    for count in range(len(overrides) + 1):
        try:
            parse(apply_overrides(raw, overrides[:count], note=None), note=None)
        except ConfigError as error:
            if str(error) == message:
                return where if count == 0 else shown[count - 1]
    return f"{where} with {' '.join(shown)}"


def _shown(text: str) -> str:
    """``text`` as typed, or quoted when it holds characters that would break the line."""
    return text if text.isprintable() else repr(text)


def _override_texts(overrides: Any) -> list[str]:
    """``Config.from_toml``'s overrides: a list of ``--set`` texts, or one text (a
    one-element list, not its letters)."""
    if isinstance(overrides, str):
        return [overrides]
    if not isinstance(overrides, (list, tuple)) or not all(isinstance(o, str) for o in overrides):
        raise ArgumentError(
            "Config.from_toml(source, overrides): overrides must be a list of 'section.key=value' "
            f"texts, got {overrides!r}"
        )
    return list(overrides)


def _names_a_file(text: str) -> bool:
    """Whether ``Config.from_toml``'s text is a path (one line naming a file or ending in
    ``.toml``) rather than TOML text."""
    if "\n" in text:
        return False
    return Path(text).exists() or text.strip().endswith(".toml")


def default_config_path() -> Path:
    return Path(__file__).parent / "configs" / "default.toml"


def toml_value(value: Any) -> str:
    """``value`` as a TOML value (what ``--set key=...`` and ``--sweep`` take)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table; keys quoted (they may hold dots)
        pairs = (f"{toml_value(k)} = {toml_value(v)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    return repr(value)


def to_toml(config: Config) -> str:
    """The resolved config (every key, defaults included) as TOML; unset optional keys omitted."""
    lines: list[str] = []
    for section in (s for s, cls in SECTIONS.items() if cls is not None):
        part = getattr(config, section)
        items = flat_values(part)
        options = items.pop("options", None)
        if options is not None:
            items.update(dataclasses.asdict(options))
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in items.items() if v is not None]
        lines.append("")
    for name, options in config.algorithms.items():
        lines.append(f"[algorithms.{name}]")
        table = options if not isinstance(options, Composed) else None
        values = (composed_table(options) if table is None else dataclasses.asdict(table)).items()
        lines += [f"{k} = {toml_value(v)}" for k, v in values if v is not None]
        lines.append("")
    return "\n".join(lines)
