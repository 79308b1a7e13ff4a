"""What each ``privacy.level`` level costs per round: client compute, bytes per client, server
time. 100 clients per round on a 1,000,009-row table (synthetic-sparse with 100,000 items,
sparse LR), FedSubAvg, a few rounds per level through the real engine (``PrivateRounds``).

Levels: none; heat (per round the same as none: its cost is the one-time private heat, see
``secagg_heat.py``); download and full, each with size buckets and with randomized response.
Randomized response over a 1e6-row table requests q * 1e6 decoys per client: at the default
epsilon 4 (q = 0.14) that is 141,000 rows per client, so here ``--rr-epsilon`` (default 11.5,
q ~ 1e-4, ~100 decoys, about |S(k)|) keeps the secure sum's vectors affordable; the bytes at
epsilon 4 are also computed (no run). Heat is exact in every run (the per-round numbers do not
depend on where heat came from).

    python benchmarks/privacy_cost.py [--rounds 3] [--clients 100] [--items 100000]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.data.synthetic_sparse import SyntheticSparseOptions, generate
from fedsub.engine.in_process import train
from fedsub.engine.loop import RunControl
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.models.registry import build_model
from fedsub.privacy import private_download
from fedsub.privacy.levels import Privacy
from fedsub.privacy.private_rounds import PrivateRounds
from fedsub.privacy.sparse_secagg import secagg_bytes
from fedsub.submodel.index import SubmodelIndex


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--rr-epsilon", type=float, default=11.5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    started = time.perf_counter()
    dataset = generate(SyntheticSparseOptions(num_users=args.users, num_items=args.items), seed=0)
    index = SubmodelIndex.build(dataset)
    model = build_model("sparse-lr", dataset, {"init_std": 0.0})
    context = AlgorithmContext(dataset, index, "samples", args.clients)
    algorithm = build_algorithm("fedsubavg", context)
    table_rows = sum(dataset.table_rows.values())
    held = index.rows["features"].lengths()
    print(
        f"data: {time.perf_counter() - started:.1f} s, {table_rows} rows, mean |S(k)| "
        f"{held.mean():.0f}",
        flush=True,
    )

    runs = {
        "none": Privacy("none"),
        "heat": Privacy("heat"),
        "download-buckets": Privacy("download", download="buckets"),
        "download-rr": Privacy("download", download_epsilon=args.rr_epsilon),
        "full-buckets": Privacy("full", download="buckets"),
        "full-rr": Privacy("full", download_epsilon=args.rr_epsilon),
    }
    warm_up = Schedule(
        1, args.clients, LocalWork(10, 5, ClientStep(0.1)), seed=0, settings=(Privacy("none"),)
    )
    train(model, algorithm, dataset, index, warm_up)
    levels = {}
    for name, privacy in runs.items():
        stages: list[PrivateRounds] = []
        schedule = Schedule(
            args.rounds,
            args.clients,
            LocalWork(10, 5, ClientStep(0.1)),
            seed=0,
            settings=(privacy,),
        )
        control = RunControl(watch={"private_rounds": stages.append})
        started = time.perf_counter()
        train(model, algorithm, dataset, index, schedule, control=control)
        wall = (time.perf_counter() - started) / args.rounds
        costs = stages[0].costs.as_json()
        per_client = costs["training_seconds_per_round"] / args.clients
        levels[name] = {
            **costs,
            "client_compute_seconds_per_client_round": (
                per_client + costs["privacy_client_seconds_per_client_round"]
            ),
            "round_wall_seconds": wall,
        }
        if privacy.randomized:
            levels[name]["epsilon"] = privacy.download_epsilon
            levels[name]["decoy_probability"] = privacy.decoy
        print(name, json.dumps(levels[name]), flush=True)

    # randomized response at epsilon 4 over the whole table: bytes only (computed)
    q4 = Privacy("full").decoy
    request = 0.9 * held.mean() + q4 * (table_rows - held.mean())
    union = table_rows * (1 - (1 - q4) ** args.clients)  # nearly every row
    at_eps4 = {
        "decoy_probability": q4,
        "request_rows_per_client": request,
        "request_id_bytes_up_per_client_round": 8 * request,
        "row_bytes_down_per_client_round": 4 * request,
        "full_secagg_bytes_up_per_client_round": secagg_bytes(args.clients, int(union) + 1)["up"],
    }
    result = {
        "clients_per_round": args.clients,
        "table_rows": table_rows,
        "mean_rows_per_client": float(held.mean()),
        "rounds": args.rounds,
        "levels": levels,
        "randomized_response_at_epsilon_4": at_eps4,
        "epsilon_check": private_download.epsilon_of(0.9, q4),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
