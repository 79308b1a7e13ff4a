"""Issue 5's engine benchmarks: per-round time of fedsub's batched and sequential backends
against a Flower simulation (Ray backend, FedAvg), table-size scaling, peak memory.

    python benchmarks/engine_speed.py [--runs 3] [--skip-flower] [--only a|b|c|d] [--threads 1]

(a) sparse LR, FedAvg, N = 1,000 clients of 100 samples, 20,000 ids, 5 ids per sample,
    Zipf(1.1), K = 50, B = 5, I = 10, lr 0.1, 50 rounds. Steady-state per-round time = the
    median over rounds 2..50 of one run; the figure is the median of ``--runs`` runs.
    Flower gets the same data, model, local batches (fedsub's seeded shuffles) and cohorts:
    its FedAvg's ``configure_fit`` picks fedsub's cohort for the round; aggregation is stock.
(b) per-round time, same cohort, embedding-LR with 1e5, 1e6 and 1e7 rows of dimension 16.
(c) peak resident memory of (b) for each table size, in a fresh process.
(d) DIN (embedding 18) on the Amazon-like shape (1,859 users, Zipf items, ragged histories),
    FedAvg, K = 100, B = 4, I = 10: batched vs sequential.
"""

from __future__ import annotations

import argparse
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

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.algorithms.sampling import uniform_cohort
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.engine.shuffle import cohort_schedules
from fedsub.models.din import DIN
from fedsub.models.embedding_lr import EmbeddingLogisticRegression
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.submodel.index import SubmodelIndex
from workloads import amazon_like, zipf_clicks

ROUNDS, K, B, STEPS, LR, SEED = 50, 50, 5, 10, 0.1, 0


def fedsub_run(dataset, model, backend: str, rounds: int = ROUNDS, k: int = K, b: int = B):
    index = SubmodelIndex.build(dataset)
    algorithm = build_algorithm("fedavg", AlgorithmContext(dataset, index, "samples", k))
    on = Execution(backend=backend)
    schedule = Schedule(rounds, k, LocalWork(STEPS, b, ClientStep(LR)), SEED, execution=on)
    stamps = [time.perf_counter()]
    params = train(
        model,
        algorithm,
        dataset,
        index,
        schedule,
        on_round=lambda r: stamps.append(time.perf_counter()),
    )
    per_round = np.diff(stamps)
    return float(np.median(per_round[1:])), params


def interleaved(first, second, runs: int) -> tuple[list, list]:
    """``runs`` results of each, alternating, so that a slower or faster spell of a shared
    machine falls on both sides of a ratio."""
    pairs = [(first(), second()) for _ in range(runs)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def flower_run(dataset, rounds: int = ROUNDS):
    """The same FedAvg in a Flower simulation; returns steady per-round time and the model."""
    import flwr
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import GetPropertiesIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    rows = dataset.table_rows["features"]
    model = SparseLogisticRegression({"features": rows})

    class LRClient(NumPyClient):
        def __init__(self, partition: int) -> None:
            self.partition = partition

        def get_properties(self, config):
            return {"partition": self.partition}

        def fit(self, parameters, config):
            from fedsub.client.work import round_chain
            from fedsub.engine.local_sgd import local_sgd
            from fedsub.submodel.params import Params

            params = Params(
                {"features": torch.from_numpy(parameters[0].copy())},
                {"bias": torch.from_numpy(parameters[1].copy())},
            )
            samples = dataset.client(self.partition)
            order = cohort_schedules(
                SEED,
                int(config["round"]),
                torch.tensor([self.partition]),
                torch.tensor([len(samples)]),
                STEPS,
                B,
            )[0].numpy()
            local_sgd(model, params, samples, order, round_chain(()), LR)
            new = [params.tables["features"].numpy(), params.dense["bias"].numpy()]
            return new, len(samples), {}

    def client_fn(context):
        return LRClient(int(context.node_config["partition-id"])).to_client()

    stamps: list[float] = []
    final: list = []

    class SameCohortFedAvg(FedAvg):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.partition_of: dict[int, str] = {}

        def configure_fit(self, server_round, parameters, client_manager):
            stamps.append(time.perf_counter())
            client_manager.wait_for(dataset.num_clients)
            proxies = client_manager.all()
            if not self.partition_of:
                for cid, proxy in proxies.items():
                    reply = proxy.get_properties(GetPropertiesIns({}), None, 0)
                    self.partition_of[int(reply.properties["partition"])] = cid
                stamps[-1] = time.perf_counter()  # mapping nodes once is not a round's work
            cohort = uniform_cohort(SEED, server_round, dataset.num_clients, K)
            from flwr.common import FitIns

            fit = FitIns(parameters, {"round": server_round})
            return [(proxies[self.partition_of[int(k)]], fit) for k in cohort]

        def aggregate_fit(self, server_round, results, failures):
            aggregated = super().aggregate_fit(server_round, results, failures)
            if server_round == rounds:
                final.append(parameters_to_ndarrays(aggregated[0]))
                stamps.append(time.perf_counter())
            return aggregated

    initial = [np.zeros((rows, 1), np.float32), np.zeros(1, np.float32)]

    def server_fn(context):
        strategy = SameCohortFedAvg(
            fraction_fit=K / dataset.num_clients,
            fraction_evaluate=0.0,
            min_available_clients=dataset.num_clients,
            initial_parameters=ndarrays_to_parameters(initial),
        )
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))

    run_simulation(
        server_app=ServerApp(server_fn=server_fn),
        client_app=ClientApp(client_fn=client_fn),
        num_supernodes=dataset.num_clients,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    per_round = np.diff(stamps)
    del flwr
    return float(np.median(per_round[1:])), final[0]


def scaling_run(rows: int) -> dict:
    dataset = zipf_clicks(rows=rows, seed=1)
    model = EmbeddingLogisticRegression(dict(dataset.table_rows), embedding_dim=16)
    seconds, _ = fedsub_run(dataset, model, "batched", rounds=20)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "rows": rows,
        "seconds_per_round": seconds,
        "peak_rss_bytes": peak,
        "model_bytes": rows * 16 * 4,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip-flower", action="store_true")
    parser.add_argument("--only", choices=["a", "b", "c", "d"])
    parser.add_argument("--scaling-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the fedsub runs (default 1, as each Flower client gets 1 CPU; "
        "0 = torch's default)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.scaling_child:
        print(json.dumps(scaling_run(args.scaling_child)))
        return
    result: dict = {}
    if args.only in (None, "a"):
        dataset = zipf_clicks()
        model = SparseLogisticRegression(dict(dataset.table_rows))
        fedsub_run(dataset, model, "batched", rounds=3)  # warm-up
        batched, sequential = interleaved(
            lambda: fedsub_run(dataset, model, "batched"),
            lambda: fedsub_run(dataset, model, "sequential"),
            args.runs,
        )
        a = {
            "batched_s_per_round": statistics.median(t for t, _ in batched),
            "sequential_s_per_round": statistics.median(t for t, _ in sequential),
            "batched_vs_sequential_per_pair": sorted(
                s / b for (b, _), (s, _) in zip(batched, sequential, strict=True)
            ),
        }
        a["batched_vs_sequential"] = a["sequential_s_per_round"] / a["batched_s_per_round"]
        reference = batched[0][1]
        a["batched_vs_sequential_max_model_diff"] = max(
            float((reference.state_dict()[n] - p).abs().max())
            for n, p in sequential[0][1].state_dict().items()
        )
        if not args.skip_flower:
            flower = [flower_run(dataset) for _ in range(args.runs)]
            a["flower_s_per_round"] = statistics.median(t for t, _ in flower)
            a["batched_vs_flower"] = a["flower_s_per_round"] / a["batched_s_per_round"]
            table, bias = flower[0][1]
            a["flower_max_model_diff"] = max(
                float(np.abs(reference.tables["features"].numpy() - table).max()),
                float(np.abs(reference.dense["bias"].numpy() - bias).max()),
            )
        result["a"] = a
        print("(a)", json.dumps(a))
    if args.only in (None, "b", "c"):
        runs = []
        for rows in (10**5, 10**6, 10**7):
            child = subprocess.run(
                [sys.executable, __file__, "--scaling-child", str(rows)],
                capture_output=True,
                text=True,
                check=True,
                env=os.environ,
            )
            runs.append(json.loads(child.stdout.strip().splitlines()[-1]))
            print("(b/c)", runs[-1])
        result["b"] = {
            "seconds_per_round": {r["rows"]: r["seconds_per_round"] for r in runs},
            "ratio_1e7_vs_1e5": runs[-1]["seconds_per_round"] / runs[0]["seconds_per_round"],
        }
        result["c"] = {
            "peak_rss_bytes": {r["rows"]: r["peak_rss_bytes"] for r in runs},
            "model_bytes": {r["rows"]: r["model_bytes"] for r in runs},
        }
    if args.only in (None, "d"):
        dataset = amazon_like()
        model = DIN(dict(dataset.table_rows), embedding_dim=18)
        fedsub_run(dataset, model, "batched", rounds=2, k=100, b=4)  # warm-up
        batched, sequential = interleaved(
            lambda: fedsub_run(dataset, model, "batched", 6, 100, 4)[0],
            lambda: fedsub_run(dataset, model, "sequential", 4, 100, 4)[0],
            args.runs,
        )
        d = {
            "batched_s_per_round": statistics.median(batched),
            "sequential_s_per_round": statistics.median(sequential),
        }
        d["batched_vs_sequential"] = d["sequential_s_per_round"] / d["batched_s_per_round"]
        result["d"] = d
        print("(d)", json.dumps(d))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
