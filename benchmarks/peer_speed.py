"""Issue 28's peer benchmark: the peer workload (engine_speed.py's (a)) on fedsub's batched
backend, fedsub's per-client loop (the sequential backend), pfl-research's simulation and
Flower's, side by side in one invocation; per-round time and peak memory of each.

    python benchmarks/peer_speed.py [--runs 3] [--rounds 50] [--skip-flower]

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

pfl (``pfl[pytorch]`` 0.6, the ``bench`` extra) is run as its documentation sets up a
simulation: a ``FederatedDataset`` whose ``make_dataset_fn`` builds a user's ``Dataset``, a
user sampler callable, a ``PyTorchModel`` around a ``torch.nn.Module`` with ``loss`` and
``metrics``, local ``torch.optim.SGD``, central SGD with learning rate 1 (the average model
difference applied as is: FedAvg), ``FederatedAveraging`` with ``NNAlgorithmParams`` /
``NNTrainHyperParams`` (``local_num_steps`` 10, ``local_batch_size`` 5), a
``SimulatedBackend`` in one process (pfl's users run one after another in a worker; several
workers need several processes, as fedsub's torchrun split). What is fedsub's is only the data:
the sampler returns fedsub's cohort and each user's ``PyTorchTensorDataset`` holds that
round's 50 samples in fedsub's order, both computed before the clock starts.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from engine_speed import LR, ROUNDS, SEED, STEPS, B, K, flower_run
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.algorithms.sampling import uniform_cohort
from fedsub.engine.execution import Execution
from fedsub.engine.loop import initial_params, train
from fedsub.engine.schedule import ClientStep, Schedule
from fedsub.engine.shuffle import cohort_schedules
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.submodel.index import SubmodelIndex
from workloads import zipf_clicks

ENGINES = ("batched", "sequential", "pfl", "flower")


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
        rounds, K, STEPS, B, ClientStep(LR), SEED, execution=Execution(backend=backend)
    )
    clock = RoundTimes()
    params = train(model, algorithm, dataset, index, schedule, on_round=clock.stamp)
    final = {
        "table": params.tables["features"].numpy().reshape(-1),
        "bias": params.dense["bias"].numpy(),
    }
    return clock.steady(), final


class PflSparseLR(torch.nn.Module):
    """fedsub's sparse LR as the ``torch.nn.Module`` pfl trains: one weight per id (an
    ``EmbeddingBag`` summing a sample's ids) and a bias; ``loss`` and ``metrics`` as pfl
    asks."""

    def __init__(self, table: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weights = torch.nn.EmbeddingBag.from_pretrained(table, freeze=False, mode="sum")
        self.bias = torch.nn.Parameter(bias.clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights(ids).squeeze(-1) + self.bias

    def loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self(ids), labels)

    @torch.no_grad()
    def metrics(self, ids: torch.Tensor, labels: torch.Tensor) -> dict:
        from pfl.metrics import Weighted

        total = F.binary_cross_entropy_with_logits(self(ids), labels, reduction="sum")
        return {"loss": Weighted(float(total), len(labels))}


def pfl_run(dataset, rounds: int = ROUNDS) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """FedAvg in pfl's simulation; returns the steady per-round times and the final model."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.pytorch import PyTorchTensorDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.model.pytorch import PyTorchModel

    n = dataset.num_clients
    ids = torch.from_numpy(dataset.train.ids["features"].values.reshape(len(dataset.train), -1))
    labels = torch.from_numpy(dataset.train.labels)
    offsets = dataset.client_offsets
    # fedsub's cohorts and each member's sample order for every round, before the clock
    cohorts = [uniform_cohort(SEED, r, n, K) for r in range(1, rounds + 1)]
    user_data = {}
    for r, cohort in enumerate(cohorts, start=1):
        counts = torch.from_numpy(offsets[cohort + 1] - offsets[cohort])
        orders = cohort_schedules(SEED, r, torch.from_numpy(cohort), counts, STEPS, B).numpy()
        for client, order in zip(cohort.tolist(), orders, strict=True):
            rows = torch.from_numpy(offsets[client] + order.reshape(-1))
            user_data[r, client] = (ids[rows], labels[rows])
    queue = [(r, int(k)) for r, cohort in enumerate(cohorts, start=1) for k in cohort]
    position = iter(queue)

    def user_sampler():  # pfl draws the cohort one user at a time: fedsub's, in order
        return next(position)

    def make_dataset_fn(user):
        return PyTorchTensorDataset(tensors=user_data[user], user_id=str(user[1]))

    federated = FederatedDataset(make_dataset_fn, user_sampler)
    start = initial_params(
        SparseLogisticRegression(dict(dataset.table_rows)),
        Schedule(1, K, STEPS, B, ClientStep(LR), SEED),
    )
    module = PflSparseLR(start.tables["features"], start.dense["bias"])
    model = PyTorchModel(
        model=module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
    )
    clock = RoundTimes()

    class RoundClock(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            clock.stamp()
            return super().on_train_begin(model=model)

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            clock.stamp()
            return False, super().after_central_iteration(
                aggregate_metrics, model, central_iteration=central_iteration
            )[1]

    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds,
            evaluation_frequency=rounds,  # iteration 0 only (each user before / after)
            train_cohort_size=K,
            val_cohort_size=0,
        ),
        backend=SimulatedBackend(training_data=federated, val_data=federated),
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=None, local_learning_rate=LR, local_batch_size=B, local_num_steps=STEPS
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=None),
        callbacks=[RoundClock()],
    )
    clock.wall, clock.cpu = clock.wall[1:], clock.cpu[1:]  # from on_train_begin
    final = {
        "table": module.weights.weight.detach().numpy().reshape(-1).copy(),
        "bias": module.bias.detach().numpy().copy(),
    }
    return clock.steady(), final


def run_engine(engine: str, rounds: int) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    dataset = zipf_clicks()
    if engine in ("batched", "sequential"):
        return fedsub_run(dataset, engine, rounds)
    if engine == "pfl":
        return pfl_run(dataset, rounds)
    # Flower's clients run in Ray workers: its CPU time is not this process's
    seconds, (table, bias) = flower_run(dataset, rounds=rounds)
    return {"wall": seconds}, {"table": np.asarray(table).reshape(-1), "bias": np.asarray(bias)}


def child(engine: str, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    seconds, final = run_engine(engine, rounds)
    np.savez(out, **final)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds_per_round": seconds, "ru_maxrss_bytes": peak}))


def measured(engine: str, rounds: int, folder: str) -> dict:
    """One fresh process running ``engine``; its tree's peak resident memory sampled."""
    import psutil

    out = str(Path(folder) / f"{engine}.npz")
    command = [sys.executable, __file__, "--child", engine, "--rounds", str(rounds), "--out", out]
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
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rounds, args.out)
        return
    engines = [e for e in ENGINES if not (args.skip_flower and e == "flower")]
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory() as folder:
        for run in range(args.runs):
            for engine in engines:
                runs[engine].append(measured(engine, args.rounds, folder))
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
