"""From a config to a run ready to start: the data, the model, the schedule, the privacy
settings, the algorithms' context and the evaluator.

The one place a ``Config`` becomes these objects: a comparison (experiment.py), the Python
API (library.py), the command line and the Flower apps all build their runs here, so a key
means the same thing everywhere. Nothing here writes a file.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

import torch

from fedsub import distributed
from fedsub.algorithms.registry import AlgorithmContext, heat_coefficients
from fedsub.config import Config, dp_asked
from fedsub.data.federated import FederatedDataset
from fedsub.data.registry import load_dataset
from fedsub.device import resolve_device
from fedsub.dp import accountant as dp_accountant
from fedsub.dp import settings as dp_settings
from fedsub.dp.distributed import NodeNoise
from fedsub.dp.mechanisms import MECHANISMS
from fedsub.dp.randomness import NOT_A_GUARANTEE
from fedsub.engine.diagnostics import gradient_norms
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.execution import (
    DTYPES,
    Compile,
    CudaGraphs,
    Execution,
    TablePlacement,
    TableSharding,
)
from fedsub.engine.features.dp import DpReport
from fedsub.engine.loop import Evaluation
from fedsub.engine.schedule import ClientStep, LocalWork, LrSchedule, Sampling, Schedule
from fedsub.errors import ConfigError
from fedsub.feature_messages import Answer, Carried, NodeFacts
from fedsub.files.json_values import dumps
from fedsub.masking.capacity import Assignment, Capacities
from fedsub.masking.schemes import AverageOver, Masking
from fedsub.models.base import Model
from fedsub.models.registry import build_checked_model
from fedsub.models.torch_module import TorchModuleModel, check_runs_in
from fedsub.numerics.secret_streams import Randomness
from fedsub.privacy import levels as privacy_levels
from fedsub.privacy.heat_protocol import HEAT, heat_answer
from fedsub.privacy.heat_sources import HeatPrivacy, coins_record, describe
from fedsub.privacy.randomness import HeatCoins, StageStates
from fedsub.privacy.secure_rows_protocol import SECURE_ROWS, secure_rows_answer
from fedsub.progress import phase
from fedsub.runs.checks import check_against_dataset
from fedsub.submodel.heat import HeatKind
from fedsub.submodel.index import SubmodelIndex

LOG = logging.getLogger("fedsub")


def resolve_path(path: str) -> str:
    """A ``data.path`` as an absolute path: relative paths are relative to the current
    directory (where fedsub is started), never to the config file's folder."""
    return str(Path(path).expanduser().absolute())


def with_resolved_paths(config: Config) -> Config:
    """The config with ``data.path`` absolute, as a run stores it (so it can be resumed or
    rerun from any directory)."""
    if config.data.path is None:
        return config
    data = dataclasses.replace(config.data, path=resolve_path(config.data.path))
    return dataclasses.replace(config, data=data)


def load_data(config: Config) -> FederatedDataset:
    """The dataset of ``[data]`` (name, options, path, seed)."""
    config = with_resolved_paths(config)
    with phase(f"loading {config.data.name}"):
        return load_dataset(
            config.data.name, config.data.options, config.data.path, config.data.seed
        )


def model_of(config: Config, dataset: FederatedDataset) -> Model:
    """The configured model, shaped for ``dataset`` (refused when it cannot read all of it)."""
    options = {
        f.name: getattr(config.model, f.name)
        for f in dataclasses.fields(config.model)
        if f.name != "name"
    }
    model = build_checked_model(config.model.name, dataset, options)
    if isinstance(model, TorchModuleModel):  # a config's torch-module: its forward in the dtype
        check_runs_in(model, dataset, config.execution.dtype)
    return model


def checked_model(config: Config, dataset: FederatedDataset, model: Model | None = None) -> Model:
    """``model`` (none: the configured one), with the run's keys checked against the data
    (``checks.py``: clients per round, batch size, targets, ...)."""
    if model is None:
        model = model_of(config, dataset)
    check_against_dataset(config, dataset, model)
    return model


def privacy_of(config: Config) -> privacy_levels.Privacy:
    """``[privacy]``'s level and its settings (choices checked by config.py, hence the
    casts)."""
    p = config.privacy
    return privacy_levels.Privacy(
        cast(privacy_levels.Level, p.level),
        cast(privacy_levels.Download, p.download),
        p.download_epsilon,
        p.download_keep,
        p.download_bucket,
        p.secagg_clip,
        cast(Randomness, p.randomness),
    )


def execution_of(config: Config) -> Execution:
    """``[execution]`` on this process's device. The casts: config.py checked the choices."""
    x = config.execution
    device = distributed.process_device(resolve_device(x.device))
    return Execution(
        dtype=DTYPES[x.dtype],
        backend=x.backend,
        device=device,
        deterministic=x.deterministic,
        table_placement=cast(TablePlacement, x.table_placement),
        table_sharding=cast(TableSharding, x.table_sharding),
        compile=_capture(x.compile, device),
    )


def _capture(compile: str, device: torch.device) -> Compile | CudaGraphs | None:
    """``execution.compile`` on ``device``: how the batched local steps are captured."""
    if compile == "on":
        return Compile.for_device(device)
    if compile != "cuda-graphs":
        return None
    if device.type != "cuda":
        raise ConfigError(
            f'execution.compile = "cuda-graphs" needs a CUDA device (execution.device is '
            f'{str(device)!r} here); use "on" (torch.compile) or "off" elsewhere'
        )
    return CudaGraphs()


def schedule_of(config: Config, num_clients: int | None = None) -> Schedule:
    """The run's ``Schedule``: ``[train]``'s sizes and rates, ``[execution]``, ``[masking]``,
    ``[privacy]`` and ``eval.every``, on this process's device; with ``num_clients`` (the
    population) ``[dp]`` too, resolved for it (``dp_of``): the whole config, what an
    in-process reference needs (a script training with ``schedule_of(config)`` alone runs
    without DP). Without it the schedule has no ``[dp]``: a Flower node's, which never
    applies the central mechanism itself."""
    schedule = _schedule_without_dp(config)
    if num_clients is None:
        return schedule
    schedule = with_memory_capacities(config, schedule, num_clients)  # [clock] (issue 51)
    return schedule.with_setting(dp_settings.DpSettings, dp_of(config, num_clients))


def with_memory_capacities(config: Config, schedule: Schedule, num_clients: int) -> Schedule:
    """``masking.capacity_assignment = "memory"``: the capacities dealt by the clients' memory
    in [clock]'s device profiles (fedsub/clock/profiles.py); else ``schedule`` as it is."""
    masking = schedule.setting(Masking)
    if masking is None or masking.capacities.assignment != "memory":
        return schedule
    from fedsub.clock.profiles import clock_inputs

    profiles, _ = clock_inputs(config.clock, config.train.seed, num_clients)
    memory = tuple(float(m) for m in profiles.memory)
    capacities = dataclasses.replace(masking.capacities, memory=memory)
    return schedule.with_setting(Masking, dataclasses.replace(masking, capacities=capacities))


def _schedule_without_dp(config: Config) -> Schedule:
    t, m = config.train, config.masking
    # The casts: config.py types its choice fields as str and has checked each value against
    # the field's choices, which are the Literal types named here.
    return Schedule(
        rounds=t.rounds,
        clients_per_round=t.clients_per_round,
        local=LocalWork(
            t.local_steps,
            t.batch_size,
            ClientStep(
                lr=t.client_step.lr,
                lr_schedule=cast(LrSchedule, t.client_step.lr_schedule),
                lr_decay=t.client_step.lr_decay,
                weight_decay=t.client_step.weight_decay,
                clip_norm=t.client_step.clip_norm,
                momentum=t.client_step.momentum,
            ),
        ),
        seed=t.seed,
        execution=execution_of(config),
        eval_every=config.eval.every,
        settings=(
            Masking(
                m.scheme,
                Capacities(
                    tuple(m.capacities),
                    tuple(m.capacity_proportions),
                    cast(Assignment, m.capacity_assignment),
                ),
                None if m.average == "scheme" else cast(AverageOver, m.average),
            ),
            privacy_of(config),
        ),
        sampling=cast(Sampling, t.sampling),
    )


def node_noise(config: Config, client: int, seeded: bool = False) -> NodeNoise | None:
    """A Flower node's part in distributed DP as its copy of the run config states it
    (dp/distributed.py's ``NodeNoise``), or None (no [dp], or a level below full)."""
    if config.dp.mechanism == "none" or config.privacy.level != "full":
        return None
    d = config.dp
    k_min = d.min_survivors or config.train.clients_per_round
    return NodeNoise(d.clip, d.noise_multiplier, k_min, config.train.seed, client, seeded)


@dataclass(frozen=True)
class NodeProtocol:
    """A feature's protocol a node answers itself (fedsub/feature_messages.py): how it is
    carried, and the node's ``Answer`` as its copy of the run config states it (``answer``:
    the config, the node's facts, whether [dp]'s noise shares are seeded)."""

    carried: Carried
    answer: Callable[[Config, NodeFacts, bool], Answer]


def _heat_answer(config: Config, node: NodeFacts, seeded: bool) -> Answer:
    """The private heat exchange, by the node's privacy.heat_source (``heat_privacy_of``)."""
    kind = cast(HeatKind, config.train.heat)  # config.py has checked it
    return heat_answer(heat_privacy_of(config), kind, node.table_rows, node.rows, node.num_samples)


def _secure_rows_answer(config: Config, node: NodeFacts, seeded: bool) -> Answer:
    """The secure row sums: the node's count weights its deltas (with [dp] at level full its
    noisy share, ``node_noise``: ``seeded`` or not)."""
    noise = node_noise(config, node.client, seeded)
    level = config.privacy.level
    return secure_rows_answer(privacy_of(config), level, node.num_samples, noise)


# the features' protocols a node answers itself, in their order (a Flower ClientApp carries
# each by its action: flower/protocols.py)
NODE_PROTOCOLS: tuple[NodeProtocol, ...] = (
    NodeProtocol(HEAT, _heat_answer),
    NodeProtocol(SECURE_ROWS, _secure_rows_answer),
)


def dp_of(config: Config, num_clients: int) -> dp_settings.DpSettings | None:
    """``[dp]`` resolved for a population of ``num_clients`` (delta's default, the noise
    multiplier calibrated for train.rounds when a target epsilon is given); None when the
    mechanism is "none". The casts: config.py checked the choices."""
    d = config.dp
    if d.mechanism == "none":
        return None
    spec = MECHANISMS.get_or_refuse(d.mechanism)  # its accounting (dp/mechanisms.py)
    noise_multiplier, accounting = spec.accounting(dp_asked(config), num_clients)
    return checked_settings(config, noise_multiplier, accounting)


def checked_settings(
    config: Config, noise_multiplier: float, accounting: dp_settings.Accounting
) -> dp_settings.DpSettings:
    """The resolved ``DpSettings``, refused when they cannot train (dp/settings.py)."""
    d, t = config.dp, config.train
    distributed = config.privacy.level == "full"
    a, rows = d.adaptive_clipping, d.row_selection
    adaptive = dp_settings.AdaptiveClip(a.target_quantile, a.clip_lr, a.count_share)
    settings = dp_settings.DpSettings(
        clip=d.clip,
        noise_multiplier=noise_multiplier,
        accounting=accounting,
        rows=cast(dp_settings.Rows, rows.rows),
        selection=dp_settings.RowSelection(
            rows.selection_share,
            rows.selection_threshold,
            rows.selection_bound,
            rows.selection_window,
            rows.heat_cap,
            rows.selection_max_rows,
            rows.selection_refresh,
        ),
        adaptive=adaptive if a.adaptive_clip else None,
        weights=dp_settings.DpWeights(
            d.weights.weight_cap, d.weights.weight_mean, privacy_of(config).keep
        ),
        distributed=dp_settings.Distributed(d.min_survivors) if distributed else None,
        key=dp_settings.NoiseKey(cast(dp_settings.Randomness, d.trust.randomness), t.seed),
        mechanism=d.mechanism,
    )
    for reason in dp_settings.refusals(settings):
        raise ConfigError(f"[dp] mechanism = {d.mechanism!r} cannot train here: {reason}")
    return settings


def dp_plan(config: Config) -> list[str]:
    """What ``[dp]`` will spend, without training (``fedsub dp``): the resolved settings and
    epsilon after a quarter, half, three quarters and all of train.rounds."""
    if config.dp.mechanism == "none":
        return ["[dp] mechanism = 'none': no differential privacy (epsilon is infinite)"]
    num_clients = load_data(config).num_clients
    settings = dp_of(config, num_clients)
    assert settings is not None  # the mechanism is not "none"
    rounds, accounting = config.train.rounds, settings.accounting
    lines = [
        f"clients N = {num_clients}, per round K = {config.train.clients_per_round} "
        f"(sampling {accounting.sampling}), rounds = {rounds}",
        f"noise multiplier z = {settings.noise_multiplier:.6g}, clip C = {settings.clip:g}, "
        f"delta = {accounting.delta:.3g}, accountant {accounting.accountant}, "
        f"rows {settings.rows}",
    ]
    if accounting.ftrl is not None:  # DP-FTRL (issue 50)
        pattern = accounting.ftrl
        lines.append(
            f"DP-FTRL {'BLT' if accounting.blt else 'tree'} noise, no sampling assumed: each "
            f"user at most "
            f"{pattern.most(rounds)} rounds, >= {pattern.min_separation} apart (enforced at the "
            f"cohort draw); z is the whole run's, node noise z_tree = "
            f"{settings.update_multiplier:.4g}, sensitivity {settings.ftrl_scales[1]:.4g} C"
        )
    if settings.distributed is not None:
        lines.append(
            "distributed: each client adds discrete Gaussian noise over secure aggregation, "
            f"calibrated for {settings.survivors_needed} surviving clients; accounted as zCDP "
            "without sampling amplification (docs: Differential privacy)"
        )
    elif settings.rows == "private":
        lines.append(
            f"row selection: z_sel = {settings.selection_multiplier:.4g}, update z_grad = "
            f"{settings.update_multiplier:.4g}, threshold {settings.histogram_threshold:.4g} "
            f"(contribution bound B = {settings.selection.bound:g})"
        )
    if settings.noise_multiplier > dp_accountant.Z_MAX:
        lines.append(
            f"z above {dp_accountant.Z_MAX:g} is accounted at {dp_accountant.Z_MAX:g}: the "
            "epsilons below are upper bounds"
        )
    marks = sorted({max(1, rounds * i // 4) for i in range(1, 5)})
    lines += [f"epsilon after round {r}: {settings.epsilon(r):.4f}" for r in marks]
    if settings.budget is not None:
        lines.append(f"budget: epsilon <= {settings.budget:g} (the run stops before exceeding it)")
    if settings.randomness == "seeded":
        lines.append(f"NOT A GUARANTEE: {NOT_A_GUARANTEE}")
    else:
        lines.append(
            "randomness: secret (the noise and cohorts from OS entropy drawn at the start, kept "
            "only in the run's checkpoints: never publish checkpoints/)"
        )
    return lines


def heat_privacy_of(config: Config) -> HeatPrivacy:
    """Where the server's heat comes from (``privacy.heat_source``, or the one
    ``privacy.level`` implies) and that source's settings. Under [dp] no heat exchange runs at
    any level: the mechanism's heat is its noisy contribution histogram (dp/selection.py), a
    release ε covers, and the exact heat the simulator computes for the algorithm's
    coefficients is never read (docs: Differential privacy, "privacy levels")."""
    p = config.privacy
    source = p.effective_heat_source
    if config.dp.mechanism != "none":  # FedSubAvg's heat is the mechanism's noisy histogram
        source = p.heat_source  # (config.py keeps it "exact": computed here, never used)
    return HeatPrivacy(
        source, p.secagg_group, p.sketch_eps, p.sketch_delta, p.rr_epsilon, config.train.seed
    )


def algorithm_context(
    config: Config, dataset: FederatedDataset, index: SubmodelIndex
) -> AlgorithmContext:
    """What every algorithm is built from: the data, S(k), the heat kind, K and the heat's
    source."""
    heat = cast(HeatKind, config.train.heat)  # config.py has checked it against its choices
    privacy = heat_privacy_of(config)
    if privacy.source == "randomized-response":  # the clients' coins: the run's secret
        coins = HeatCoins(cast(Randomness, config.privacy.randomness), config.train.seed)
        privacy = dataclasses.replace(privacy, coins=coins)  # settled once the processes join
    return AlgorithmContext(dataset, index, heat, config.train.clients_per_round, privacy)


class RunReport(Protocol):
    """A feature's part of a run's reports (engine/features/dp.py's ``DpReport``): metrics
    after each round (the progress line, the trackers), each algorithm's summary.json record
    (by key), summary.md's text and notes for privacy.json."""

    def round_metrics(self, round_index: int) -> dict[str, float]: ...

    def summary(self, history: Sequence[Evaluation]) -> dict[str, object]: ...

    def markdown(self) -> str: ...

    def notes(self) -> dict[str, str]: ...


Reports = tuple[RunReport, ...]


def reports_of(config: Config, schedule: Schedule) -> Reports:
    """What the run's features add to its reports, in order: [dp]'s epsilon (none without)."""
    settings = schedule.setting(dp_settings.DpSettings)
    return () if settings is None else (DpReport(settings, config.dp.trust.public_test),)


@dataclass(frozen=True)
class Setup:
    """Everything a run needs before its first round."""

    dataset: FederatedDataset
    index: SubmodelIndex
    model: Model
    context: AlgorithmContext
    evaluator: Evaluator
    schedule: Schedule
    heat_source: dict | None  # a private heat source's guarantees (None: exact heat)


def prepare(
    config: Config, dataset: FederatedDataset | None = None, model: Model | None = None
) -> Setup:
    """Load the data (or take ``dataset``), build the model (or take ``model``) and check
    both against the config, then index the clients' rows and build the algorithms' context
    and the evaluator (no output yet)."""
    if config.execution.threads:
        torch.set_num_threads(config.execution.threads)
    if dataset is None:
        dataset = load_data(config)
    model = checked_model(config, dataset, model)
    with phase("indexing the clients' rows"):
        index = SubmodelIndex.build(dataset)
    context = algorithm_context(config, dataset, index)
    heat_source, privacy = None, context.privacy  # the HeatPrivacy algorithm_context gave
    if isinstance(privacy, HeatPrivacy) and privacy.source != "exact":
        heat_source = describe(dataset, index, context.heat, privacy)
        LOG.info("heat source: %s", dumps(heat_source))
    extra = None
    if config.eval.gradient_norms:
        # computed at the first evaluation, once the heat's coins are settled (HeatCoins)
        extra = lambda params: gradient_norms(  # noqa: E731
            model, params, dataset.train, heat_coefficients(context)
        )
    l2 = config.train.client_step.weight_decay / 2 if config.eval.regularized_loss else 0.0
    evaluator = Evaluator.build(
        model, dataset, config.eval.train_loss_samples, config.data.seed, extra, l2
    )
    schedule = schedule_of(config, dataset.num_clients)
    return Setup(dataset, index, model, context, evaluator, schedule, heat_source)


def settle_heat_coins(setup: Setup, resumed: Sequence[StageStates]) -> None:
    """The randomized-response heat's key settled once the processes have joined, before any
    algorithm computes the heat (``HeatCoins.settle``: the secret of the checkpoints in
    ``resumed``, or a fresh one), and the heat source's record told where its coins came from
    (a resumed old checkpoint continues seeded). Nothing without such a heat."""
    coins = setup.context.privacy.coins
    if not isinstance(coins, HeatCoins):
        return
    coins.settle(resumed)
    if setup.heat_source is not None:
        setup.heat_source.update(coins_record(coins))
