"""Issue 15 (g7): a round split across processes with torch.distributed, against one process.

    python benchmarks/distributed_speed.py [--nproc 2] [--device cpu|cuda] [--rounds 20]
                                          [--runs 3]

Embedding-LR (1e5 rows of dimension 16, sum-pooled, dense head) on Zipf(1.1) clicks of 1,000
clients of 100 samples (5 ids each), FedSubAvg, K = ``--clients-per-round`` (default 100),
B = 5, I = 10, lr 0.1. The same run in one process, then under
``torchrun --standalone --nproc-per-node N`` (gloo on the CPU, NCCL on GPUs: each process on
cuda:LOCAL_RANK), side by side in one invocation, alternating ``--runs`` times (a slower
spell of a shared machine falls on both sides); each in fresh processes with ``--threads``
torch threads each (default 1, torchrun's default). Per-round time = median over rounds
2..R of the rounds' wall time (process 0's clock), the figure the median of the runs; and
the largest absolute difference between the two final models. Ends with a line
``RESULT {json}`` (benchmarks/gpu.py reads it for figure g7).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from fedsub import distributed
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.submodel.index import SubmodelIndex
from workloads import zipf_clicks

ROWS, DIM, B, STEPS, LR, SEED = 100_000, 16, 5, 10, 0.1, 0


def one_run(rounds: int, k: int, device: str, out: Path) -> None:
    """The benchmark's run in this process (one of torchrun's, or alone): process 0 writes
    the per-round times and the final model to ``out``."""
    processes = distributed.from_environment()
    place = distributed.process_device(torch.device(device), processes)
    distributed.join(place)
    dataset = zipf_clicks(rows=ROWS, seed=1)
    index = SubmodelIndex.build(dataset)
    model = EmbeddingLogisticRegression(dict(dataset.table_rows), embedding_dim=DIM)
    algorithm = build_algorithm("fedsubavg", AlgorithmContext(dataset, index, "samples", k))
    schedule = Schedule(
        rounds,
        k,
        LocalWork(STEPS, B, ClientStep(LR)),
        SEED,
        execution=Execution(backend="batched", device=place),
    )
    stamps = [time.perf_counter()]
    gathers: list[float] = []
    gather = distributed.all_gather

    def timed_gather(value, what):
        started = time.perf_counter()
        try:
            return gather(value, what)
        finally:
            gathers.append(time.perf_counter() - started)

    distributed.all_gather = timed_gather  # process 0's time in the gather, its wait included

    def stamp(round_index: int) -> None:
        if place.type == "cuda":
            torch.cuda.synchronize(place)
        stamps.append(time.perf_counter())

    params = train(model, algorithm, dataset, index, schedule, on_round=stamp)
    if processes.writes:
        per_round = np.diff(stamps)[1:]
        times = {"rounds": [float(t) for t in per_round], "gathers": gathers[1:]}
        (out / "times.json").write_text(json.dumps(times))
        torch.save({k: v.cpu() for k, v in params.state_dict().items()}, out / "model.pt")
    distributed.leave()


def launch(nproc: int, args: argparse.Namespace, out: Path) -> tuple[float, float, dict]:
    """The run in fresh processes (``nproc`` under torchrun, or one alone): median seconds
    per round, median seconds in the gather of a round (0 alone) and the final model."""
    out.mkdir(parents=True, exist_ok=True)
    child = [
        __file__,
        "--child",
        str(out),
        "--rounds",
        str(args.rounds),
        "--clients-per-round",
        str(args.clients_per_round),
        "--device",
        args.device,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if nproc == 1:
        command = [sys.executable, *child]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", str(nproc), *child]
    subprocess.run(command, check=True, env=env)
    times = json.loads((out / "times.json").read_text())
    gathers = float(np.median(times["gathers"])) if times["gathers"] else 0.0
    return float(np.median(times["rounds"])), gathers, torch.load(out / "model.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2, help="processes to compare with one")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--clients-per-round", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs of each")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        one_run(args.rounds, args.clients_per_round, args.device, Path(args.child))
        return
    runs: dict[int, list[float]] = {1: [], args.nproc: []}
    gathers: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        for run in range(args.runs):
            alone, _, model_alone = launch(1, args, Path(folder) / f"one-{run}")
            split, gathered, model_split = launch(args.nproc, args, Path(folder) / f"split-{run}")
            runs[1].append(alone)
            runs[args.nproc].append(split)
            gathers.append(gathered)
    difference = max(float((model_split[k] - v).abs().max()) for k, v in model_alone.items())
    alone, split = float(np.median(runs[1])), float(np.median(runs[args.nproc]))
    result = {
        "benchmark": "g7",
        "workload": {
            "model": f"embedding-lr {ROWS} x {DIM}",
            "clients": 1000,
            "clients_per_round": args.clients_per_round,
            "local_steps": STEPS,
            "batch_size": B,
            "algorithm": "fedsubavg",
            "backend": "batched",
        },
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "threads_per_process": args.threads,
        "rounds": args.rounds,
        "nproc": args.nproc,
        "runs": args.runs,
        "seconds_per_round": {"1": alone, str(args.nproc): split},
        "seconds_per_round_of_each_run": {str(n): times for n, times in runs.items()},
        "gather_seconds_per_round": float(np.median(gathers)),
        "gather_seconds_of_each_run": gathers,
        "speedup": alone / split,
        "max_abs_model_difference": difference,
    }
    print(f"1 process: {alone * 1e3:.1f} ms/round")
    gathering = float(np.median(gathers)) * 1e3
    print(f"{args.nproc} processes: {split * 1e3:.1f} ms/round ({gathering:.1f} ms gathering)")
    print(f"max |model difference| = {difference:.3g}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
