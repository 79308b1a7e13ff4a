"""Aggregation rules: the ``aggregation = "..."`` piece of an algorithm, one class each.

A rule is a frozen dataclass whose fields are its options (keys of ``[algorithms.<name>]``
when an algorithm names it, as a client transform's), with class-level declarations the
rest of fedsub reads instead of its name:

- ``name``, ``description``: config name and its line in ``fedsub list algorithms``;
- ``pools_data``: one client holds every sample (central SGD: no cohort, no scheme);
- ``needs_heat``: it reads the rows' heat (``AggregationInputs.heat_coefficients``);
- ``secure_sum_ok``: its combine step is a weighted sum of the members' deltas with per-row
  coefficients, which a secure sum, private download's unbiasing and sub-model masking's
  slice average compute (``check_combination`` refuses the others there);
- ``weights_sum_to_one``: its own weighting's weights sum to 1 (masking's slice average
  divides by their sum; a scheme's weighting, when the scheme sets one, is checked instead).

``build(inputs, scheme)`` returns the round's ``Aggregation``: the weighting (the scheme's,
or the rule's own), per-row coefficients, and whether the round averages models (the
scheme's Scheme II). A rule whose combine step is not the weighted sum gives it as
``Aggregation.combine_step`` and declares ``secure_sum_ok = False``.

A plugin package adds a rule by giving its class through the ``fedsub.plugins`` entry points.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from fedsub import plugins
from fedsub.algorithms.aggregation import Aggregation
from fedsub.algorithms.schemes import Scheme
from fedsub.algorithms.weighting import Weighting
from fedsub.submodel.heat import HeatKind


@dataclass(frozen=True)
class AggregationInputs:
    """What a rule may read to build a round's aggregation: the population's totals (W, N),
    the heat definition, and FedSubAvg's per-row heat coefficients (computed on first call:
    a private heat source runs a protocol for them)."""

    population_weight: float
    num_clients: int
    heat: HeatKind
    heat_coefficients: Callable[[], dict[str, torch.Tensor]]

    def aggregation(self, scheme: Scheme, weighting: Weighting, **kw: Any) -> Aggregation:
        """The weighted sum with the scheme's weighting (else ``weighting``) and form."""
        return Aggregation(
            scheme.weighting or weighting,
            population_weight=self.population_weight,
            num_clients=self.num_clients,
            model_average=scheme.model_average,
            **kw,
        )


@runtime_checkable
class AggregationRule(Protocol):
    name: ClassVar[str]
    description: ClassVar[str]
    pools_data: ClassVar[bool]
    needs_heat: ClassVar[bool]
    secure_sum_ok: ClassVar[bool]
    weights_sum_to_one: ClassVar[bool]
    __dataclass_fields__: ClassVar[dict[str, Any]]  # a dataclass: its fields are its options

    def build(self, inputs: AggregationInputs, scheme: Scheme) -> Aggregation: ...


def is_rule(value: object) -> bool:
    """A rule class: a dataclass satisfying ``AggregationRule`` (its declarations and
    ``build`` are class attributes)."""
    return (
        isinstance(value, type)
        and dataclasses.is_dataclass(value)
        and isinstance(value, AggregationRule)
    )


@dataclass(frozen=True)
class FedAvgRule:
    name: ClassVar[str] = "fedavg"
    description: ClassVar[str] = "sample-weighted mean of the round's deltas"
    pools_data: ClassVar[bool] = False
    needs_heat: ClassVar[bool] = False
    secure_sum_ok: ClassVar[bool] = True
    weights_sum_to_one: ClassVar[bool] = True

    def build(self, inputs: AggregationInputs, scheme: Scheme) -> Aggregation:
        return inputs.aggregation(scheme, "samples")


@dataclass(frozen=True)
class FedSubAvgRule:
    """FedSubAvg (seed 001, Algorithm 1): the mean, each touched row times its heat
    coefficient; the mean is sample-weighted, or uniform over the K clients with heat =
    "clients"."""

    name: ClassVar[str] = "fedsubavg"
    description: ClassVar[str] = "the same mean, each touched row scaled by its heat coefficient"
    pools_data: ClassVar[bool] = False
    needs_heat: ClassVar[bool] = True
    secure_sum_ok: ClassVar[bool] = True
    weights_sum_to_one: ClassVar[bool] = True

    def build(self, inputs: AggregationInputs, scheme: Scheme) -> Aggregation:
        weighting: Weighting = "samples" if inputs.heat == "samples" else "uniform"
        return inputs.aggregation(scheme, weighting, coefficients=inputs.heat_coefficients())


@dataclass(frozen=True)
class CentralRule:
    name: ClassVar[str] = "central"
    description: ClassVar[str] = "all training data pooled as one client, batch K * B (CentralSGD)"
    pools_data: ClassVar[bool] = True
    needs_heat: ClassVar[bool] = False
    secure_sum_ok: ClassVar[bool] = True
    weights_sum_to_one: ClassVar[bool] = True

    def build(self, inputs: AggregationInputs, scheme: Scheme) -> Aggregation:
        return Aggregation("samples")


_BUILT_IN: tuple[type[AggregationRule], ...] = (FedAvgRule, FedSubAvgRule, CentralRule)
AGGREGATIONS: plugins.Registry[type[AggregationRule]] = plugins.Registry(
    "aggregation rule",
    {rule.name: rule for rule in _BUILT_IN},
    is_rule,
    lambda rule: str(rule.__dict__.get("name", "")),
)


def rule_class(name: str) -> type[AggregationRule]:
    """The rule class ``name`` (ConfigError naming the choices)."""
    return AGGREGATIONS.get_or_refuse(name)


def aggregation_names() -> list[str]:
    return AGGREGATIONS.names()
