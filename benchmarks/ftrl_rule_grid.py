"""How fedsub's rule for the capped sparse DP-FTRL-FedSubAvg (``dp/selection.py``
``capped_rule``) was chosen: a grid of settings on a *validation* workload, never on the
reported one (issue 50).

    python benchmarks/ftrl_rule_grid.py [--epsilons 1,2] [--runs 2] [--data-seed 1]
        [--configs blt:w25:s0.5:hc4:t3,...]

The validation workload is the embedded default generated from another ``data.seed`` (1: other
users, other rows' popularity, other labels; the reported tables use data.seed 0), 150 rounds,
K = 50 of 3,000, min separation 50, clip 0.5, at most 200 rows (1% of the table) a round. Each
config is ``mechanism:wW:sS:hcH:tT`` (mechanism ``tree`` or ``blt``; window W, selection share
S, heat cap H, threshold T in selection-noise standard deviations; selection_bound 6). All
cells run in one process (jax-privacy's BLT strategy and sensitivities are computed once), each
``--runs`` times with fresh secret noise; the final test AUC of the validation workload's test
set and the rows noised a round are printed per run and as the mean.

Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics

from dp_ftrl import recording, run


def overrides(config: str, separation: int) -> list[str]:
    """The [dp] overrides of one ``mechanism:wW:sS:hcH:tT`` config."""
    mechanism, *parts = config.split(":")
    values = {p.rstrip("0123456789."): p[len(p.rstrip("0123456789.")) :] for p in parts}
    kind = {"tree": "ftrl-tree", "blt": "ftrl-blt"}[mechanism]
    return [
        f"dp.mechanism='{kind}'",
        f"dp.min_separation={separation}",
        "dp.rows='private'",
        f"dp.selection_window={int(values.get('w', 25))}",
        f"dp.selection_share={float(values.get('s', 0.5))}",
        f"dp.heat_cap={float(values.get('hc', 4))}",
        f"dp.selection_threshold={float(values.get('t', 3))}",
        "dp.selection_bound=6",
        "dp.selection_max_rows=200",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilons", type=lambda t: [float(x) for x in t.split(",")],
                        default=[1.0, 2.0])  # fmt: skip
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--data-seed", type=int, default=1)
    parser.add_argument("--separation", type=int, default=50)
    parser.add_argument("--configs", type=lambda t: t.split(","), default=["blt:w25:s0.5:hc4:t3"])
    args = parser.parse_args()
    recording()
    base = [
        "train.rounds=150",
        "train.clients_per_round=50",
        "execution.threads=1",
        "eval.every=150",
        f"data.seed={args.data_seed}",
        "dp.clip=0.5",
    ]
    results: dict = {"settings": vars(args)}
    for config in args.configs:
        for epsilon in args.epsilons:
            dp = [*overrides(config, args.separation), f"dp.target_epsilon={epsilon}"]
            cells = [run([*base, *dp], "fedsubavg") for _ in range(args.runs)]
            aucs = [c["final_test_auc"] for c in cells]
            rows = [c["rows_noised_per_round"] for c in cells]
            results[f"{config} eps={epsilon:g}"] = {"auc": aucs, "rows": rows}
            print(
                f"{config} eps {epsilon:g}: AUC mean {statistics.mean(aucs):.4f} "
                f"{[round(a, 4) for a in aucs]} rows {[round(r, 1) for r in rows]}",
                flush=True,
            )
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
