"""Issue 38's privacy-utility and cost benchmark of user-level differential privacy (fedsub.dp).

    python benchmarks/dp_utility.py [--rounds 150] [--clients-per-round 50] [--clip 0.5]
                                    [--epsilons 1,2,4,8] [--sampling fixed|poisson]
                                    [--timing-rounds 40] [--repeats 3]

On the embedded default (synthetic-sparse, 3,000 users, 20,009 rows, sparse LR), same schedule
for every run:

(utility) per epsilon: DP-FedAvg (``fedavg``, rows = "all": noise on every row), DP-FedSubAvg
          (``fedsubavg``, rows = "private": rows selected privately, the private heat
          coefficient) and DP-FedAvg with private rows (``fedavg``, rows = "private"), z
          calibrated for the run (target_epsilon); and both algorithms without DP. Final and
          best test AUC, rounds to the default's target (test AUC 0.80), the epsilon reached,
          and per round the rows changed, the false positives among them, and the share of
          clipped clients.
(cost)    per-round training time of fedsubavg with rows = "private" against the same
          algorithm without DP, and of fedavg with rows = "all" against fedavg without DP:
          alternating runs (plain, DP, plain, ...), the lowest of ``--repeats`` each.

Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from fedsub.config import Config
from fedsub.dp.mechanism import DpMechanism
from fedsub.runs import experiment

STATS: list[dict] = []


def recording() -> None:
    """Record each round's mechanism statistics (the benchmark reads ``DpMechanism.last``)."""
    combine = DpMechanism.combine

    def recorded(self, update, round_index):
        out = combine(self, update, round_index)
        STATS.append(dict(vars(self.last)))
        return out

    DpMechanism.combine = recorded  # type: ignore[method-assign]


def run(overrides: list[str], algorithm: str) -> dict:
    STATS.clear()
    config = Config.from_toml(None, [*overrides, f"train.algorithms=['{algorithm}']"])
    started = time.perf_counter()
    outcome = experiment.compare(config, None)
    wall = time.perf_counter() - started
    history = outcome.histories[algorithm]
    entry = outcome.summary["algorithms"][algorithm]
    result = {
        "final_test_auc": entry["final"]["test_auc"],
        "best_test_auc": entry["best"]["test_auc"],
        "rounds_to_target": entry["rounds_to_target"],  # the default's test AUC 0.80
        "epsilon": entry.get("dp", {}).get("epsilon"),
        "noise_multiplier": entry.get("dp", {}).get("noise_multiplier"),
        "rounds": history[-1].round,
        "train_seconds_per_round": history[-1].elapsed_train_seconds / max(history[-1].round, 1),
        "wall_seconds": wall,
    }
    if STATS:
        result["rows_changed_per_round"] = statistics.mean(s["rows_changed"] for s in STATS)
        result["false_positives_per_round"] = statistics.mean(s["false_positives"] for s in STATS)
        result["touched_rows_per_round"] = statistics.mean(s["touched_rows"] for s in STATS)
        members = sum(s["members"] for s in STATS)
        result["clipped_share"] = sum(s["clipped"] for s in STATS) / max(members, 1)
        result["largest_coefficient"] = max(s["largest_coefficient"] for s in STATS)
    return result


def utility(args: argparse.Namespace, base: list[str]) -> dict:
    results: dict = {"no-dp": {}}
    for algorithm in ("fedavg", "fedsubavg"):
        results["no-dp"][algorithm] = run(base, algorithm)
        print("no dp", algorithm, results["no-dp"][algorithm], flush=True)
    for epsilon in args.epsilons:
        dp = [
            "dp.mechanism='gaussian'",
            f"dp.target_epsilon={epsilon}",
            f"dp.clip={args.clip}",
        ]
        row = {}
        for label, algorithm, rows in (
            ("dp-fedavg rows=all", "fedavg", "all"),
            ("dp-fedsubavg rows=private", "fedsubavg", "private"),
            ("dp-fedavg rows=private", "fedavg", "private"),
        ):
            row[label] = run([*base, *dp, f"dp.rows='{rows}'"], algorithm)
            print(f"eps {epsilon}", label, row[label], flush=True)
        results[f"epsilon={epsilon}"] = row
    return results


def cost(args: argparse.Namespace, base: list[str]) -> dict:
    timed = [*base, f"train.rounds={args.timing_rounds}", f"eval.every={args.timing_rounds}"]
    dp = ["dp.mechanism='gaussian'", "dp.noise_multiplier=1.0", f"dp.clip={args.clip}"]
    out = {}
    for algorithm, rows in (("fedsubavg", "private"), ("fedavg", "all"), ("fedavg", "private")):
        plain, private = [], []
        for _ in range(args.repeats):
            plain.append(run(timed, algorithm)["train_seconds_per_round"])
            private.append(
                run([*timed, *dp, f"dp.rows='{rows}'"], algorithm)["train_seconds_per_round"]
            )
        out[f"{algorithm} rows={rows}"] = {
            "plain_ms": 1e3 * min(plain),
            "dp_ms": 1e3 * min(private),
            "ratio": min(private) / min(plain),
        }
        print("cost", algorithm, rows, out[f"{algorithm} rows={rows}"], flush=True)
    return out


def plot(utility_results: dict, path: str, title: str) -> None:
    """Final test AUC against epsilon per method, the runs without DP as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = {k: v for k, v in utility_results.items() if k.startswith("epsilon=")}
    epsilons = [float(k.split("=")[1]) for k in rows]
    for method in next(iter(rows.values())):
        aucs = [row[method]["final_test_auc"] for row in rows.values()]
        ax.plot(epsilons, aucs, marker="o", label=method)
    for algorithm, entry in utility_results["no-dp"].items():
        ax.axhline(entry["final_test_auc"], linestyle="--", linewidth=1, color="gray")
        ax.annotate(f"{algorithm}, no DP", (epsilons[0], entry["final_test_auc"]), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("epsilon (delta = 1 / N^1.1)")
    ax.set_ylabel("final test AUC")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--clients-per-round", type=int, default=50)
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument(
        "--epsilons", type=lambda t: [float(x) for x in t.split(",")], default=[1.0, 2.0, 4.0, 8.0]
    )
    parser.add_argument("--sampling", default="fixed", choices=["fixed", "poisson"])
    parser.add_argument("--timing-rounds", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["utility", "cost"])
    parser.add_argument("--plot", help="write AUC against epsilon (PNG)")
    parser.add_argument("--replot", help="a saved 'RESULT {json}' line to plot (runs nothing)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="a config override for every run, e.g. data.num_items=100000 (a larger table)",
    )
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(Path(args.replot).read_text().split("RESULT ", 1)[1])
        shown = ("rounds", "clients_per_round", "sampling", "clip", "set")
        title = ", ".join(f"{k}={saved['settings'][k]}" for k in shown if saved["settings"].get(k))
        plot(saved["utility"], args.plot or "dp_utility.png", title)
        return
    recording()
    base = [
        f"train.rounds={args.rounds}",
        f"train.clients_per_round={args.clients_per_round}",
        f"train.sampling='{args.sampling}'",
        "execution.threads=1",
        "eval.every=10",
        *args.set,
    ]
    result: dict = {"settings": vars(args)}
    if args.only in (None, "utility"):
        result["utility"] = utility(args, base)
        if args.plot:
            shown = ("rounds", "clients_per_round", "sampling", "clip", "set")
            plot(result["utility"], args.plot, ", ".join(f"{k}={vars(args)[k]}" for k in shown))
    if args.only in (None, "cost"):
        result["cost"] = cost(args, base)
    print("RESULT " + json.dumps(result, default=lambda v: None if np.isnan(v) else v))


if __name__ == "__main__":
    main()
