"""Issue 15's GPU benchmarks (figures g1..g7), through fedsub's own round loop.

    python benchmarks/gpu.py [--device cuda] [--small] [--only g1,g3] [--rounds 20] [--threads N]
                             [--compile] [--graphs]

(g1) the issue's probe workload: embedding-LR (sum-pooled rows of dimension 16 + a linear
     head), FedSubAvg with sample-weighted coefficients, N = 100,000 clients with lognormal
     sizes (~4.9M samples), 10 Zipf(1.1) ids per sample, I = 10, B = 5, a 1e7-row table:
     steady per-round time (median of rounds 3..R) at K = 100, 1,000 and 10,000; with
     ``--compile`` also with ``execution.compile = "on"`` (K = 100 is the launch-bound case),
     ``--graphs`` with ``"cuda-graphs"`` (the round replayed as one CUDA graph, any torch).
(g2) the same on a 1e8-row table at K = 1,000 (ratio to g1's K = 1,000).
(g3) a 1e9 x 16 table with ``execution.table_placement = "host"`` at K = 1,000 (ratio to g1's
     device-resident K = 1,000); "not available" when the config refuses the key.
(g4) DIN (embedding 18) on the Amazon-like shape, FedAvg (as engine_speed.py's (d)),
     K = 100, B = 4, I = 10: ``--device`` vs
     fedsub's CPU backend on all of the machine's cores.
(g5) the per-client loop a user would write (benchmarks/plain_loop.py: clients one after
     another in plain torch, same model, data and device) vs fedsub batched at K = 1,000:
     per-round times and the max |model difference| after the same rounds (<= 1e-5).
(g6) peak device memory of g1 at its largest K vs tables + server state + training data +
     an estimate of the cohort's working set (+ 1 GiB).
(g7) ``benchmarks/distributed_speed.py --nproc 2`` in a subprocess, its RESULT as reported.

``--small`` shrinks every workload to CPU size (a smoke run: the figures then say nothing
about a GPU). Per-round times synchronise the device at every round's end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from fedsub import config as config_lib
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.algorithms.sampling import uniform_cohort
from fedsub.device import resolve_device
from fedsub.engine import server_round
from fedsub.engine.execution import Compile, CudaGraphs, Execution
from fedsub.engine.in_process import train
from fedsub.engine.initial import initial_params
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.errors import FedsubError
from fedsub.models.din import DIN
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.profiling import RoundProfile, profiling
from fedsub.profiling import table as profile_table
from fedsub.runs.run_setup import schedule_of
from fedsub.submodel.device_data import DeviceData
from fedsub.submodel.index import SubmodelIndex
from plain_loop import PlainFederation, plain_round
from workloads import amazon_like, lognormal_zipf

STEPS, BATCH, LR, SEED, DIM = 10, 5, 0.1, 0, 16
FULL = {
    "clients": 100_000,
    "mean_samples": 49.0,
    "rows": 10**7,
    "cohorts": (100, 1_000, 10_000),
    "g2_rows": 10**8,
    "g3_rows": 10**9,
    "k": 1_000,
    "din_users": 1_859,
    "din_k": 100,
    "g5_rounds": 3,
}
SMALL = {
    "clients": 2_000,
    "mean_samples": 20.0,
    "rows": 10**5,
    "cohorts": (10, 100, 300),
    "g2_rows": 10**6,
    "g3_rows": 10**6,
    "k": 100,
    "din_users": 200,
    "din_k": 20,
    "g5_rounds": 3,
}
FIGURES = ("g1", "g2", "g3", "g4", "g5", "g6", "g7")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def timed_run(model, dataset, index, schedule: Schedule, algorithm: str = "fedsubavg") -> tuple:
    """(median seconds of rounds 3..R, every round's seconds, final model); FedSubAvg with
    sample-weighted heat unless ``algorithm`` says otherwise."""
    built = build_algorithm(
        algorithm, AlgorithmContext(dataset, index, "samples", schedule.clients_per_round)
    )
    stamps: list[float] = []

    def on_round(r: int) -> None:
        synchronize(schedule.execution.device)
        stamps.append(time.perf_counter())

    synchronize(schedule.execution.device)
    stamps.append(time.perf_counter())
    params = train(model, built, dataset, index, schedule, on_round=on_round)
    per_round = np.diff(stamps)
    steady = per_round[2:] if len(per_round) > 2 else per_round
    return float(np.median(steady)), per_round.tolist(), params


def schedule(device: torch.device, k: int, rounds: int, batch: int = BATCH) -> Schedule:
    return Schedule(
        rounds,
        k,
        LocalWork(STEPS, batch, ClientStep(LR)),
        SEED,
        execution=Execution(device=device),
        eval_every=10**9,
    )


def embedding_lr(dataset) -> EmbeddingLogisticRegression:
    return EmbeddingLogisticRegression(dict(dataset.table_rows), embedding_dim=DIM)


def probe_data(size: dict, rows: int):
    dataset = lognormal_zipf(
        clients=size["clients"], mean_samples=size["mean_samples"], rows=rows, seed=SEED
    )
    return dataset, SubmodelIndex.build(dataset)


def capture_of(name: str, device: torch.device) -> Compile | CudaGraphs:
    """``execution.compile``'s value ``name`` ("on" or "cuda-graphs") as the engine takes it."""
    return Compile.for_device(device) if name == "on" else CudaGraphs()


def g1(size: dict, device: torch.device, rounds: int, data, captures: tuple[str, ...] = ()) -> dict:
    """``captures``: each K also with these ``execution.compile`` values ("on": torch.compile;
    "cuda-graphs": the round replayed as a CUDA graph), run right after the eager one: the
    steady per-round time, the first round (which compiles or records) and the largest
    difference of the model from the eager one."""
    dataset, index = data
    model = embedding_lr(dataset)
    per_k: dict = {}
    captured_k: dict = {c: {} for c in captures}
    for k in size["cohorts"]:
        eager = schedule(device, k, rounds)
        seconds, _, eager_model = timed_run(model, dataset, index, eager)
        per_k[k] = seconds
        print(f"(g1) K = {k}: {seconds * 1e3:.2f} ms / round", flush=True)
        for name in captures:
            on = dataclasses.replace(eager.execution, compile=capture_of(name, device))
            captured = dataclasses.replace(eager, execution=on)
            c_seconds, c_rounds, c_model = timed_run(model, dataset, index, captured)
            difference = max(
                float((a - c_model.state_dict()[n].to(a.device)).abs().max())
                for n, a in eager_model.state_dict().items()
            )
            captured_k[name][k] = {
                "ms_per_round": c_seconds * 1e3,
                "speedup": seconds / c_seconds,
                "first_round_s": c_rounds[0],
                "max_abs_difference": difference,
            }
            print(f"(g1) K = {k} compile={name}: {json.dumps(captured_k[name][k])}", flush=True)
    return {
        "rows": size["rows"],
        "clients": dataset.num_clients,
        "samples": len(dataset.train),
        "ms_per_round": {k: s * 1e3 for k, s in per_k.items()},
        "client_steps_per_s": {k: k * STEPS / s for k, s in per_k.items()},
        "targets_ms": {"K=100": 3.0, "K=10000": 10.0} if size is FULL else None,
        "captured": captured_k,
    }


def g1_profile(
    size: dict, device: torch.device, rounds: int, data, capture: str | None = None
) -> dict:
    """Where g1's round goes at each K: fedsub's per-phase profile (``--profile``; the device
    synchronized at every phase boundary, so the phases are slower than g1's figures, but
    their shares show the fixed per-round cost), and torch's own profile of one K's rounds
    (the operators with the most host time and the kernels launched per round).
    ``capture``: profile the rounds with this ``execution.compile`` value instead of eager."""
    dataset, index = data
    model = embedding_lr(dataset)
    out: dict = {"compile": capture or "off"}

    def schedule_at(k: int) -> Schedule:
        eager = schedule(device, k, rounds)
        if capture is None:
            return eager
        on = dataclasses.replace(eager.execution, compile=capture_of(capture, device))
        return dataclasses.replace(eager, execution=on)

    for k in size["cohorts"]:
        record = RoundProfile(synchronize=lambda: synchronize(device))
        with profiling(record):
            timed_run(model, dataset, index, schedule_at(k))
        out[str(k)] = record.as_json()
        print(profile_table({f"(g1 profile) K = {k}": out[str(k)]}), flush=True)
    k = size["cohorts"][0]
    out.update(
        torch_profile(
            lambda: timed_run(model, dataset, index, schedule_at(k)), rounds, device, "g1"
        )
    )
    return out


def torch_profile(run, rounds: int, device: torch.device, figure: str) -> dict:
    """torch's profile of ``run()`` (``rounds`` rounds): the host copies and device reads by
    caller, the operators with the most host time, the kernels with the most device time and
    the kernels launched per round."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)  # Python frames in stacks
    with torch.profiler.profile(
        activities=activities, with_stack=True, experimental_config=verbose
    ) as prof:
        run()
    out: dict = {}
    averages = prof.key_averages()
    by_stack = prof.key_averages(group_by_stack_n=6)
    # copies between host and device and the reads that wait for the device, by caller
    waits = ("aten::copy_", "aten::_local_scalar_dense", "aten::nonzero", "aten::item")
    copies = [e for e in by_stack if e.key in waits]
    copies.sort(key=lambda e: e.cpu_time_total, reverse=True)
    out["host_copies_by_caller"] = [
        {"op": e.key, "calls_per_round": e.count / rounds, "host_ms_per_round":
            e.cpu_time_total / 1e3 / rounds, "stack": [f for f in e.stack if "fedsub" in f]}
        for e in copies[:12]
    ]  # fmt: skip
    for entry in out["host_copies_by_caller"]:
        print(f"({figure} profile) copy:", json.dumps(entry), flush=True)
    host = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    out["torch_top_host_ops"] = [
        {"op": e.key, "calls_per_round": e.count / rounds, "self_host_ms_per_round":
            e.self_cpu_time_total / 1e3 / rounds}
        for e in host
    ]  # fmt: skip
    kernels = [e for e in averages if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA")]  # fmt: skip
    out["cuda_kernels_per_round"] = sum(e.count for e in kernels) / rounds
    slow = sorted(kernels, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)
    out["cuda_top_kernels"] = [
        {"kernel": e.key[:90], "calls_per_round": e.count / rounds, "device_ms_per_round":
            getattr(e, "self_device_time_total", 0) / 1e3 / rounds}
        for e in slow[:10]
    ]  # fmt: skip
    print(f"({figure} profile) torch:", json.dumps(out["torch_top_host_ops"][:8]), flush=True)
    print(f"({figure} profile) kernels:", json.dumps(out["cuda_top_kernels"]), flush=True)
    print(
        f"({figure} profile) CUDA kernels per round: {out['cuda_kernels_per_round']:.0f}",
        flush=True,
    )
    return out


def g4_profile(size: dict, device: torch.device, rounds: int) -> dict:
    """Where DIN's round (g4) goes on ``device``: fedsub's phases (the device synchronized at
    each) and torch's profile."""
    dataset = amazon_like(users=size["din_users"])
    index = SubmodelIndex.build(dataset)
    model = DIN(dict(dataset.table_rows), embedding_dim=18)
    at = schedule(device, size["din_k"], rounds, 4)
    record = RoundProfile(synchronize=lambda: synchronize(device))
    with profiling(record):
        timed_run(model, dataset, index, at, "fedavg")
    out: dict = {"phases": record.as_json()}
    print(profile_table({f"(g4 profile) K = {size['din_k']}": out["phases"]}), flush=True)
    out.update(
        torch_profile(lambda: timed_run(model, dataset, index, at, "fedavg"), rounds, device, "g4")
    )
    return out


def g2(size: dict, device: torch.device, rounds: int, g1_k_ms: float | None) -> dict:
    dataset, index = probe_data(size, size["g2_rows"])
    seconds, _, _ = timed_run(
        embedding_lr(dataset), dataset, index, schedule(device, size["k"], rounds)
    )
    out = {"rows": size["g2_rows"], "k": size["k"], "ms_per_round": seconds * 1e3}
    if g1_k_ms:
        out["vs_g1"] = seconds * 1e3 / g1_k_ms
    return out


def host_placement(device: torch.device, base: Schedule) -> Schedule | str:
    """``base`` with ``execution.table_placement = "host"`` as the config gives it, or why not."""
    try:
        configured = schedule_of(
            config_lib.load(
                None, ['execution.table_placement="host"', f'execution.device="{device}"']
            )
        )
    except FedsubError as error:
        return f"not available: the config refuses it ({error})"
    placement = configured.execution.table_placement
    on_host = dataclasses.replace(base.execution, table_placement=placement)
    return dataclasses.replace(base, execution=on_host)


def g3(size: dict, device: torch.device, rounds: int, g1_k_ms: float | None) -> dict:
    placed = host_placement(device, schedule(device, size["k"], rounds))
    if isinstance(placed, str):
        return {"status": placed}
    dataset, index = probe_data(size, size["g3_rows"])
    seconds, _, _ = timed_run(embedding_lr(dataset), dataset, index, placed)
    out = {"rows": size["g3_rows"], "k": size["k"], "ms_per_round": seconds * 1e3}
    if g1_k_ms:
        out["vs_device_resident_g1"] = seconds * 1e3 / g1_k_ms
    return out


def g4(size: dict, device: torch.device, rounds: int, capture: str | None = None) -> dict:
    """``capture``: DIN on the device also with this ``execution.compile`` value."""
    dataset = amazon_like(users=size["din_users"])
    index = SubmodelIndex.build(dataset)
    model = DIN(dict(dataset.table_rows), embedding_dim=18)
    k = size["din_k"]
    eager = schedule(device, k, rounds, 4)
    on_device, _, eager_model = timed_run(model, dataset, index, eager, "fedavg")
    captured: dict = {}
    if capture is not None:
        on = dataclasses.replace(eager.execution, compile=capture_of(capture, device))
        seconds, per_round, model_c = timed_run(
            model, dataset, index, dataclasses.replace(eager, execution=on), "fedavg"
        )
        captured = {
            "compile": capture,
            "device_ms_per_round": seconds * 1e3,
            "first_round_s": per_round[0],
            "max_abs_difference": max(
                float((a - model_c.state_dict()[n].to(a.device)).abs().max())
                for n, a in eager_model.state_dict().items()
            ),
        }
        print(f"(g4) compile={capture}: {json.dumps(captured)}", flush=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        cpu, _, _ = timed_run(
            model, dataset, index, schedule(torch.device("cpu"), k, rounds, 4), "fedavg"
        )
    finally:
        torch.set_num_threads(threads)
    return {
        "k": k,
        "device_ms_per_round": on_device * 1e3,
        "cpu_all_cores_ms_per_round": cpu * 1e3,
        "cpu_threads": os.cpu_count(),
        "speedup": cpu / on_device,
        **(
            {"captured": captured, "captured_speedup": cpu / captured["device_ms_per_round"] * 1e3}
            if captured
            else {}
        ),
        **({"note": "--device is the CPU too: not a GPU figure"} if device.type == "cpu" else {}),
    }


def g5(size: dict, device: torch.device, data) -> dict:
    dataset, index = data
    k, rounds = size["k"], size["g5_rounds"]
    model = embedding_lr(dataset)
    plan = schedule(device, k, rounds)
    _, fedsub_rounds, fedsub_model = timed_run(model, dataset, index, plan)
    start = initial_params(model, plan)
    table, weight, bias = start.tables["features"], start.dense["weight"], start.dense["bias"]
    plain = PlainFederation.of(dataset, device, table.dtype)
    plain_rounds = []
    for r in range(1, rounds + 1):
        synchronize(device)
        begun = time.perf_counter()
        cohort = uniform_cohort(SEED, r, dataset.num_clients, k)
        plain_round(table, weight, bias, plain, cohort, SEED, r, STEPS, BATCH, LR)
        synchronize(device)
        plain_rounds.append(time.perf_counter() - begun)
    diff = max(
        float((table - fedsub_model.tables["features"]).abs().max()),
        float((weight - fedsub_model.dense["weight"]).abs().max()),
        float((bias - fedsub_model.dense["bias"]).abs().max()),
    )
    plain_s = statistics.median(plain_rounds[1:])
    fedsub_steady = statistics.median(fedsub_rounds[1:])
    return {
        "k": k,
        "rounds": rounds,
        "plain_loop_ms_per_round": plain_s * 1e3,
        "fedsub_ms_per_round": fedsub_steady * 1e3,
        "speedup": plain_s / fedsub_steady,
        "max_model_diff": diff,
        "same_model_1e-5": diff <= 1e-5,
    }


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def g6(size: dict, device: torch.device, rounds: int, data) -> dict:
    dataset, index = data
    k = max(size["cohorts"])
    model = embedding_lr(dataset)
    if device.type != "cuda":
        return {
            "status": "not available: no CUDA device",
            "cpu_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    timed_run(model, dataset, index, schedule(device, k, min(rounds, 5)))
    peak = torch.cuda.max_memory_allocated(device)
    params = initial_params(model, schedule(torch.device("cpu"), k, 1))
    tables = tensor_bytes(params.tensors())
    algorithm = build_algorithm("fedsubavg", AlgorithmContext(dataset, index, "samples", k))
    coefficients = tensor_bytes((algorithm.aggregation.coefficients or {}).values())
    view = DeviceData.of(dataset, index, device, torch.float32)
    data_bytes = tensor_bytes(
        [
            view.labels,
            view.dense,
            view.client_offsets,
            view.counts,
            *(r.values for r in view.local_ids.values()),
            *(r.offsets for r in view.local_ids.values()),
            *(r.values for r in view.rows.values()),
            *(r.offsets for r in view.rows.values()),
        ]
    )
    # The cohort's working set, estimated: per pulled row ~8 row-sized tensors (pulled, leaf,
    # gradient, update, delta, weighted delta, aggregate, server step), per visited id ~6 int64
    # (ids, owners, positions), per visited sample ~4 pooled rows (features and gradients).
    counts = dataset.sample_counts()
    clients = uniform_cohort(SEED, 1, dataset.num_clients, k)
    pulled = int(np.diff(index.rows["features"].offsets)[clients].sum())
    visited = k * STEPS * BATCH
    ids = visited * int(np.diff(dataset.train.ids["features"].offsets[:2])[0])
    working = 8 * pulled * DIM * 4 + 6 * ids * 8 + 4 * visited * DIM * 4
    budget = tables + coefficients + data_bytes + working + 2**30
    return {
        "k": k,
        "peak_bytes": peak,
        "tables_bytes": tables,
        "server_state_bytes": coefficients,
        "training_data_bytes": data_bytes,
        "cohort_working_set_estimate_bytes": working,
        "cohort_rows": pulled,
        "mean_samples": float(counts.mean()),
        "budget_bytes": budget,
        "within_budget": peak <= budget,
    }


def g7() -> dict:
    script = Path(__file__).parent / "distributed_speed.py"
    if not script.exists():
        return {"status": "not available: benchmarks/distributed_speed.py is missing"}
    child = subprocess.run(
        [sys.executable, str(script), "--nproc", "2"],
        capture_output=True,
        text=True,
        env=os.environ,
        timeout=3600,
    )
    lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    if child.returncode != 0 or not lines:
        return {"status": f"failed (exit {child.returncode})", "stderr": child.stderr[-2000:]}
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help='execution.device: "cpu", "cuda", ...')
    parser.add_argument("--small", action="store_true", help="CPU-sized workloads (smoke run)")
    parser.add_argument("--only", default=",".join(FIGURES), help="e.g. g1,g3")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per timing (0: 20, 6)")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default; 1 on a shared machine, where idle-spinning "
        "threads slow small kernels down 10x); g4's CPU side always uses every core",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help='g1 also with execution.compile = "on" (the local step captured by torch.compile; '
        "CUDA graphs on a GPU): its per-round time and its model's difference from eager",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help='g1 also with execution.compile = "cuda-graphs" (the round recorded with '
        "torch.cuda.graph and replayed, no compiler; CUDA only)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="g1 (and g4) also profiled: fedsub's phases per K and torch's operators at the "
        "smallest K (DIN's at its K)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    only = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = sorted(set(only) - set(FIGURES))
    if unknown:
        parser.error(f"--only: unknown figure(s) {', '.join(unknown)}; known: {', '.join(FIGURES)}")
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        parser.error(f"--device {args.device!r}: {error}")
    size = SMALL if args.small else FULL
    rounds = args.rounds or (6 if args.small else 20)
    result: dict = {
        "device": device_name(device),
        "small": args.small,
        "host_reads_per_round": server_round.HOST_READS_PER_ROUND,
    }
    data = probe_data(size, size["rows"]) if {"g1", "g5", "g6"} & set(only) else None
    g1_k_ms = None
    if "g1" in only:
        captures = (("on",) if args.compile else ()) + (("cuda-graphs",) if args.graphs else ())
        result["g1"] = g1(size, device, rounds, data, captures)
        g1_k_ms = result["g1"]["ms_per_round"].get(size["k"])
        if args.profile:
            graphs = "cuda-graphs" if args.graphs else None
            result["g1_profile"] = g1_profile(size, device, rounds, data, graphs)
    steps = {
        "g2": lambda: g2(size, device, rounds, g1_k_ms),
        "g3": lambda: g3(size, device, rounds, g1_k_ms),
        "g4": lambda: g4(size, device, rounds, "cuda-graphs" if args.graphs else None),
        "g5": lambda: g5(size, device, data),
        "g6": lambda: g6(size, device, rounds, data),
        "g7": g7,
    }
    for name, run in steps.items():
        if name in only:
            result[name] = run()
            print(f"({name})", json.dumps(result[name]), flush=True)
    if args.profile and "g4" in only:
        result["g4_profile"] = g4_profile(size, device, rounds)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
