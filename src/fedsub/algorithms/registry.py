"""Each algorithm is a choice of the round's stages: sampling and weighting (a scheme), the
local rule (FedProx's mu), control variates, the aggregation's row coefficients, and the
server optimizer. The round loop never branches on an algorithm's name.

Names may carry a scheme of Li et al.: ``fedavg@scheme2``, ``fedprox@original``, ...

- ``fedavg``: sample-weighted mean of the round's deltas, server SGD(lr 1).
- ``fedsubavg``: the same mean, each touched row scaled by its heat coefficient (Algorithm 1
  of seed 001; with heat = "clients" the mean is uniform over the K clients, exactly as there).
- ``fedprox``: FedAvg with ``(mu/2)||x - x_global||^2`` in the client's loss.
- ``scaffold``: exact SCAFFOLD (option II control variates), server lr ``server_lr``.
- ``scaffold-approx``: the FedSubAvg paper's server-side approximation (appendix D.2).
- ``fedadam`` / ``fedadagrad`` / ``fedyogi``: Reddi et al.'s adaptive server optimizers over
  the full model (every row's moments decay and every row moves, every round).
- ``fedadam-lazy`` / ``fedadagrad-lazy`` / ``fedyogi-lazy``: fedsub's lazy variant, touched
  rows only (also ``lazy = true`` on the names above).
- ``fedsubavg-adam`` / ``fedsubavg-adagrad`` / ``fedsubavg-yogi``: FedSubAvg's heat-coefficient
  aggregate, then the adaptive server optimizer (presets until stages compose freely).
- ``central-sgd``: SGD on the pooled data, I steps of batch K * B per round (seed 001, 5.1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedsub.algorithms.aggregation import Aggregation
from fedsub.algorithms.schemes import SCHEMES, Scheme
from fedsub.algorithms.server_optimizer import (
    LazyTorchServerOptimizer,
    ServerMomentum,
    ServerOptimizer,
    ServerSGD,
    ServerYogi,
    TorchServerOptimizer,
)
from fedsub.client.transforms import Prox, ScaffoldCorrection
from fedsub.data.federated import Population
from fedsub.privacy.heat_sources import HeatPrivacy, estimate_heat
from fedsub.submodel import heat as heat_lib
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params


@dataclass(frozen=True)
class AlgorithmContext:
    """What building an algorithm may look at: client sizes and index sets, heat definition,
    cohort size. ``dataset`` is the federation as the server knows it (a ``FederatedDataset``
    in simulation, the clients' reports on Flower); only ``index.rows`` is read."""

    dataset: Population
    index: SubmodelIndex
    heat: heat_lib.HeatKind
    clients_per_round: int = 1
    privacy: HeatPrivacy = field(default_factory=HeatPrivacy)
    # heat_coefficients' result, computed once: a private heat source runs a whole protocol
    _coefficients: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class Algorithm:
    name: str
    scheme: Scheme
    aggregation: Aggregation
    make_server: Callable[[Params], ServerOptimizer]
    client: tuple[Any, ...] = ()  # client transforms (fedsub.client.transforms), e.g. Prox
    lr: float | None = None  # overrides train.lr for this algorithm
    central: bool = False

    @property
    def control_variates(self) -> bool:
        """SCAFFOLD's correction keeps c_i on the client: the server keeps control variates."""
        return any(piece.keeps_client_state for piece in self.client)


# Options of each algorithm, set in [algorithms.<name>] (every algorithm also takes ``lr``).
@dataclass(frozen=True)
class CommonOptions:
    lr: float | None = field(default=None, metadata={"min_exclusive": 0.0})


@dataclass(frozen=True)
class FedProxOptions(CommonOptions):
    mu: float = field(default=0.01, metadata={"min": 0.0})


@dataclass(frozen=True)
class ServerLrOptions(CommonOptions):
    server_lr: float = field(default=1.0, metadata={"min_exclusive": 0.0})


@dataclass(frozen=True)
class LazyAdaptiveOptions(CommonOptions):
    """Options of the ``-lazy`` names (always lazy). Adagrad ignores beta1 and beta2."""

    server_lr: float = field(default=0.1, metadata={"min_exclusive": 0.0})
    beta1: float = field(default=0.9, metadata={"min": 0.0, "max": 1.0})
    beta2: float = field(default=0.99, metadata={"min": 0.0, "max": 1.0})
    tau: float = field(default=1e-3, metadata={"min_exclusive": 0.0})


@dataclass(frozen=True)
class AdaptiveOptions(LazyAdaptiveOptions):
    lazy: bool = False  # true: touched rows only (fedsub's variant), not Reddi et al.'s


def heat_coefficients(context: AlgorithmContext) -> dict[str, torch.Tensor]:
    """FedSubAvg's per-row coefficients for every table, computed once over all N clients,
    from the heat the configured source reveals (``train.heat_source``).

    Estimated heat (sketch, randomized response) is clipped to [smallest client weight,
    total] so that noise can neither divide by zero nor shrink a row below plain averaging.
    Computed on first use and kept on the context."""
    if context._coefficients:
        return context._coefficients
    counts = context.dataset.sample_counts()
    total = float(counts.sum()) if context.heat == "samples" else float(len(counts))
    lowest = float(counts.min()) if context.heat == "samples" else 1.0
    estimates = estimate_heat(context.dataset, context.index, context.heat, context.privacy)
    coefficients = {}
    for table, row_heat in estimates.items():
        if context.privacy.source in ("sketch", "randomized-response"):
            row_heat = np.clip(row_heat, lowest, total)
        coefficients[table] = torch.from_numpy(heat_lib.coefficients(row_heat, total))
    context._coefficients.update(coefficients)
    return context._coefficients


Builder = Callable[[AlgorithmContext, Scheme, Any], dict[str, Any]]


def _aggregation(context: AlgorithmContext, scheme: Scheme, weighting: str = "samples", **kw):
    counts = context.dataset.sample_counts()
    return Aggregation(
        scheme.weighting or weighting,  # type: ignore[arg-type]
        population_weight=float(counts.sum()),
        num_clients=len(counts),
        **kw,
    )


def _sgd(_: Params) -> ServerOptimizer:
    return ServerSGD()


def _adaptive_server(kind: str, o: Any, lazy: bool) -> Callable[[Params], ServerOptimizer]:
    if kind == "yogi":
        return lambda p: ServerYogi(p, o.server_lr, o.beta1, o.beta2, o.tau, lazy=lazy)
    optimizer = LazyTorchServerOptimizer if lazy else TorchServerOptimizer
    return lambda p: optimizer(kind, p, o.server_lr, o.beta1, o.beta2, o.tau)  # type: ignore[arg-type]


def _adaptive(kind: str, heat: bool, lazy: bool | None) -> Builder:
    """An adaptive server optimizer after FedAvg's (or, with ``heat``, FedSubAvg's) aggregate;
    ``lazy`` None means the ``lazy`` option decides."""

    def build(c: AlgorithmContext, s: Scheme, o: Any) -> dict[str, Any]:
        if heat:
            weighting = "samples" if c.heat == "samples" else "uniform"
            aggregation = _aggregation(c, s, weighting, coefficients=heat_coefficients(c))
        else:
            aggregation = _aggregation(c, s)
        is_lazy = o.lazy if lazy is None else lazy
        return {"aggregation": aggregation, "make_server": _adaptive_server(kind, o, is_lazy)}

    return build


_BUILDERS: dict[str, tuple[type, Builder]] = {
    "fedavg": (CommonOptions, lambda c, s, o: {"aggregation": _aggregation(c, s)}),
    "fedsubavg": (
        CommonOptions,
        lambda c, s, o: {
            "aggregation": _aggregation(
                c,
                s,
                "samples" if c.heat == "samples" else "uniform",
                coefficients=heat_coefficients(c),
            )
        },
    ),
    "fedprox": (
        FedProxOptions,
        lambda c, s, o: {"aggregation": _aggregation(c, s), "client": (Prox(o.mu),)},
    ),
    "scaffold": (
        ServerLrOptions,
        lambda c, s, o: {
            "aggregation": _aggregation(c, s),
            "client": (ScaffoldCorrection(),),
            "make_server": lambda p: ServerSGD(o.server_lr),
        },
    ),
    "scaffold-approx": (
        ServerLrOptions,
        lambda c, s, o: {
            "aggregation": _aggregation(c, s),
            "make_server": lambda p: ServerMomentum(
                p,
                beta=(c.dataset.num_clients - c.clients_per_round) / c.dataset.num_clients,
                lr=o.server_lr,
            ),
        },
    ),
    **{
        name: (options, _adaptive(kind, heat=heat, lazy=lazy))
        for kind in ("adam", "adagrad", "yogi")
        for name, options, heat, lazy in (
            (f"fed{kind}", AdaptiveOptions, False, None),
            (f"fed{kind}-lazy", LazyAdaptiveOptions, False, True),
            (f"fedsubavg-{kind}", AdaptiveOptions, True, None),
        )
    },
    "central-sgd": (
        CommonOptions,
        lambda c, s, o: {"aggregation": Aggregation("samples"), "central": True},
    ),
}


def algorithm_names() -> list[str]:
    return sorted(_BUILDERS)


def options_class(base: str) -> type:
    return _BUILDERS[base][0]


def split_name(name: str) -> tuple[str, str]:
    """``"fedavg@scheme2"`` -> ("fedavg", "scheme2"); raises ValueError naming the choices."""
    base, _, scheme = name.partition("@")
    if base not in _BUILDERS:
        raise ValueError(f"unknown algorithm {base!r}; choose from {', '.join(algorithm_names())}")
    scheme = scheme or "default"
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose from {', '.join(SCHEMES)}")
    if base == "central-sgd" and scheme != "default":
        raise ValueError("central-sgd samples no clients, so it takes no scheme")
    return base, scheme


def build_algorithm(name: str, context: AlgorithmContext, options: Any = None) -> Algorithm:
    base, scheme_name = split_name(name)
    option_type, builder = _BUILDERS[base]
    options = options if options is not None else option_type()
    scheme = SCHEMES[scheme_name]
    fields = {"make_server": _sgd, **builder(context, scheme, options)}
    return Algorithm(name=name, scheme=scheme, lr=options.lr, **fields)
