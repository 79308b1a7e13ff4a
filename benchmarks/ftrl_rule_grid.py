"""How fedsub's rule for the capped sparse DP-FTRL-FedSubAvg (``dp/selection.py``
``capped_rule``) was chosen: a grid of settings on a *validation* workload, never on the
reported one (issue 50).

    python benchmarks/ftrl_rule_grid.py [--epsilons 1,2] [--runs 2] [--data-seed 1]
        [--clients-per-round 50] [--separation 50] [--set data.num_users=30000]
        [--configs blt:w25:s0.5:hc4:t3,...,rule,gaussian,dense]

The validation workload is the embedded default generated from another ``data.seed`` (1: other
users, other rows' popularity, other labels; the reported tables use data.seed 0), 150 rounds,
K = 50 of 3,000 (``--clients-per-round``), min separation 50 (``--separation``), clip 0.5, at
most 200 rows (1% of the table) a round. Each config is ``mechanism:wW:sS:hcH:tT[:mM]``
(mechanism ``tree`` or ``blt``; window W, selection share S, heat cap H, threshold T in
selection-noise standard deviations, at most M rows a round (200 unless given);
selection_bound 6); ``rule`` is ``capped_rule``'s settings at the cell's epsilon, and the
dense baselines are ``gaussian`` (DP-FedAvg, the amplified Gaussian mechanism, uniform
cohorts) and ``dense`` (DP-FTRL-FedAvg, tree noise, rows = "all", under the separation). All
cells run in one process (jax-privacy's BLT strategy and sensitivities are computed once),
each ``--runs`` times with fresh secret noise; the final test AUC of the validation
workload's test set and the rows noised a round are printed per run and as the mean, then
(``grid_stats.py``) each cell's mean, standard deviation and standard error and, where a
baseline ran at the same epsilon, Welch's test of every other config against it.

Ends with ``RESULT {json}``. ``--combine LOG ...`` runs nothing: it joins the runs of the
``RESULT`` lines of earlier invocations on one workload (several batches of one cell add up)
and prints the same statistics, ending with ``STATS {json}``. ``--baselines`` names the configs
the others are compared with (``gaussian,dense`` unless given; e.g. ``rule`` to compare a
design with the rule).
"""

from __future__ import annotations

import argparse
import json
import statistics

import grid_stats
from dp_ftrl import recording, run
from fedsub.dp import selection

TABLE_ROWS = 20009  # the embedded default's table (the rule's V)


def overrides(config: str, args: argparse.Namespace, epsilon: float) -> tuple[list[str], str]:
    """The [dp] overrides of one config and the algorithm it trains."""
    separation = f"dp.min_separation={args.separation}"
    if config == "gaussian":
        return ["dp.mechanism='gaussian'", "dp.rows='all'"], "fedavg"
    if config == "dense":
        return ["dp.mechanism='ftrl-tree'", separation, "dp.rows='all'"], "fedavg"
    if config == "rule":
        rule = selection.capped_rule(
            epsilon, args.clients_per_round, 150, args.separation, TABLE_ROWS
        )
        config = (
            f"{rule.mechanism.removeprefix('ftrl-')}:w{rule.window}:s{rule.share}"
            f":hc{rule.heat_cap}:t{rule.threshold}:m{rule.max_rows}:r{rule.refresh}"
        )
    mechanism, *parts = config.split(":")
    values = {p.rstrip("0123456789."): p[len(p.rstrip("0123456789.")) :] for p in parts}
    kind = {"tree": "ftrl-tree", "blt": "ftrl-blt"}[mechanism]
    return [
        f"dp.mechanism='{kind}'",
        separation,
        "dp.rows='private'",
        f"dp.selection_window={int(values.get('w', 25))}",
        f"dp.selection_share={float(values.get('s', 0.5))}",
        f"dp.heat_cap={float(values.get('hc', 4))}",
        f"dp.selection_threshold={float(values.get('t', 3))}",
        "dp.selection_bound=6",
        f"dp.selection_max_rows={int(values.get('m', 200))}",
        *([f"dp.selection_refresh={int(values['r'])}"] if int(values.get("r", 1)) > 1 else []),
    ], "fedsubavg"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilons", type=lambda t: [float(x) for x in t.split(",")],
                        default=[1.0, 2.0])  # fmt: skip
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--data-seed", type=int, default=1)
    parser.add_argument("--clients-per-round", type=int, default=50)
    parser.add_argument("--separation", type=int, default=50)
    parser.add_argument("--configs", type=lambda t: t.split(","), default=["blt:w25:s0.5:hc4:t3"])
    parser.add_argument("--set", action="append", default=[], help="a config override")
    parser.add_argument(
        "--combine", nargs="+", metavar="LOG", help="run nothing: join these logs' RESULT lines"
    )
    parser.add_argument(
        "--baselines",
        type=lambda t: t.split(","),
        default=list(grid_stats.BASELINES),
        help="the configs every other config is compared with (default gaussian,dense)",
    )
    args = parser.parse_args()
    if args.combine:
        statistics_of(grid_stats.combine(grid_stats.read(args.combine)), args.baselines)
        return
    recording()
    base = [
        "train.rounds=150",
        f"train.clients_per_round={args.clients_per_round}",
        "execution.threads=1",
        "eval.every=150",
        f"data.seed={args.data_seed}",
        "dp.clip=0.5",
        *args.set,
    ]
    results: dict = {"settings": vars(args)}
    for config in args.configs:
        for epsilon in args.epsilons:
            dp, algorithm = overrides(config, args, epsilon)
            dp = [*dp, f"dp.target_epsilon={epsilon}"]
            cells = []
            for index in range(args.runs):
                cells.append(run([*base, *dp], algorithm))
                print(f"  {config} eps {epsilon:g} run {index + 1}: AUC "
                      f"{cells[-1]['final_test_auc']:.4f}", flush=True)  # fmt: skip
            aucs = [c["final_test_auc"] for c in cells]
            rows = [c.get("rows_noised_per_round", TABLE_ROWS) for c in cells]
            seconds = [round(c["wall_seconds"]) for c in cells]
            results[f"{config} eps={epsilon:g}"] = {"auc": aucs, "rows": rows, "overrides": dp}
            print(
                f"{config} eps {epsilon:g}: AUC mean {statistics.mean(aucs):.4f} "
                f"{[round(a, 4) for a in aucs]} rows {[round(r, 1) for r in rows]} "
                f"z {cells[0]['noise_multiplier']:.4g} eps {cells[0]['epsilon']:.4g} s {seconds}",
                flush=True,
            )
    print("RESULT " + json.dumps(results))
    if args.runs > 1:
        statistics_of(grid_stats.combine([results]), args.baselines)


def statistics_of(combined: dict, baselines: list[str]) -> None:
    """Print the cells' statistics and comparisons (``grid_stats``) and ``STATS {json}``."""
    report = grid_stats.table(combined, baselines)
    print(grid_stats.markdown(report))
    print("STATS " + json.dumps(report))


if __name__ == "__main__":
    main()
