"""Issue 28's DIN benchmarks on the FedSubAvg authors' Amazon shape (seed 001's setup).

    python benchmarks/amazon_din.py [--only round|eval|table2] [--runs 3] [--threads 1]
                                    [--table2-rounds 200] [--files DIR]

The data: ``workloads.write_amazon_files`` (per-user files in the authors' format with their
statistics: 1,859 users, 99,710 lines, history length mean ~20 / median 15 / p99 ~120 / max
229, item heat max ~240 / median 2, positive rate 0.555), read by fedsub's ``amazon-fedsubavg``
loader (the last 20% of each user's lines are the test set). ``--files DIR`` reads the real
files instead.

(round)  Per-round time, batched vs the sequential per-client reference, FedSubAvg as seed 001
         runs it (DIN with embeddings of 18, K = 100, I = 10, B = 4, lr 0.05 x 0.999 per round,
         clipping at 5): alternating runs (batched, sequential, batched, ...), the median of
         rounds 2.. of each; wall and CPU seconds (CPU time is steadier on a shared machine).
(eval)   One evaluation (the 10,000-sample train-loss subset + the test set, AUC included)
         against the batched round, in rounds.
(table2) The Amazon row of Table 2: ``configs/amazon-din.toml``'s six algorithms x
         ``--table2-rounds`` rounds (evaluation every 10) through ``experiment.compare``, in a
         fresh process: wall time, and its peak resident memory.

Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.models.din import DIN
from fedsub.submodel.index import SubmodelIndex
from workloads import amazon_files

ROOT = Path(__file__).resolve().parents[1]
K, STEPS, B, LR, CLIP, EMBEDDING = 100, 10, 4, 0.05, 5.0, 18


def round_times(dataset, index, model, backend: str, rounds: int) -> dict:
    """Median wall and CPU seconds of rounds 2..``rounds`` of FedSubAvg on ``backend``."""
    algorithm = build_algorithm("fedsubavg", AlgorithmContext(dataset, index, "samples", K))
    schedule = Schedule(
        rounds,
        K,
        LocalWork(STEPS, B, ClientStep(LR, lr_schedule="exponential", clip_norm=CLIP)),
        0,
        execution=Execution(backend=backend),
    )
    wall, cpu = [time.perf_counter()], [time.process_time()]

    def mark(_: int) -> None:
        wall.append(time.perf_counter())
        cpu.append(time.process_time())

    train(model, algorithm, dataset, index, schedule, on_round=mark)
    return {
        "wall": float(np.median(np.diff(wall)[1:])),
        "cpu": float(np.median(np.diff(cpu)[1:])),
    }


def rounds_figure(dataset, index, model, runs: int) -> dict:
    round_times(dataset, index, model, "batched", 2)  # warm-up
    pairs = [
        (
            round_times(dataset, index, model, "batched", 6),
            round_times(dataset, index, model, "sequential", 3),
        )
        for _ in range(runs)
    ]
    result: dict = {}
    for clock in ("wall", "cpu"):
        batched = statistics.median(b[clock] for b, _ in pairs)
        sequential = statistics.median(s[clock] for _, s in pairs)
        result[clock] = {
            "batched_s_per_round": batched,
            "sequential_s_per_round": sequential,
            "batched_vs_sequential": sequential / batched,
            "per_pair": sorted(s[clock] / b[clock] for b, s in pairs),
        }
    return result


def eval_figure(dataset, index, model, runs: int) -> dict:
    """One evaluation's wall and CPU seconds, against the batched round measured around it."""
    params = initial_params(model, Schedule(1, K, LocalWork(STEPS, B, ClientStep(LR)), 0))
    evaluator = Evaluator.build(model, dataset, 10_000, 0)
    evaluator.evaluate(params)  # builds the cached evaluation batches, as a run's first does
    wall, cpu, rounds = [], [], []
    for _ in range(runs):
        rounds.append(round_times(dataset, index, model, "batched", 4))
        started, cpu_started = time.perf_counter(), time.process_time()
        evaluator.evaluate(params)
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    result = {}
    for clock, seconds in (("wall", wall), ("cpu", cpu)):
        per_round = statistics.median(r[clock] for r in rounds)
        result[clock] = {
            "evaluation_s": statistics.median(seconds),
            "batched_s_per_round": per_round,
            "evaluation_in_rounds": statistics.median(seconds) / per_round,
        }
    return result


def table2_child(folder: str, rounds: int, threads: int) -> None:
    """In a fresh process: the Table 2 row through ``experiment.compare``."""
    from fedsub import config as config_lib
    from fedsub.runs.experiment import compare

    overrides = [
        f'data.path="{folder}"',
        f"train.rounds={rounds}",
        f"execution.threads={threads}",
        "eval.every=10",
    ]
    config = config_lib.load(ROOT / "configs" / "amazon-din.toml", overrides)
    # a checkout without --profile (the commit before it, run side by side) times it whole
    profiled = {"profile": True} if "profile" in inspect.signature(compare).parameters else {}
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        outcome = compare(config, Path(out) / "run", **profiled)
        seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    profiles = getattr(outcome, "profiles", {})
    per_algorithm = {
        name: {
            "s_per_round": record["seconds_per_round"],
            "evaluation_s_per_round": record["phases"]
            .get("evaluation", {})
            .get("seconds_per_round"),
        }
        for name, record in profiles.items()
    }
    print(
        json.dumps(
            {
                "seconds": seconds,
                "rounds": rounds,
                "peak_rss_bytes": peak,
                "algorithms": per_algorithm,
            }
        )
    )


def table2_figure(folder: Path, rounds: int, threads: int) -> dict:
    child = subprocess.run(
        [
            sys.executable,
            __file__,
            "--table2-child",
            str(folder),
            "--table2-rounds",
            str(rounds),
            "--threads",
            str(threads),
        ],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ,
    )
    return json.loads(child.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["round", "eval", "table2"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's)")
    parser.add_argument("--table2-rounds", type=int, default=200)
    parser.add_argument("--files", type=Path, help="the authors' per-user files (a folder)")
    parser.add_argument("--table2-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.table2_child:
        table2_child(args.table2_child, args.table2_rounds, args.threads)
        return
    folder = args.files or Path(tempfile.gettempdir()) / "fedsub-amazon-shape-1"
    dataset = amazon_files(folder if args.files else None)
    index = SubmodelIndex.build(dataset)
    model = DIN(dict(dataset.table_rows), embedding_dim=EMBEDDING)
    result: dict = {"threads": torch.get_num_threads(), "load_before": os.getloadavg()}
    if args.only in (None, "round"):
        result["round"] = rounds_figure(dataset, index, model, args.runs)
        print("(round)", json.dumps(result["round"]), flush=True)
    if args.only in (None, "eval"):
        result["eval"] = eval_figure(dataset, index, model, args.runs)
        print("(eval)", json.dumps(result["eval"]), flush=True)
    if args.only in (None, "table2"):
        result["table2"] = table2_figure(folder, args.table2_rounds, args.threads)
        print("(table2)", json.dumps(result["table2"]), flush=True)
    result["load_after"] = os.getloadavg()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
