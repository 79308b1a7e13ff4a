"""Time to target on the virtual clock (issue 51): synchronous FedAvg / FedSubAvg rounds vs
FedBuff, on the embedded default (synthetic-sparse, 3,000 users, target test AUC 0.80), all
under the same device profiles and availability trace (drawn from train.seed: [clock]'s
lognormal defaults, markov availability). Virtual seconds are simulated, so the numbers are
exact functions of the seed (no timing noise); ``--speed`` also times the batched engine
against the per-client loop (execution.backend = "sequential") on a short FedBuff run.

    .venv/bin/python benchmarks/clock_time_to_target.py [--rounds 150] [--speed]
        [--set KEY=VALUE ...]   (another workload, e.g. --set data.name='movielens-1m'
                                 --set eval.target_test_auc=0.75: the same traces)

Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import time

import fedsub
from fedsub.runs.experiment import compare

TRACE = [
    "clock.availability=markov",
    "clock.online_mean=1800.0",
    "clock.offline_mean=1800.0",
]


def run(sets: list[str]) -> dict:
    """Each algorithm's rounds and virtual seconds to target, and its final test AUC."""
    outcome = compare(fedsub.Config.from_toml(None, sets), None)
    return {
        name: {
            "rounds_to_target": entry["rounds_to_target"],
            "time_to_target": entry.get("time_to_target"),
            "final_test_auc": round(entry["final"]["test_auc"], 4),
            "final_virtual_time": round(entry["final"]["virtual_time"], 1),
        }
        for name, entry in outcome.summary["algorithms"].items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=150, help="synchronous rounds")
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--buffer", type=int, default=10)
    parser.add_argument("--speed", action="store_true", help="batched vs per-client loop")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a config override for every run (data.name, model, eval.target_test_auc)",
    )  # fmt: skip
    args = parser.parse_args()
    sync_sets = [*args.set, f"train.rounds={args.rounds}", "clock.mode=synchronous", *TRACE]
    # FedBuff: as many client updates as the synchronous run (K per round, B per step)
    steps = args.rounds * 50 // args.buffer
    buff_sets = [
        *args.set,
        f"train.rounds={steps}",
        f"eval.every={5 * 50 // args.buffer}",
        "clock.mode=fedbuff",
        f"clock.concurrency={args.concurrency}",
        f"clock.buffer_size={args.buffer}",
        *TRACE,
    ]
    over = [*sync_sets, "clock.over_selection=0.3"]
    results = {
        "synchronous": run(sync_sets),
        "synchronous, over-selection 0.3": run(over),
        "fedbuff": run(buff_sets),
    }
    sync_modes = ("synchronous", "synchronous, over-selection 0.3")
    for name in ("fedavg", "fedsubavg"):
        buff_t = results["fedbuff"][name]["time_to_target"]
        for mode in sync_modes:
            sync_t = results[mode][name]["time_to_target"]
            if sync_t and buff_t:
                results[f"{name}: {mode} / fedbuff time to target"] = round(sync_t / buff_t, 2)
    for mode in (*sync_modes, "fedbuff"):
        a, b = (results[mode][n]["time_to_target"] for n in ("fedavg", "fedsubavg"))
        if a and b:
            results[f"{mode}: fedavg / fedsubavg time to target"] = round(a / b, 2)
    if args.speed:
        results["speed"] = speed(buff_sets)
    print(json.dumps(results, indent=2))
    print("RESULT " + json.dumps(results))


def speed(buff_sets: list[str]) -> dict:
    """Wall seconds of 40 FedBuff steps, batched vs the per-client loop, in one process."""
    sets = [*buff_sets, "train.rounds=40", "eval.every=40", "train.algorithms=['fedsubavg']"]
    seconds = {}
    for backend in ("batched", "sequential"):
        started = time.perf_counter()
        compare(fedsub.Config.from_toml(None, [*sets, f"execution.backend={backend}"]), None)
        seconds[backend] = round(time.perf_counter() - started, 2)
    seconds["ratio"] = round(seconds["sequential"] / seconds["batched"], 1)
    return seconds


if __name__ == "__main__":
    main()
