"""Each algorithm is a choice of pieces: an aggregation (with the scheme's sampling and
weighting), client transforms (fedsub.client.transforms) and a server optimizer. The named
algorithms below are presets of the same pieces a user composes in ``[algorithms.<name>]``
(fedsub.algorithms.compose); the round loop never branches on an algorithm's name.

Names may carry a scheme of Li et al.: ``fedavg@scheme2``, ``fedprox@original``, ...

- ``fedavg``: sample-weighted mean of the round's deltas, server SGD(lr 1).
- ``fedsubavg``: the same mean, each touched row scaled by its heat coefficient (Algorithm 1
  of seed 001; with heat = "clients" the mean is uniform over the K clients, exactly as there).
- ``fedprox``: FedAvg with ``(mu/2)||x - x_global||^2`` in the client's loss.
- ``scaffold``: Karimireddy et al.'s SCAFFOLD (option II control variates) exactly: the
  correction c - c_i on every coordinate, so every client trains the whole model and keeps a
  full-model c_i (N x M floats for N clients that took part; K x M down and up per round).
- ``scaffold-submodel``: fedsub's submodel form: c - c_i on S(k) and the dense layers only.
- ``scaffold-approx``: the FedSubAvg paper's server-side approximation (appendix D.2).
- ``fedadam`` / ``fedadagrad`` / ``fedyogi``: Reddi et al.'s adaptive server optimizers
  (Algorithm 2, written out in fedsub.algorithms.adaptive: no bias correction, v_0 = tau^2,
  FedAdagrad with the b1 first moment) over the full model (every row's moments decay and
  every row moves, every round).
- ``fedadam-lazy`` / ``fedadagrad-lazy`` / ``fedyogi-lazy``: fedsub's lazy variant, touched
  rows only (also ``lazy = true`` on the names above).
- ``fedsubavg-adam`` / ``fedsubavg-adagrad`` / ``fedsubavg-yogi``: FedSubAvg's heat-coefficient
  aggregate, then the adaptive server optimizer.
- ``central-sgd``: SGD on the pooled data, I steps of batch K * B per round (seed 001, 5.1).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from fedsub import plugins
from fedsub.algorithms.adaptive import AdaptiveKind, AdaptiveRule, AdaptiveServer
from fedsub.algorithms.aggregation import Aggregation
from fedsub.algorithms.aggregation_rules import (
    AggregationInputs,
    AggregationRule,
    rule_class,
)
from fedsub.algorithms.runtimes import Capability, Runtime
from fedsub.algorithms.schemes import SCHEMES, Scheme
from fedsub.algorithms.server_optimizer import ServerMomentum, ServerOptimizer, ServerSGD
from fedsub.algorithms.weighting import WEIGHTINGS
from fedsub.client.transforms import TRANSFORMS, PullsWholeModel, transform_names
from fedsub.client.work import round_chain
from fedsub.data.federated import Population
from fedsub.distributed import Processes
from fedsub.errors import ConfigError
from fedsub.stateful import Stateful
from fedsub.submodel import heat as heat_lib
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params


class HeatSource(Protocol):
    """Where FedSubAvg's heat comes from (``privacy.heat_source``: privacy/heat_sources.py's
    ``HeatPrivacy``, which runs/run_setup.py gives; ``ExactHeat`` by default): its name, the
    heat of every row as it reveals it (``keep``: of those rows of each table only), and the
    coins it keeps as a checkpoint stage (randomized response's key; None: none)."""

    @property
    def source(self) -> str: ...

    @property
    def coins(self) -> Stateful | None: ...

    def estimate(
        self,
        dataset: Population,
        index: SubmodelIndex,
        kind: heat_lib.HeatKind,
        keep: Mapping[str, range] | None = None,
    ) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class ExactHeat:
    """The heat in the clear (``privacy.heat_source = "exact"``: the server sees every S(k))."""

    source: str = "exact"
    coins: None = None

    def estimate(
        self,
        dataset: Population,
        index: SubmodelIndex,
        kind: heat_lib.HeatKind,
        keep: Mapping[str, range] | None = None,
    ) -> dict[str, np.ndarray]:
        counts, tables = dataset.sample_counts(), dataset.table_rows
        kept = {t: range(n) if keep is None else keep[t] for t, n in tables.items()}
        return {
            t: heat_lib.heat(index.rows[t], n, counts, kind, kept[t]) for t, n in tables.items()
        }


class MeasuredHeat(Protocol):
    """Heat measured by a private source over a network (privacy/heat_vectors.py's
    ``MeasuredHeat``): per table the heat of every row (float64) as the source revealed it,
    with the population's totals the aggregation needs."""

    @property
    def source(self) -> str: ...

    @property
    def heat(self) -> dict[str, np.ndarray]: ...

    @property
    def total_samples(self) -> float: ...

    @property
    def num_clients(self) -> int: ...

    @property
    def lowest_weight(self) -> float: ...


@dataclass(frozen=True)
class AlgorithmContext:
    """What building an algorithm may look at: client sizes and index sets, heat definition,
    cohort size. ``dataset`` is the federation as the server knows it (a ``FederatedDataset``
    in simulation, the clients' reports on Flower); only ``index.rows`` is read.
    ``measured``: heat already measured by a private source over a network (Flower's heat
    exchange); then neither index sets nor per-client sample counts are read for the heat,
    nor for the population totals the aggregation needs."""

    dataset: Population
    index: SubmodelIndex
    heat: heat_lib.HeatKind
    clients_per_round: int = 1
    privacy: HeatSource = field(default_factory=ExactHeat)
    measured: MeasuredHeat | None = None
    # row-sharded tables (fedsub/sharding): the heat coefficients are this process's rows'
    # (``Processes.share`` of each table's rows); None: every row's
    shard: Processes | None = None
    # heat_coefficients' result, computed once: a private heat source runs a whole protocol
    _coefficients: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def sharded(self, processes: Processes) -> AlgorithmContext:
        """This context for ``processes``' share of every table's rows (coefficients not yet
        computed: a process computes and keeps only its rows')."""
        return dataclasses.replace(self, shard=processes, _coefficients={})


@dataclass(frozen=True)
class Algorithm:
    name: str
    scheme: Scheme
    aggregation: Aggregation
    make_server: Callable[[Params], ServerOptimizer]
    client: tuple[Any, ...] = ()  # client transforms (fedsub.client.transforms), e.g. Prox
    lr: float | None = None  # overrides train.lr for this algorithm
    central: bool = False
    # the key of the randomized-response heat's coins its context's heat came from (a
    # checkpoint stage in secret mode: engine/features/private.py's HEAT_SECRET); None: no
    # such heat
    heat_coins: Stateful | None = field(default=None, compare=False, repr=False)

    @property
    def control_variates(self) -> bool:
        """SCAFFOLD's correction keeps c_i on the client: the server keeps control variates."""
        return any(piece.keeps_client_state for piece in self.client)

    @property
    def whole_model(self) -> bool:
        """Whether each client trains the whole model, not its submodel (exact SCAFFOLD)."""
        return any(isinstance(p, PullsWholeModel) and p.whole_model for p in self.client)


# Options of each algorithm, set in [algorithms.<name>] (every algorithm also takes ``lr``).
@dataclass(frozen=True)
class CommonOptions:
    lr: float | None = field(default=None, metadata={"min_exclusive": 0.0})
    """This algorithm's client learning rate (unset: train.lr)."""


@dataclass(frozen=True)
class FedProxOptions(CommonOptions):
    mu: float = field(default=0.01, metadata={"min": 0.0})
    """The proximal term's weight: (mu / 2) ||x - x_global||^2."""


@dataclass(frozen=True)
class ServerLrOptions(CommonOptions):
    server_lr: float = field(default=1.0, metadata={"min_exclusive": 0.0})
    """The server's learning rate."""


@dataclass(frozen=True)
class LazyAdaptiveOptions(CommonOptions):
    """Options of the ``-lazy`` names (always lazy). Adagrad ignores beta2."""

    server_lr: float = field(default=0.1, metadata={"min_exclusive": 0.0})
    """The server optimizer's learning rate (eta)."""
    beta1: float = field(default=0.9, metadata={"min": 0.0, "max": 1.0})
    """The first moment's decay (Reddi et al.'s m_t)."""
    beta2: float = field(default=0.99, metadata={"min": 0.0, "max": 1.0})
    """The second moment's decay (Adam, Yogi; Adagrad ignores it)."""
    tau: float = field(default=1e-3, metadata={"min_exclusive": 0.0})
    """The adaptivity (v starts at tau^2; the step divides by sqrt(v) + tau)."""


@dataclass(frozen=True)
class AdaptiveOptions(LazyAdaptiveOptions):
    lazy: bool = False
    """true: touched rows only (fedsub's variant), not Reddi et al.'s."""


def heat_coefficients(context: AlgorithmContext) -> dict[str, torch.Tensor]:
    """FedSubAvg's per-row coefficients for every table, computed once over all N clients,
    from the heat the configured source reveals (``privacy.heat_source``).

    Estimated heat (sketch, randomized response) is clipped to [smallest client weight,
    total] so that noise can neither divide by zero nor shrink a row below plain averaging.
    Computed on first use and kept on the context; with ``context.shard``, of that process's
    rows only (the same values as the whole table's at those rows)."""
    if context._coefficients:
        return context._coefficients
    measured, shard = context.measured, context.shard
    keep = None
    if shard is not None:
        keep = {t: shard.share(n) for t, n in context.dataset.table_rows.items()}
    if measured is not None:
        source, estimates = measured.source, measured.heat
        if keep is not None:
            estimates = {t: h[keep[t].start : keep[t].stop] for t, h in estimates.items()}
        total = measured.total_samples if context.heat == "samples" else float(measured.num_clients)
        lowest = measured.lowest_weight if context.heat == "samples" else 1.0
    else:
        counts = context.dataset.sample_counts()
        total = float(counts.sum()) if context.heat == "samples" else float(len(counts))
        lowest = float(counts.min()) if context.heat == "samples" else 1.0
        source = context.privacy.source
        estimates = context.privacy.estimate(context.dataset, context.index, context.heat, keep)
    coefficients = {}
    for table, row_heat in estimates.items():
        if source in ("sketch", "randomized-response"):
            row_heat = np.clip(row_heat, lowest, total)
        coefficients[table] = torch.from_numpy(heat_lib.coefficients(row_heat, total))
    context._coefficients.update(coefficients)
    return context._coefficients


# --- the pieces ----------------------------------------------------------------------------
def aggregation_inputs(context: AlgorithmContext) -> AggregationInputs:
    """What an aggregation rule reads of the context: the population's totals (measured
    with the heat on a network, else counted), the heat kind, the heat coefficients."""
    if context.measured is not None:  # the population's totals came with the heat
        population, clients = context.measured.total_samples, context.measured.num_clients
    else:
        counts = context.dataset.sample_counts()
        population, clients = float(counts.sum()), len(counts)
    return AggregationInputs(
        population, clients, context.heat, functools.partial(heat_coefficients, context)
    )


@dataclass(frozen=True)
class ServerSgdOptions:
    server_lr: float = field(default=1.0, metadata={"min_exclusive": 0.0})
    """The server's learning rate."""


@dataclass(frozen=True)
class ServerMomentumOptions(ServerSgdOptions):
    server_momentum: float | None = field(default=None, metadata={"min": 0.0, "max": 1.0})
    """Server momentum; unset: (N - K) / N, the FedSubAvg paper's server-side SCAFFOLD
    approximation."""


@dataclass(frozen=True)
class ServerAdagradOptions:
    server_lr: float = field(default=0.1, metadata={"min_exclusive": 0.0})
    """The server optimizer's learning rate (eta)."""
    tau: float = field(default=1e-3, metadata={"min_exclusive": 0.0})
    """The adaptivity (v starts at tau^2; the step divides by sqrt(v) + tau)."""
    lazy: bool = False
    """true: touched rows only (fedsub's variant), not Reddi et al.'s."""
    beta1: float = field(default=0.9, metadata={"min": 0.0, "max": 1.0})
    """The first moment's decay (Reddi et al.'s m_t)."""


@dataclass(frozen=True)
class ServerAdaptiveOptions(ServerAdagradOptions):
    beta2: float = field(default=0.99, metadata={"min": 0.0, "max": 1.0})
    """The second moment's decay."""


def _adaptive_server(kind: AdaptiveKind, o: Any, lazy: bool) -> Callable[[Params], ServerOptimizer]:
    """Reddi et al.'s rule ``kind`` with the options ``o`` (Adagrad has no beta2)."""
    rule = AdaptiveRule(kind, o.server_lr, o.beta1, getattr(o, "beta2", 0.99), o.tau)
    return lambda p: AdaptiveServer(p, rule, lazy=lazy)


def _adaptive_piece(
    kind: AdaptiveKind, c: AlgorithmContext, o: Any
) -> Callable[[Params], ServerOptimizer]:
    return _adaptive_server(kind, o, o.lazy)


def _server_momentum(c: AlgorithmContext, o: Any) -> Callable[[Params], ServerOptimizer]:
    n = c.dataset.num_clients
    beta = o.server_momentum if o.server_momentum is not None else (n - c.clients_per_round) / n
    return lambda p: ServerMomentum(p, beta=beta, lr=o.server_lr)


_ADAPTIVE_NAMES: tuple[tuple[AdaptiveKind, str], ...] = (
    ("adam", "Adam"),
    ("adagrad", "Adagrad"),
    ("yogi", "Yogi"),
)


@dataclass(frozen=True)
class ServerPiece:
    """A server optimizer: ``build(context, options)`` -> a factory of the optimizer for the
    initial parameters; ``options``: the dataclass of its ``[algorithms.<name>]`` keys;
    ``name``: needed when a plugin gives it (built-ins are named below)."""

    description: str
    options: type
    build: Callable[[AlgorithmContext, Any], Callable[[Params], ServerOptimizer]]
    # whether, with these options, a step touches only the round's rows and their state
    # (execution.table_placement = "host" needs it; engine/placement.py)
    row_local: Callable[[Any], bool] = lambda options: False
    name: str = ""


_BUILT_IN_SERVERS: dict[str, ServerPiece] = {
    "sgd": ServerPiece(
        "X += server_lr * aggregate (1: plain averaging)",
        ServerSgdOptions,
        lambda c, o: lambda p: ServerSGD(o.server_lr),
        row_local=lambda options: True,
    ),
    "momentum": ServerPiece(
        "heavy-ball momentum on the aggregate, over the full model (server_momentum "
        "unset: (N - K) / N, the FedSubAvg paper's server-side SCAFFOLD approximation)",
        ServerMomentumOptions,
        _server_momentum,
    ),
    **{
        kind: ServerPiece(
            f"Reddi et al.'s Fed{name} (Algorithm 2) on the aggregate, over the full model "
            "(lazy: touched rows only, fedsub's)",
            ServerAdagradOptions if kind == "adagrad" else ServerAdaptiveOptions,
            functools.partial(_adaptive_piece, kind),
            row_local=lambda options: bool(options.lazy),
        )
        for kind, name in _ADAPTIVE_NAMES
    },
}

SERVERS: plugins.Registry[ServerPiece] = plugins.Registry(
    "server optimizer", _BUILT_IN_SERVERS, ServerPiece, lambda piece: piece.name
)

# Set by [train] keys (clip_norm, weight_decay, momentum) or always there (the SGD step).
_FROM_TRAIN = ("clip", "weight-decay", "momentum", "sgd")


def client_piece_names() -> list[str]:
    """Client transforms an algorithm may name in ``client = [...]``."""
    return [n for n in transform_names() if n not in _FROM_TRAIN]


# --- algorithms as pieces: the presets -----------------------------------------------------
@dataclass(frozen=True)
class Recipe:
    """Which pieces an algorithm is made of (names in AGGREGATIONS, client transforms, SERVERS)."""

    aggregation: str = "fedavg"
    client: tuple[str, ...] = ()
    server: str = "sgd"

    def describe(self) -> str:
        client = ", ".join(self.client) or "-"
        return f"aggregation {self.aggregation}, client [{client}], server {self.server}"


@dataclass(frozen=True)
class Preset:
    recipe: Recipe
    options: type  # the options of [algorithms.<preset>]
    fixed: tuple[tuple[str, Any], ...] = ()  # option values the preset fixes


@dataclass(frozen=True)
class Composed:
    """A user's algorithm from ``[algorithms.<name>]``: its pieces and their options' values
    (fedsub.algorithms.compose builds it from the config)."""

    recipe: Recipe
    options: Any


PRESETS: dict[str, Preset] = {
    "fedavg": Preset(Recipe("fedavg"), CommonOptions),
    "fedsubavg": Preset(Recipe("fedsubavg"), CommonOptions),
    "fedprox": Preset(Recipe("fedavg", ("prox",)), FedProxOptions),
    "scaffold": Preset(Recipe("fedavg", ("scaffold",)), ServerLrOptions, (("whole_model", True),)),
    "scaffold-submodel": Preset(
        Recipe("fedavg", ("scaffold",)), ServerLrOptions, (("whole_model", False),)
    ),
    "scaffold-approx": Preset(Recipe("fedavg", (), "momentum"), ServerLrOptions),
    **{
        name: preset
        for kind in ("adam", "adagrad", "yogi")
        for name, preset in (
            (f"fed{kind}", Preset(Recipe("fedavg", (), kind), AdaptiveOptions)),
            (
                f"fed{kind}-lazy",
                Preset(Recipe("fedavg", (), kind), LazyAdaptiveOptions, (("lazy", True),)),
            ),
            (f"fedsubavg-{kind}", Preset(Recipe("fedsubavg", (), kind), AdaptiveOptions)),
        )
    },
    "central-sgd": Preset(Recipe("central"), CommonOptions),
}


def algorithm_names() -> list[str]:
    return sorted(PRESETS)


def options_class(base: str) -> type:
    return PRESETS[base].options


def split_name(name: str, defined: Collection[str] = ()) -> tuple[str, str]:
    """``"fedavg@scheme2"`` -> ("fedavg", "scheme2"); raises ValueError naming the choices.
    ``defined``: the names of the config's own algorithms."""
    base, _, scheme = name.partition("@")
    if base not in PRESETS and base not in defined:
        choices = ", ".join([*algorithm_names(), *sorted(defined)])
        raise ValueError(
            f"unknown algorithm {base!r}; choose from {choices}, or compose one in "
            f"[algorithms.{base}] with aggregation / client / server keys"
        )
    scheme = scheme or "default"
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose from {', '.join(SCHEMES)}")
    return base, scheme


def check_combination(
    name: str,
    recipe: Recipe,
    *,
    scheme: str = "default",
    momentum: float = 0.0,
    masking: str = "none",
    runtime: Runtime | None = None,
    privacy: str = "none",
    dp: str = "none",
    dp_rows: str = "private",
) -> None:
    """The one place where pieces that cannot work together are refused (ConfigError naming
    the pieces), from their declared properties: an aggregation rule that pools the data
    samples no clients (no scheme, no masking, no piece with per-client state, which has no
    other client to correct for there); a client piece that keeps per-client state across
    rounds (SCAFFOLD's c_i) cannot run on width slices; client pieces must form one chain
    (fedsub.client.work.round_chain); private download and secure aggregation (``privacy``)
    hide each client's update, which per-client state is built from, and compute only a rule
    whose combine step is a weighted sum (``secure_sum_ok``); weights that do not sum to 1
    by design (Scheme II's ``(N/K) p_k``, the original scheme's ``p_k``) cannot run on width
    slices, whose average divides by the weights' sum. ``runtime``: where it will run (its
    declared capabilities; None: the in-process engine, which has them all)."""
    rule = rule_class(recipe.aggregation)
    _check_weights_and_sums(name, recipe, scheme, masking, privacy)
    stateful = _checked_client_pieces(name, recipe, scheme, momentum, privacy)
    # (the runtime capability each property needs, why): for masking's refusal and the runtime's
    needs: list[tuple[Capability, str]] = [
        ("client-state", f"its client piece {n!r} keeps per-client state across rounds")
        for n in stateful
    ]
    if rule.pools_data:
        needs.append(
            ("pooled-data", f"its aggregation {recipe.aggregation!r} pools the data (no clients)")
        )
    if needs and masking != "none":
        raise ConfigError(
            f"masking.scheme = {masking!r} cannot be combined with algorithm {name!r}: "
            f"{'; '.join(why for _, why in needs)}. Masked training needs per-client state-free "
            "pieces"
        )
    if dp != "none":
        check_dp_combination(name, recipe, scheme, dp_rows, [why for _, why in needs], privacy)
    if runtime is not None:
        _require_capabilities(runtime, name, needs, masking, privacy, dp)


def _check_weights_and_sums(
    name: str, recipe: Recipe, scheme: str, masking: str, privacy: str
) -> None:
    """Masking's slice average and the private rounds' sums compute a weighted sum with
    weights that sum to 1: refuse schemes and rules that are not one."""
    rule = rule_class(recipe.aggregation)
    weighting = SCHEMES[scheme].weighting
    unnormalized = (
        not WEIGHTINGS[weighting].sums_to_one if weighting else not rule.weights_sum_to_one
    )
    if masking != "none" and unnormalized:
        raise ConfigError(
            f"masking.scheme = {masking!r} cannot be combined with algorithm {name!r}: scheme "
            f"{scheme!r} weights clients by weights that do not sum to 1 on purpose, and "
            "sub-model masking's slice average divides by their sum, which would turn it "
            "into a plain p_k-weighted mean. Use the default scheme, scheme1 or "
            "transformed-scheme2 with masking.scheme"
        )
    not_a_sum = (
        f"its aggregation rule {recipe.aggregation!r} does not combine by a weighted sum "
        "(secure_sum_ok = False)"
    )
    if masking != "none" and not rule.secure_sum_ok:
        raise ConfigError(
            f"masking.scheme = {masking!r} cannot be combined with algorithm {name!r}: "
            f"{not_a_sum}, which sub-model masking's slice average computes"
        )
    if privacy in ("download", "full") and not rule.secure_sum_ok:
        raise ConfigError(
            f"privacy.level = {privacy!r} cannot be combined with algorithm {name!r}: "
            f"{not_a_sum}, which private download and secure aggregation compute"
        )


def _checked_client_pieces(
    name: str, recipe: Recipe, scheme: str, momentum: float, privacy: str
) -> list[str]:
    """The recipe's client pieces checked as one chain, with what pooling and the private
    rounds rule out; the names of those that keep per-client state."""
    base = name.partition("@")[0]
    pooled = rule_class(recipe.aggregation).pools_data
    if pooled and scheme != "default":
        raise ConfigError(
            f"{base} samples no clients (its aggregation {recipe.aggregation!r} pools the "
            "data), so it takes no scheme"
        )
    pieces = [TRANSFORMS[n]() for n in recipe.client]
    try:
        round_chain(pieces, momentum=momentum)
    except ValueError as error:
        raise ConfigError(f"algorithm {name!r}: {error}") from None
    stateful = [p.name for p in pieces if p.keeps_client_state]
    if stateful and pooled:
        raise ConfigError(
            f"algorithm {name!r}: its client piece {stateful[0]!r} keeps per-client state to "
            f"correct each client's drift from the others, but its aggregation "
            f"{recipe.aggregation!r} pools the data into one client, where the piece cannot "
            "act; drop the piece, or choose aggregation fedavg or fedsubavg"
        )
    if stateful and privacy in ("download", "full"):
        raise ConfigError(
            f"privacy.level = {privacy!r} cannot be combined with algorithm {name!r}: its "
            f"client piece {stateful[0]!r} keeps per-client state built from each client's "
            "own update, which private download and secure aggregation keep from the server"
        )
    return stateful


def _require_capabilities(
    runtime: Runtime,
    name: str,
    needs: list[tuple[Capability, str]],
    masking: str,
    privacy: str,
    dp: str,
) -> None:
    """Refuse what ``runtime`` does not declare (its hint says why and what to do)."""
    if dp != "none":
        runtime.require("differential-privacy", f"[dp] mechanism = {dp!r}")
    for capability, why in needs:
        runtime.require(capability, f"algorithm {name!r}", why)
    if masking != "none":
        runtime.require("masking", f"masking.scheme = {masking!r}")
    if privacy in ("download", "full"):
        runtime.require("private-rounds", f"privacy.level = {privacy!r}")


def check_dp_combination(
    name: str, recipe: Recipe, scheme: str, rows: str, leaks: list[str], privacy: str = "none"
) -> None:
    """Under user-level differential privacy ([dp] mechanism = gaussian) the round's sum must
    have sensitivity C and nothing else may carry a client's data to the server: refuse
    per-client state (SCAFFOLD's c_i, built from the unclipped update and sent in the clear)
    and pooled data (``leaks``), a combine step that is not a weighted sum, a scheme whose
    sampling or weights the accountant and the fixed denominator do not describe, and FedSubAvg's
    heat without the private histogram it is estimated from (rows = "all", or distributed DP
    at privacy "full", where no party sees the histogram)."""
    rule = rule_class(recipe.aggregation)
    what = f"[dp] mechanism = 'gaussian' cannot be combined with algorithm {name!r}"
    if rule.needs_heat and privacy == "full":
        raise ConfigError(
            f"{what} at privacy.level = 'full': its heat coefficients would come from the exact "
            "secure heat (the server learns every row's exact count, outside epsilon), and "
            "distributed DP has no noisy histogram to estimate them from; use an algorithm "
            "without heat coefficients (fedavg)"
        )
    if leaks:
        raise ConfigError(
            f"{what}: {'; '.join(leaks)}, which reaches the server outside the Gaussian "
            "mechanism (no differential privacy for it)"
        )
    if not rule.secure_sum_ok:
        raise ConfigError(
            f"{what}: its aggregation rule {recipe.aggregation!r} does not combine by a "
            "weighted sum, whose sensitivity the mechanism bounds"
        )
    if scheme != "default":
        raise ConfigError(
            f"{what}: scheme {scheme!r} samples or weights clients by their sample counts; "
            "the accountant assumes uniform (or Poisson) sampling and the mechanism weighs "
            "clients uniformly or by [dp] weight_cap. Use the default scheme"
        )
    if rule.needs_heat and rows != "private":
        raise ConfigError(
            f"{what} and [dp] rows = {rows!r}: its heat coefficients would come from the exact "
            "heat, sent in the clear; under DP they are estimated from the private row "
            "selection's noisy histogram, which rows = 'private' computes"
        )


def _piece_options(cls: type, values: Any, fixed: dict[str, Any]) -> Any:
    """``cls`` (a piece's options, or a client transform) from an algorithm's option values:
    a value the preset fixes, else the algorithm's option, else the piece's default."""
    chosen = {}
    for f in dataclasses.fields(cls):
        if f.name in fixed:
            chosen[f.name] = fixed[f.name]
        elif hasattr(values, f.name):
            chosen[f.name] = getattr(values, f.name)
    return cls(**chosen)


def _pieces_of(name: str, options: Any) -> tuple[str, Recipe, Any, dict[str, Any]]:
    """Algorithm ``name``'s scheme, pieces, option values and the values its preset fixes."""
    fixed: dict[str, Any] = {}
    if isinstance(options, Composed):
        _, scheme_name = split_name(name, (name.partition("@")[0],))
        recipe, values = options.recipe, options.options
    else:
        base, scheme_name = split_name(name)
        preset = PRESETS[base]
        recipe, fixed = preset.recipe, dict(preset.fixed)
        values = options if options is not None else preset.options()
    return scheme_name, recipe, values, fixed


def row_local_reasons(name: str, options: Any) -> list[str]:
    """Why algorithm ``name`` (with ``options``) cannot step the tables row by row where the
    rows live (host placement, row sharding); empty when it can: its server piece is row-local
    with these options, it keeps no control variates beside every row, and it combines by a
    weighted sum (the per-row coefficients act after the sum)."""
    _, recipe, values, fixed = _pieces_of(name, options)
    server = SERVERS[recipe.server]
    reasons = []
    if not server.row_local(_piece_options(server.options, values, fixed)):
        lazy = "lazy" in {f.name for f in dataclasses.fields(server.options)}
        hint = " (lazy = true, or its -lazy preset, is row-local)" if lazy else ""
        reasons.append(f"its server piece {recipe.server!r} updates every row every round{hint}")
    stateful = [p.name for p in (TRANSFORMS[n]() for n in recipe.client) if p.keeps_client_state]
    if stateful:
        reasons.append(
            f"its client piece {stateful[0]!r} keeps control variates as large as the tables"
        )
    if not rule_class(recipe.aggregation).secure_sum_ok:  # coefficients act after the sum
        reasons.append(
            f"its aggregation rule {recipe.aggregation!r} does not combine by a weighted sum, "
            "and the per-row coefficients are applied to the weighted sum where the rows live"
        )
    return reasons


def check_table_placement(name: str, options: Any, table_placement: str) -> None:
    """``execution.table_placement = "host"`` moves only a round's rows to the device: refuse
    (ConfigError naming the key) an algorithm with ``row_local_reasons``."""
    if table_placement != "host":
        return
    reasons = row_local_reasons(name, options)
    if reasons:
        raise ConfigError(
            f'execution.table_placement = "host" cannot run algorithm {name!r}: '
            f"{'; '.join(reasons)}. Only the cohort's rows travel to the device, so the server "
            'step must touch only them; use execution.table_placement = "device"'
        )


def check_table_sharding(name: str, options: Any, table_sharding: str) -> None:
    """``execution.table_sharding = "rows"``: each process steps only the rows it owns, so refuse
    (ConfigError naming the key) an algorithm with ``row_local_reasons``, Li et al.'s Scheme II
    (its model average rescales every row every round) and CentralSGD (one pooled client)."""
    if table_sharding != "rows":
        return
    scheme, recipe, _, _ = _pieces_of(name, options)
    reasons = row_local_reasons(name, options)
    if SCHEMES[scheme].model_average:
        reasons.append(f"its scheme {scheme!r} averages models, rescaling every row every round")
    if rule_class(recipe.aggregation).pools_data:
        reasons.append("it trains one client holding every sample (no cohort to split)")
    if reasons:
        raise ConfigError(
            f'execution.table_sharding = "rows" cannot run algorithm {name!r}: '
            f"{'; '.join(reasons)}. Each process steps only the rows it owns, so the server "
            'step must be row-local; use execution.table_sharding = "none"'
        )


def build_algorithm(name: str, context: AlgorithmContext, options: Any = None) -> Algorithm:
    """The algorithm ``name`` (a preset, or with ``Composed`` options a user's composition)."""
    scheme_name, recipe, values, fixed = _pieces_of(name, options)
    check_combination(name, recipe, scheme=scheme_name)
    scheme = SCHEMES[scheme_name]
    rule: AggregationRule = _piece_options(rule_class(recipe.aggregation), values, fixed)
    server = SERVERS[recipe.server]
    return Algorithm(
        name=name,
        scheme=scheme,
        aggregation=rule.build(aggregation_inputs(context), scheme),
        make_server=server.build(context, _piece_options(server.options, values, fixed)),
        client=tuple(_piece_options(TRANSFORMS[n], values, fixed) for n in recipe.client),
        lr=values.lr,
        central=rule.pools_data,
        heat_coins=context.privacy.coins,
    )
