"""Issue 29: a user's nn.Module (models/torch_module.py) against fedsub's built-in model, on
the batched and sequential backends: steady-state per-round time, alternating runs.

    python benchmarks/torch_module_speed.py [--runs 3] [--rounds 30]

(a) embedding-LR (dimension 16, sum per field, a linear head) on issue 5's workload (N =
    1,000 clients x 100 samples, 20,000 rows, 5 Zipf ids per sample), FedAvg, K = 50, B = 5,
    I = 10: the built-in ``embedding-lr`` (its own cohort head) vs the same model written as an
    ``nn.Module`` with an ``nn.EmbeddingBag`` (wrapped: vmap over the clients' dense
    parameters), each on both backends; both start from the same weights, so their final
    models are compared too.
(b) the two-tower example (examples/two-tower: 500 users, 4 tables, two MLP towers),
    FedSubAvg, K = 20, B = 8, I = 5: batched vs sequential.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "two-tower"))

from two_tower import TwoTower, clicks

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.models.base import Model
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.models.torch_module import wrap
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from workloads import zipf_clicks


class SummedEmbeddings(nn.Module):
    """embedding-lr as a user writes it: a bag of rows per sample, then a linear layer."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.features = nn.EmbeddingBag(rows, dim, mode="sum", include_last_offset=True)
        self.out = nn.Linear(dim, 1)

    def forward(self, batch) -> torch.Tensor:
        return self.out(self.features(*batch.ids["features"])).squeeze(-1)


def per_round(model: Model, dataset, index, schedule: Schedule, algorithm: str) -> tuple:
    built = build_algorithm(algorithm, AlgorithmContext(dataset, index, "samples"))
    stamps = [time.perf_counter()]
    params = train(
        model,
        built,
        dataset,
        index,
        schedule,
        on_round=lambda r: stamps.append(time.perf_counter()),
    )
    return float(np.median(np.diff(stamps)[1:])), params


def max_difference(a: Params, b: Params) -> float:
    """Largest |difference| between two models whose dense parameters may differ in shape
    (the built-in head's weight [d] is the module's out.weight [1, d])."""
    tables = max(float((a.tables[t] - b.tables[t]).abs().max()) for t in a.tables)
    dense_a = torch.cat([v.reshape(-1) for v in a.dense.values()])
    dense_b = torch.cat([v.reshape(-1) for v in b.dense.values()])
    return max(tables, float((dense_a - dense_b).abs().max()))


def embedding_lr(runs: int, rounds: int) -> dict:
    dataset = zipf_clicks()
    index = SubmodelIndex.build(dataset)
    rows, dim = dataset.table_rows["features"], 16
    torch.manual_seed(0)
    module = SummedEmbeddings(rows, dim)
    with torch.no_grad():
        module.features.weight.normal_(std=0.01)
    wrapped = wrap(module, dataset)
    start = wrapped.init(torch.Generator(), torch.float32)

    class SameStart(EmbeddingLogisticRegression):
        def init(self, generator, dtype):
            dense = {"weight": start.dense["out.weight"][0], "bias": start.dense["out.bias"]}
            return Params(dict(start.tables), dense).clone()

    built_in = SameStart({"features": rows}, dim, fields=("features",))
    models = {"built-in": built_in, "module": wrapped}
    times: dict[str, list[float]] = {}
    finals = {}
    for _ in range(runs):  # alternating: a slow spell of the machine falls on every case
        for name, model in models.items():
            for backend in ("batched", "sequential"):
                schedule = Schedule(
                    rounds,
                    50,
                    LocalWork(10, 5, ClientStep(0.1)),
                    0,
                    execution=Execution(backend=backend),
                )
                seconds, finals[name, backend] = per_round(
                    model, dataset, index, schedule, "fedavg"
                )
                times.setdefault(f"{name} {backend}", []).append(seconds)
    median = {k: statistics.median(v) for k, v in times.items()}

    def per_run(a: str, b: str) -> list[float]:  # each run's ratio: its cases ran back to back
        return [x / y for x, y in zip(times[a], times[b], strict=True)]

    return {
        "seconds_per_round": median,
        "runs": times,
        "module_vs_built_in_batched_per_run": per_run("module batched", "built-in batched"),
        "module_batched_speedup_per_run": per_run("module sequential", "module batched"),
        "module_batched_speedup": median["module sequential"] / median["module batched"],
        "built_in_batched_speedup": median["built-in sequential"] / median["built-in batched"],
        "module_vs_built_in_batched": median["module batched"] / median["built-in batched"],
        "module_vs_built_in_sequential": (
            median["module sequential"] / median["built-in sequential"]
        ),
        "max_difference_module_vs_built_in_batched": max_difference(
            finals["module", "batched"], finals["built-in", "batched"]
        ),
        "max_difference_module_batched_vs_sequential": max_difference(
            finals["module", "batched"], finals["module", "sequential"]
        ),
    }


def two_tower(runs: int, rounds: int) -> dict:
    dataset = clicks()
    index = SubmodelIndex.build(dataset)
    rows = dataset.table_rows
    torch.manual_seed(0)
    model = wrap(TwoTower(rows["user"], rows["age"], rows["item"], rows["category"]), dataset)
    times: dict[str, list[float]] = {}
    finals = {}
    for _ in range(runs):
        for backend in ("batched", "sequential"):
            schedule = Schedule(
                rounds,
                20,
                LocalWork(5, 8, ClientStep(0.3)),
                0,
                execution=Execution(backend=backend),
            )
            seconds, finals[backend] = per_round(model, dataset, index, schedule, "fedsubavg")
            times.setdefault(backend, []).append(seconds)
    median = {k: statistics.median(v) for k, v in times.items()}
    pairs = zip(times["sequential"], times["batched"], strict=True)
    return {
        "seconds_per_round": median,
        "runs": times,
        "batched_speedup_per_run": [s / b for s, b in pairs],
        "batched_speedup": median["sequential"] / median["batched"],
        "max_difference_batched_vs_sequential": max_difference(
            finals["batched"], finals["sequential"]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {
        "embedding_lr": embedding_lr(args.runs, args.rounds),
        "two_tower": two_tower(args.runs, args.rounds),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
