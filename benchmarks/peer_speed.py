"""Issue 28's peer benchmark: the peer workload (engine_speed.py's (a)) on fedsub's batched
backend, fedsub's per-client loop (the sequential backend), pfl-research's simulation and
Flower's, side by side in one invocation; per-round time and peak memory of each.

    python benchmarks/peer_speed.py [--runs 3] [--rounds 50] [--skip-flower] [--skip-pfl]
        [--pfl-python .venv-pfl/bin/python]

Workload: sparse LR, FedAvg, N = 1,000 clients of 100 samples, 20,000 ids, 5 ids per sample
(Zipf(1.1)), K = 50, B = 5, I = 10, lr 0.1; the figure is the median over rounds 2..R of a run
(round 1 warms caches and, in pfl, evaluates each user once), then the median over runs;
wall-clock and, for the engines that run in one process (fedsub, pfl), CPU seconds.
Every engine runs in a fresh process with 1 torch thread (Flower: 1 CPU per client), in the
order batched, sequential, pfl (, Flower) per run, so a slow spell of the shared machine falls
on every side; its peak memory is the largest resident set of that process and its children
(Flower's Ray workers), sampled every 20 ms, and the process's own ``ru_maxrss``.

Every engine trains fedsub's model on fedsub's batches: the cohort of round r is
``uniform_cohort(seed, r, N, K)`` and each member's samples come in the order of
``cohort_schedules(seed, r, client)``; the final models are compared with the batched one.

pfl (``pfl[pytorch]`` 0.6) runs in an environment of its own (pfl 0.6 needs dp-accounting <
0.6, fedsub >= 0.6): ``--pfl-python`` (default the checkout's ``.venv-pfl``;
benchmarks/README.md says how to make it) runs peer_pfl.py, which imports no fedsub and reads
what fedsub decides from a file this script writes first (``write_pfl_inputs``). It is set up
as pfl's documentation sets up a simulation: a ``FederatedDataset`` whose ``make_dataset_fn``
builds a user's ``Dataset``, a user sampler callable, a ``PyTorchModel`` around a
``torch.nn.Module`` with ``loss`` and ``metrics``, local ``torch.optim.SGD``, central SGD with
learning rate 1 (the average model difference applied as is: FedAvg), ``FederatedAveraging``
with ``NNAlgorithmParams`` / ``NNTrainHyperParams`` (``local_num_steps`` 10,
``local_batch_size`` 5), a ``SimulatedBackend`` in one process (pfl's users run one after
another in a worker; several workers need several processes, as fedsub's torchrun split). What
is fedsub's is only the data: the sampler returns fedsub's cohort and each user's
``PyTorchTensorDataset`` holds that round's 50 samples in fedsub's order, both computed before
the clock starts.
"""

from __future__ import annotations

import argparse
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

from engine_speed import LR, ROUNDS, SEED, STEPS, B, K, flower_run
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.algorithms.sampling import uniform_cohort
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.engine.shuffle import cohort_schedules
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.submodel.index import SubmodelIndex
from workloads import zipf_clicks

ENGINES = ("batched", "sequential", "pfl", "flower")
PFL_VENV = Path(__file__).resolve().parents[1] / ".venv-pfl"  # pfl-research's environment


class RoundTimes:
    """Wall-clock and CPU (``time.process_time``: this process only, which a busy shared
    machine inflates less) stamps at the start and after every round."""

    def __init__(self) -> None:
        self.wall = [time.perf_counter()]
        self.cpu = [time.process_time()]

    def stamp(self, *_args, **_kwargs) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def steady(self) -> dict[str, float]:
        """Median of rounds 2..R on each clock."""
        return {
            "wall": float(np.median(np.diff(self.wall)[1:])),
            "cpu": float(np.median(np.diff(self.cpu)[1:])),
        }


def fedsub_run(dataset, backend: str, rounds: int) -> tuple[dict[str, float], dict]:
    model = SparseLogisticRegression(dict(dataset.table_rows))
    index = SubmodelIndex.build(dataset)
    algorithm = build_algorithm("fedavg", AlgorithmContext(dataset, index, "samples", K))
    schedule = Schedule(
        rounds, K, LocalWork(STEPS, B, ClientStep(LR)), SEED, execution=Execution(backend=backend)
    )
    clock = RoundTimes()
    params = train(model, algorithm, dataset, index, schedule, on_round=clock.stamp)
    final = {
        "table": params.tables["features"].numpy().reshape(-1),
        "bias": params.dense["bias"].numpy(),
    }
    return clock.steady(), final


def write_pfl_inputs(dataset, rounds: int, path: Path) -> None:
    """What pfl's engine (peer_pfl.py, in pfl's own environment) trains on, as fedsub decides
    it, computed here before any clock: fedsub's cohorts and each member's samples in fedsub's
    order for every round, the initial model and the schedule."""
    n = dataset.num_clients
    ids = dataset.train.ids["features"].values.reshape(len(dataset.train), -1)
    labels = dataset.train.labels
    offsets = dataset.client_offsets
    queue, rows = [], []
    for r in range(1, rounds + 1):
        cohort = uniform_cohort(SEED, r, n, K)
        counts = torch.from_numpy(offsets[cohort + 1] - offsets[cohort])
        orders = cohort_schedules(SEED, r, torch.from_numpy(cohort), counts, STEPS, B).numpy()
        for client, order in zip(cohort.tolist(), orders, strict=True):
            queue.append((r, client))
            rows.append(offsets[client] + order.reshape(-1))
    start = initial_params(
        SparseLogisticRegression(dict(dataset.table_rows)),
        Schedule(1, K, LocalWork(STEPS, B, ClientStep(LR)), SEED),
    )
    every = np.concatenate(rows)
    np.savez(
        path,
        queue=np.asarray(queue, dtype=np.int64),
        entry_offsets=np.concatenate([[0], np.cumsum([len(r) for r in rows])]),
        ids=ids[every],
        labels=labels[every],
        table=start.tables["features"].numpy(),
        bias=start.dense["bias"].numpy(),
        rounds=rounds, k=K, steps=STEPS, batch=B, lr=LR,
    )  # fmt: skip


def pfl_python(given: str | None) -> str:
    """The Python of pfl-research's environment: ``--pfl-python``, else ``$FEDSUB_PFL_PYTHON``,
    else the checkout's ``.venv-pfl`` (benchmarks/README.md says how to make it)."""
    found = given or os.environ.get("FEDSUB_PFL_PYTHON") or str(PFL_VENV / "bin" / "python")
    if not Path(found).exists():
        sys.exit(
            f"peer_speed.py: no Python of pfl-research's environment at {found}; make it with\n"
            f"  python3.11 -m venv {PFL_VENV}\n  {PFL_VENV}/bin/pip install -c "
            "benchmarks/pfl-constraints.txt -r benchmarks/pfl-requirements.txt\n"
            "or give --pfl-python PATH (or --skip-pfl)"
        )
    return found


def run_engine(engine: str, rounds: int) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    dataset = zipf_clicks()
    if engine in ("batched", "sequential"):
        return fedsub_run(dataset, engine, rounds)
    # Flower's clients run in Ray workers: its CPU time is not this process's
    seconds, (table, bias) = flower_run(dataset, rounds=rounds)
    return {"wall": seconds}, {"table": np.asarray(table).reshape(-1), "bias": np.asarray(bias)}


def child(engine: str, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    seconds, final = run_engine(engine, rounds)
    np.savez(out, **final)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds_per_round": seconds, "ru_maxrss_bytes": peak}))


def measured(engine: str, rounds: int, folder: str, python: str = sys.executable) -> dict:
    """One fresh process running ``engine``; its tree's peak resident memory sampled. pfl's
    runs peer_pfl.py in pfl's environment (``python``) on the inputs ``main`` wrote."""
    import psutil

    out = str(Path(folder) / f"{engine}.npz")
    command = [sys.executable, __file__, "--child", engine, "--rounds", str(rounds), "--out", out]
    if engine == "pfl":
        inputs = str(Path(folder) / "pfl-inputs.npz")
        command = [python, str(Path(__file__).parent / "peer_pfl.py"), "--inputs", inputs]
        command += ["--out", out]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    root, peak = psutil.Process(process.pid), 0
    while process.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    stdout = process.stdout.read() if process.stdout else ""
    if process.returncode:
        raise RuntimeError(f"{engine} failed (exit {process.returncode})")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["peak_tree_rss_bytes"] = peak
    with np.load(out) as final:
        result["model"] = {name: final[name] for name in final.files}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--skip-flower", action="store_true")
    parser.add_argument("--skip-pfl", action="store_true")
    parser.add_argument(
        "--pfl-python", help="the Python of pfl-research's environment (default .venv-pfl)"
    )
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rounds, args.out)
        return
    skipped = {"flower": args.skip_flower, "pfl": args.skip_pfl}
    engines = [e for e in ENGINES if not skipped.get(e)]
    python = pfl_python(args.pfl_python) if "pfl" in engines else sys.executable
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory() as folder:
        if "pfl" in engines:
            write_pfl_inputs(zipf_clicks(), args.rounds, Path(folder) / "pfl-inputs.npz")
        for run in range(args.runs):
            for engine in engines:
                runs[engine].append(measured(engine, args.rounds, folder, python))
                seconds = runs[engine][-1]["seconds_per_round"]
                print(f"run {run + 1} {engine}: {json.dumps(seconds)} s / round", flush=True)
    reference = runs["batched"][0]["model"]
    result: dict = {}
    for engine, results in runs.items():
        model = results[0]["model"]
        result[engine] = {
            **{
                f"{clock}_s_per_round": statistics.median(
                    r["seconds_per_round"][clock] for r in results
                )
                for clock in results[0]["seconds_per_round"]
            },
            "per_run": [r["seconds_per_round"] for r in results],
            "peak_tree_rss_mb": max(r["peak_tree_rss_bytes"] for r in results) / 2**20,
            "peak_process_rss_mb": max(r["ru_maxrss_bytes"] for r in results) / 2**20,
            "max_model_diff_vs_batched": max(
                float(np.abs(model[n] - reference[n]).max()) for n in reference
            ),
        }
    for engine in engines:
        for clock in ("wall", "cpu"):
            if f"{clock}_s_per_round" in result[engine]:
                ratio = result[engine][f"{clock}_s_per_round"]
                result[engine][f"{clock}_x_batched"] = (
                    ratio / result["batched"][f"{clock}_s_per_round"]
                )
    for clock in ("wall", "cpu"):
        pairs = zip(runs["batched"], runs["sequential"], strict=True)
        result[f"sequential_vs_batched_per_run_{clock}"] = [
            s["seconds_per_round"][clock] / b["seconds_per_round"][clock] for b, s in pairs
        ]
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
