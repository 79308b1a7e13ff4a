"""Issue 28's LSTM benchmark: seed 001's Sent140 setup (2-layer LSTM of 100 units, embedding
25, FedSubAvg, K = 50, I = 10, B = 5, lr 0.1) on the Sent140-shaped workload
(``workloads.sent140_like``: 1,473 users, ~54 tweets each, 10,001 word ids, tweet lengths with
mean ~14 words, cut at 25), batched vs sequential per round, side by side in one run.

    python benchmarks/lstm_speed.py [--runs 3] [--threads 1] [--rounds 6]

The two backends run alternately (batched, sequential, batched, ...), each for ``--rounds``
rounds (the sequential one for half as many, at least 2); a run's figure is the median over its
rounds after the first. Both wall-clock and CPU seconds (``time.process_time``, which a busy
shared machine inflates less) are reported. ``--per-client-packed`` adds, for comparison, the
sequential backend running the packed head one client at a time (what batching adds beyond the
packed kernel itself). The final models of the first pair are compared (float32); the peak
resident memory is the process's (both backends).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.models.cohort_ops import single_client
from fedsub.models.lstm import LSTMClassifier
from fedsub.submodel.index import SubmodelIndex
from workloads import sent140_like

K, STEPS, B, LR, SEED = 50, 10, 5, 0.1, 0


@dataclasses.dataclass(frozen=True)
class PackedPerClient(LSTMClassifier):
    """The sequential backend on the packed head, one client at a time (a comparison only)."""

    def head(self, dense, features, dense_inputs):
        return single_client(self.cohort_head, dense, features)


def one_run(dataset, index, model, backend: str, rounds: int) -> dict:
    algorithm = build_algorithm("fedsubavg", AlgorithmContext(dataset, index, "samples", K))
    schedule = Schedule(
        rounds, K, LocalWork(STEPS, B, ClientStep(LR)), SEED, execution=Execution(backend=backend)
    )
    wall, cpu = [time.perf_counter()], [time.process_time()]

    def stamp(_round: int) -> None:
        wall.append(time.perf_counter())
        cpu.append(time.process_time())

    params = train(model, algorithm, dataset, index, schedule, on_round=stamp)
    return {
        "wall": float(np.median(np.diff(wall)[1:])),
        "cpu": float(np.median(np.diff(cpu)[1:])),
        "params": params,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    parser.add_argument("--per-client-packed", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = sent140_like()
    index = SubmodelIndex.build(dataset)
    model = LSTMClassifier(dict(dataset.table_rows))
    lengths = dataset.train.ids["words"].lengths()
    shape = {
        "clients": dataset.num_clients,
        "train_samples": len(dataset.train),
        "test_samples": len(dataset.test),
        "mean_tweet_words": float(lengths.mean()),
        "vocabulary": dataset.table_rows["words"],
    }
    print("workload", json.dumps(shape), flush=True)
    sequential_rounds = max(2, args.rounds // 2)
    one_run(dataset, index, model, "batched", 2)  # warm-up
    pairs = []
    for run in range(args.runs):
        batched = one_run(dataset, index, model, "batched", args.rounds)
        sequential = one_run(dataset, index, model, "sequential", sequential_rounds)
        pairs.append((batched, sequential))
        print(
            f"run {run + 1}: batched {batched['wall']:.3f} s ({batched['cpu']:.3f} cpu), "
            f"sequential {sequential['wall']:.3f} s ({sequential['cpu']:.3f} cpu)",
            flush=True,
        )
    result: dict = {"workload": shape, "threads": torch.get_num_threads()}
    for clock in ("wall", "cpu"):
        b = statistics.median(p[0][clock] for p in pairs)
        s = statistics.median(p[1][clock] for p in pairs)
        result[clock] = {
            "batched_s_per_round": b,
            "sequential_s_per_round": s,
            "sequential_vs_batched": s / b,
            "per_pair": sorted(p[1][clock] / p[0][clock] for p in pairs),
        }
    # the same rounds: the batched run's first rounds against the sequential run's
    short = one_run(dataset, index, model, "batched", sequential_rounds)["params"]
    reference = pairs[0][1]["params"].state_dict()
    result["max_model_diff"] = max(
        float((short.state_dict()[n] - p).abs().max()) for n, p in reference.items()
    )
    if args.per_client_packed:
        packed = one_run(dataset, index, PackedPerClient(**vars(model)), "sequential", 2)
        result["per_client_packed_s_per_round"] = {"wall": packed["wall"], "cpu": packed["cpu"]}
    # both backends ran in this process: the larger of their peaks (the data, the model and
    # the batched cohort's buffers)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["load_average"] = os.getloadavg()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
