"""Each algorithm is a choice of the round's stages.

- ``fedavg``: sample-weighted mean of the round's deltas, applied to every parameter.
- ``fedsubavg``: the same mean, each touched row scaled by its heat coefficient (Algorithm 1
  of seed 001; with heat = "clients" the mean is uniform over the K clients, exactly as there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedsub.algorithms.aggregation import Aggregation
from fedsub.algorithms.server_optimizer import ServerSGD
from fedsub.data.federated import FederatedDataset
from fedsub.submodel import heat as heat_lib
from fedsub.submodel.index import SubmodelIndex


@dataclass(frozen=True)
class AlgorithmContext:
    """What building an algorithm may look at: the data layout and the heat definition."""

    dataset: FederatedDataset
    index: SubmodelIndex
    heat: heat_lib.HeatKind


@dataclass(frozen=True)
class Algorithm:
    name: str
    aggregation: Aggregation
    server: ServerSGD


def heat_coefficients(context: AlgorithmContext) -> dict[str, torch.Tensor]:
    """FedSubAvg's per-row coefficients for every table, computed once over all N clients."""
    counts = context.dataset.sample_counts()
    total = float(counts.sum()) if context.heat == "samples" else float(len(counts))
    return {
        table: torch.from_numpy(
            heat_lib.coefficients(
                heat_lib.heat(context.index.rows[table], rows, counts, context.heat), total
            )
        )
        for table, rows in context.dataset.table_rows.items()
    }


def _fedavg(context: AlgorithmContext) -> Algorithm:
    return Algorithm("fedavg", Aggregation("samples"), ServerSGD())


def _fedsubavg(context: AlgorithmContext) -> Algorithm:
    weighting = "samples" if context.heat == "samples" else "uniform"
    return Algorithm("fedsubavg", Aggregation(weighting, heat_coefficients(context)), ServerSGD())


_BUILDERS: dict[str, Callable[[AlgorithmContext], Algorithm]] = {
    "fedavg": _fedavg,
    "fedsubavg": _fedsubavg,
}


def algorithm_names() -> list[str]:
    return sorted(_BUILDERS)


def build_algorithm(name: str, context: AlgorithmContext) -> Algorithm:
    return _BUILDERS[name](context)
