"""``execution.compile`` on a small, launch-bound workload: eager vs captured per-round time.

    python benchmarks/compile_speed.py [--device cpu] [--cohorts 10,100,300] [--runs 5]

The workload is ``gpu.py --small``'s (g1): embedding-LR (rows of dimension 16, sum-pooled, a
linear head), FedSubAvg, 2,000 clients with lognormal sizes, 10 Zipf ids per sample, a 1e5-row
table, I = 10, B = 5. For each K, one captured run first compiles (its first-round time is
reported), then eager and captured runs of ``--rounds`` rounds alternate ``--runs`` times (so a
shared machine's load hits both alike); a run's time is the median of its rounds 3..R, the
figure the median over runs. Also the largest |difference| between the two final models.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from fedsub.device import resolve_device
from fedsub.engine.execution import Compile
from gpu import SMALL, device_name, embedding_lr, probe_data, schedule, timed_run


def compare(k: int, device: torch.device, rounds: int, runs: int, data) -> dict:
    dataset, index = data
    model = embedding_lr(dataset)
    eager = schedule(device, k, rounds)
    compiled = dataclasses.replace(eager.execution, compile=Compile.for_device(device))
    captured = dataclasses.replace(eager, execution=compiled)
    _, first, _ = timed_run(model, dataset, index, captured)  # compiles
    eager_ms, captured_ms = [], []
    for _ in range(runs):
        seconds, _, eager_model = timed_run(model, dataset, index, eager)
        eager_ms.append(seconds * 1e3)
        seconds, _, captured_model = timed_run(model, dataset, index, captured)
        captured_ms.append(seconds * 1e3)
    difference = max(
        float((value - captured_model.state_dict()[name]).abs().max())
        for name, value in eager_model.state_dict().items()
    )
    eager_median, captured_median = statistics.median(eager_ms), statistics.median(captured_ms)
    return {
        "eager_ms_per_round": eager_median,
        "compiled_ms_per_round": captured_median,
        "speedup": eager_median / captured_median,
        "eager_runs_ms": eager_ms,
        "compiled_runs_ms": captured_ms,
        "compiling_rounds_s": first[:3],
        "max_abs_difference": difference,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help='execution.device: "cpu", "cuda", ...')
    parser.add_argument("--cohorts", default="10,100,300", help="the K values")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per run")
    parser.add_argument("--runs", type=int, default=5, help="alternating runs per mode")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    data = probe_data(SMALL, SMALL["rows"])
    result: dict = {
        "device": device_name(device),
        "compile": dataclasses.asdict(Compile.for_device(device)),
        "workload": "gpu.py --small g1 (embedding-LR, FedSubAvg, I = 10, B = 5, float32)",
    }
    for k in (int(text) for text in args.cohorts.split(",")):
        result[f"K={k}"] = compare(k, device, args.rounds, args.runs, data)
        print(f"K = {k}:", json.dumps(result[f"K={k}"]), flush=True)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
