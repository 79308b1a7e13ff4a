"""Issue 50's comparison: DP-FTRL (``dp.mechanism = "ftrl-tree"``, no sampling assumed) against
the amplified Gaussian mechanism (``"gaussian"``, epsilon resting on secret uniform cohorts),
dense (DP-FedAvg, rows = "all") and sparse (DP-FedSubAvg, rows = "private").

    python benchmarks/dp_ftrl.py [--rounds 150] [--clients-per-round 50] [--clip 0.5]
                                 [--epsilons 1,2,4,8] [--separation 50] [--window 25]
                                 [--bound 6] [--heat-cap 4] [--timing-rounds 40]

On the embedded default (synthetic-sparse, 3,000 users, 20,009 rows, sparse LR), the same
schedule for every run, z calibrated for the run (dp.target_epsilon): final test AUC, the
epsilon reached, rows noised per round (and false positives), and the per-round training
time against the same algorithm without DP (``cost``: median rounds after a warm-up, wall and
CPU seconds, ``--repeats`` alternating pairs of runs in this process). DP-FTRL runs with
dp.min_separation = b (each user at most once every b rounds, enforced by the cohort draw),
accounted with no sampling; the windowed variant is fedsub's design (dp.selection_window,
dp.heat_cap: dp/ftrl.py), and so is the capped one (dp.selection_max_rows: at most
``--max-rows`` rows of each windowed selection, those of the largest noisy values; its own
``--capped-window``, ``--capped-heat-cap``, ``--capped-share``). ``--methods`` runs only the
methods whose labels start with one of its comma-separated prefixes; ``--no-plain`` skips the
runs without DP; ``--rule-epsilon E`` adds the capped rule's form (``selection.capped_rule`` at
epsilon E for the schedule: the form fedsub recommends).

Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

from fedsub.config import Config
from fedsub.dp import selection
from fedsub.dp.ftrl import FtrlMechanism
from fedsub.dp.mechanism import DpMechanism
from fedsub.runs import experiment

STATS: list[dict] = []


def recording() -> None:
    """Record each round's mechanism statistics (``last``) for both mechanisms."""
    for kind in (DpMechanism, FtrlMechanism):
        combine = kind.combine

        def recorded(self, update, round_index, combine=combine):
            out = combine(self, update, round_index)
            STATS.append(dict(vars(self.last)))
            return out

        kind.combine = recorded  # type: ignore[method-assign]


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
        "epsilon": entry.get("dp", {}).get("epsilon"),
        "noise_multiplier": entry.get("dp", {}).get("noise_multiplier"),
        "train_seconds_per_round": history[-1].elapsed_train_seconds / max(history[-1].round, 1),
        "wall_seconds": wall,
    }
    if STATS:
        result["rows_noised_per_round"] = statistics.mean(s["rows_changed"] for s in STATS)
        result["false_positives_per_round"] = statistics.mean(s["false_positives"] for s in STATS)
        result["touched_rows_per_round"] = statistics.mean(s["touched_rows"] for s in STATS)
    return result


def methods(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(label, algorithm, [dp] overrides) of the DP methods compared."""
    out = [
        ("DP-FedAvg gaussian rows=all", "fedavg", ["dp.mechanism='gaussian'", "dp.rows='all'"]),
        (
            "DP-FedSubAvg gaussian rows=private",
            "fedsubavg",
            ["dp.mechanism='gaussian'", "dp.rows='private'"],
        ),
    ]
    for mechanism in args.ftrl_mechanisms:  # --ftrl-mechanisms: the tree, BLT noise or both
        out += ftrl_methods(args, mechanism)
    if args.rule_epsilon:  # --rule-epsilon: the capped rule's form (dp/selection.py)
        out.append(rule_method(args, args.rule_epsilon))
    if args.methods:  # --methods: the labels starting with one of these
        return [m for m in out if any(m[0].startswith(w) for w in args.methods)]
    return out


def ftrl_methods(args: argparse.Namespace, mechanism: str) -> list[tuple[str, str, list[str]]]:
    """The DP-FTRL rows with ``mechanism``'s noise (labels of "ftrl-blt" say BLT)."""
    ftrl = [f"dp.mechanism='{mechanism}'", f"dp.min_separation={args.separation}"]
    name = "DP-FTRL" if mechanism == "ftrl-tree" else "DP-FTRL(BLT)"
    return [
        (f"{name}-FedAvg rows=all", "fedavg", [*ftrl, "dp.rows='all'"]),
        (f"{name}-FedSubAvg rows=private", "fedsubavg", [*ftrl, "dp.rows='private'"]),
        (
            f"{name}-FedSubAvg windowed w={args.window}",
            "fedsubavg",
            [
                *ftrl,
                "dp.rows='private'",
                f"dp.selection_window={args.window}",
                f"dp.selection_bound={args.bound}",
                f"dp.heat_cap={args.heat_cap}",
            ],
        ),
        (
            f"{name}-FedSubAvg capped M={args.max_rows} w={args.capped_window} "
            f"s={args.capped_share} heat_cap={args.capped_heat_cap}",
            "fedsubavg",
            [
                *ftrl,
                "dp.rows='private'",
                f"dp.selection_window={args.capped_window}",
                f"dp.selection_bound={args.bound}",
                f"dp.heat_cap={args.capped_heat_cap}",
                f"dp.selection_max_rows={args.max_rows}",
                f"dp.selection_share={args.capped_share}",
            ],
        ),
    ]


def rule_method(args: argparse.Namespace, epsilon: float) -> tuple[str, str, list[str]]:
    """The capped sparse DP-FTRL-FedSubAvg with ``selection.capped_rule``'s settings at
    ``epsilon`` for this schedule (the form fedsub recommends; ftrl_rule_grid.py's ``rule``)."""
    rule = selection.capped_rule(
        epsilon, args.clients_per_round, args.rounds, args.separation, TABLE_ROWS
    )
    return (
        f"rule eps={epsilon:g} ({rule.mechanism}, w={rule.window}, M={rule.max_rows})",
        "fedsubavg",
        rule.overrides(args.separation),
    )


TABLE_ROWS = 20009  # the embedded default's table (the rule's V)


def utility(args: argparse.Namespace, base: list[str]) -> dict:
    results: dict = {}
    if not args.no_plain:
        results["no-dp"] = {a: run(base, a) for a in ("fedavg", "fedsubavg")}
        print("no dp", results["no-dp"], flush=True)
    for epsilon in args.epsilons:
        row = {}
        for label, algorithm, dp in methods(args):
            budget = [f"dp.target_epsilon={epsilon}", f"dp.clip={args.clip}"]
            row[label] = run([*base, *dp, *budget], algorithm)
            print(f"eps {epsilon}", label, row[label], flush=True)
        results[f"epsilon={epsilon}"] = row
    return results


WARMUP_ROUNDS = 5  # cost: rounds left out of a run's per-round times (caches, first draws)
BLOCK = 3  # cost: the rounds a run takes in a turn (``Lockstep``)


class Lockstep:
    """Two runs in two threads taking turns ``block`` rounds at a time (a baton: only the
    holder runs, the other waits on its semaphore), so private and plain rounds are timed
    within a fraction of a second of each other, under the same load. Each round is timed
    from the moment its thread takes the baton (or ends its previous round) to the end of the
    round (``on_round``): wall seconds (``time.perf_counter``) and the thread's own CPU
    seconds (``time.thread_time``: neither the other run's thread nor other processes). A
    block's first round refills the caches the other run evicted (``round_pairs`` leaves it
    out); turns of one round would time every round that way, which favours the run with the
    larger working set (DP-FedAvg rows = "all" measured 1.24x turn by turn, 1.31-1.33x in
    turns of 2 or 3 rounds, 1.34x in turns of 10 and 1.35x in whole runs), while long turns
    let a burst of other processes' work fall on one run's turn (turns of 10: 1.12-1.39x
    between sittings)."""

    def __init__(self, block: int = BLOCK) -> None:
        self.block = block  # rounds per turn
        self.turn = [threading.Semaphore(0), threading.Semaphore(0)]
        self.done = [False, False]
        self.times: list[list[tuple[float, float]]] = [[], []]
        self.errors: list[BaseException] = []

    def _now(self) -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def _body(self, side: int, overrides: list[str], algorithm: str) -> None:
        self.turn[side].acquire()
        started = self._now()

        def handoff(_name: str, _round: int) -> None:
            nonlocal started
            ended = self._now()
            self.times[side].append((ended[0] - started[0], ended[1] - started[1]))
            if not self.done[1 - side] and len(self.times[side]) % self.block == 0:
                self.turn[1 - side].release()
                self.turn[side].acquire()
            started = self._now()

        try:
            config = Config.from_toml(None, [*overrides, f"train.algorithms=['{algorithm}']"])
            experiment.compare(config, None, on_round=handoff)
        except BaseException as error:  # reported by run() in the main thread
            self.errors.append(error)
        finally:
            self.done[side] = True
            self.turn[1 - side].release()

    def run(self, runs: list[tuple[list[str], str]], first: int) -> list[list[tuple[float, float]]]:
        """Each run's per-round (wall, CPU) seconds; side ``first`` takes the first turn."""
        threads = [threading.Thread(target=self._body, args=(side, *runs[side])) for side in (0, 1)]
        for thread in threads:
            thread.start()
        self.turn[first].release()
        for thread in threads:
            thread.join()
        if self.errors:
            raise self.errors[0]
        return self.times


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


SEEDED = "dp.randomness='seeded'"  # cost: the same noise, selection and cohorts every sitting


def round_pairs(plain: list[str], noised: list[str], algorithm: str, repeats: int) -> dict:
    """``repeats`` lockstep pairs of runs (``Lockstep``; the side that goes first alternates)
    after a discarded pair (the process's first DP calls: imports, caches); repeat i
    runs with train.seed = i and seeded DP streams (``SEEDED``: the same code, but the same
    work every sitting: a secret stream selects a different number of rows each run). Every
    kept round (after ``WARMUP_ROUNDS``; neither a turn's first round nor the last round, with
    its evaluation) is paired with the other run's round of the same index."""
    Lockstep().run([(plain, algorithm), ([*noised, SEEDED], algorithm)], 0)  # discarded
    wall: list[tuple[float, float]] = []
    cpu: list[tuple[float, float]] = []
    per_repeat = []
    for repeat in range(repeats):
        seed = f"train.seed={repeat}"
        runs = [([*plain, seed], algorithm), ([*noised, SEEDED, seed], algorithm)]
        times = Lockstep().run(runs, first=repeat % 2)
        # after the warm-up, not a turn's first round (caches refilled), not the last round's
        # evaluation
        kept = [i for i in range(WARMUP_ROUNDS, len(times[0]) - 1) if i % BLOCK]
        pairs = [(times[0][i], times[1][i]) for i in kept]
        wall += [(p[0], n[0]) for p, n in pairs]
        cpu += [(p[1], n[1]) for p, n in pairs]
        per_repeat.append(statistics.median(n[1] / p[1] for p, n in pairs))
    return {"wall": wall, "cpu": cpu, "per_repeat_cpu_ratio": per_repeat}


def cost(args: argparse.Namespace, base: list[str]) -> dict:
    """Per-round time with DP against the same algorithm and schedule without it, the two runs
    in lockstep (``Lockstep``: ``BLOCK`` plain rounds, ``BLOCK`` private rounds, ...),
    ``--repeats`` pairs of runs; each round of one paired with the same round of the other,
    the ratio the median of the round pairs' ratios with its interquartile range
    (``ratio_iqr``, ``cpu_ratio_iqr``), in wall and in the threads' CPU seconds; beside it
    the ratio of the two sides' lower quartiles (``cpu_ratio_lower_quartiles``), the medians
    of each repeat's CPU ratio (``cpu_ratio_repeats``) and the load average."""
    timed = [*base, f"train.rounds={args.timing_rounds}", f"eval.every={args.timing_rounds}"]
    out = {}
    for label, algorithm, dp in methods(args):
        noised = [*timed, *dp, "dp.noise_multiplier=1.0", f"dp.clip={args.clip}"]
        timing = round_pairs(timed, noised, algorithm, args.repeats)
        entry: dict = {"rounds_paired": len(timing["wall"])}
        for unit, key in (("", "wall"), ("cpu_", "cpu")):
            pairs = timing[key]
            q1, ratio, q3 = quartiles([n / p for p, n in pairs])
            entry[f"plain_{unit}ms"] = 1e3 * statistics.median(p for p, _ in pairs)
            entry[f"dp_{unit}ms"] = 1e3 * statistics.median(n for _, n in pairs)
            entry[f"{unit}ratio"] = ratio
            entry[f"{unit}ratio_iqr"] = [q1, q3]
            # the lower quartiles' ratio: other processes only add time, so the faster rounds
            # of each side are the least disturbed
            lower = [quartiles([t[side] for t in pairs])[0] for side in (0, 1)]
            entry[f"{unit}ratio_lower_quartiles"] = lower[1] / lower[0]
        entry["cpu_ratio_repeats"] = timing["per_repeat_cpu_ratio"]
        entry["load_average"] = os.getloadavg()[0]
        out[label] = entry
        print("cost", label, out[label], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--clients-per-round", type=int, default=50)
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument(
        "--epsilons", type=lambda t: [float(x) for x in t.split(",")], default=[1.0, 2.0, 4.0, 8.0]
    )
    parser.add_argument("--separation", type=int, default=50)
    parser.add_argument("--window", type=int, default=25, help="dp.selection_window")
    parser.add_argument("--bound", type=float, default=6.0, help="dp.selection_bound (windowed)")
    parser.add_argument("--heat-cap", type=float, default=4.0, help="dp.heat_cap (windowed)")
    parser.add_argument("--max-rows", type=int, default=200, help="dp.selection_max_rows (capped)")
    parser.add_argument("--capped-window", type=int, default=10, help="(capped)")
    parser.add_argument("--capped-heat-cap", type=float, default=16.0, help="(capped)")
    parser.add_argument(
        "--capped-share", type=float, default=0.25, help="dp.selection_share (capped)"
    )
    parser.add_argument(
        "--methods",
        type=lambda t: t.split(","),
        default=[],
        help="only the methods whose labels start with one of these (comma-separated)",
    )
    parser.add_argument("--no-plain", action="store_true", help="skip the runs without DP")
    parser.add_argument(
        "--rule-epsilon",
        type=float,
        default=0.0,
        help="also run the capped rule's form (selection.capped_rule) at this epsilon",
    )
    parser.add_argument("--timing-rounds", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["utility", "cost"])
    parser.add_argument(
        "--ftrl-mechanisms",
        type=lambda t: t.split(","),
        default=["ftrl-tree"],
        help="DP-FTRL's noise: ftrl-tree, ftrl-blt (BLT, jax-privacy) or both, comma-separated",
    )
    parser.add_argument("--set", action="append", default=[], help="a config override")
    args = parser.parse_args()
    recording()
    base = [
        f"train.rounds={args.rounds}",
        f"train.clients_per_round={args.clients_per_round}",
        "execution.threads=1",
        "eval.every=10",
        *args.set,
    ]
    result: dict = {"settings": vars(args)}
    if args.only in (None, "utility"):
        result["utility"] = utility(args, base)
    if args.only in (None, "cost"):
        result["cost"] = cost(args, base)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
