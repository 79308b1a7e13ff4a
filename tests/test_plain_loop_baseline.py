"""benchmarks/gpu.py's g5 compares fedsub with the per-client loop a user would write
(benchmarks/plain_loop.py); the comparison is only fair if both train the same model: here,
at a tiny size on the CPU, the plain loop's model equals fedsub's batched FedSubAvg to 1e-5."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.algorithms.sampling import uniform_cohort
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.submodel.index import SubmodelIndex

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from plain_loop import PlainFederation, plain_round
from workloads import lognormal_zipf

K, STEPS, BATCH, LR, SEED, ROUNDS = 12, 4, 3, 0.5, 7, 3


def test_the_plain_per_client_loop_equals_fedsub_batched_fedsubavg():
    dataset = lognormal_zipf(clients=40, mean_samples=8, rows=300, ids_per_sample=4, seed=2)
    index = SubmodelIndex.build(dataset)
    model = EmbeddingLogisticRegression(dict(dataset.table_rows), embedding_dim=3)
    algorithm = build_algorithm("fedsubavg", AlgorithmContext(dataset, index, "samples", K))
    schedule = Schedule(ROUNDS, K, LocalWork(STEPS, BATCH, ClientStep(LR)), SEED)
    fedsub_model = train(model, algorithm, dataset, index, schedule)

    start = initial_params(model, schedule)
    table, weight, bias = start.tables["features"], start.dense["weight"], start.dense["bias"]
    plain = PlainFederation.of(dataset, table.device, table.dtype)
    for r in range(1, ROUNDS + 1):
        cohort = uniform_cohort(SEED, r, dataset.num_clients, K)
        plain_round(table, weight, bias, plain, cohort, SEED, r, STEPS, BATCH, LR)

    initial = initial_params(model, schedule).tables["features"]
    assert (fedsub_model.tables["features"] - initial).abs().max() > 1e-3  # it trained
    for got, want in [
        (table, fedsub_model.tables["features"]),
        (weight, fedsub_model.dense["weight"]),
        (bias, fedsub_model.dense["bias"]),
    ]:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
