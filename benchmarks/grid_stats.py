"""The statistics of ``benchmarks/ftrl_rule_grid.py``'s cells (issue 50): each cell's mean,
sample standard deviation and standard error of the final test AUC over its runs, and a Welch
test (scipy's ``ttest_ind(equal_var=False)``; a Mann-Whitney U test beside it, which assumes no
normality) of each candidate config against each dense baseline at the same epsilon.

The runs of two cells are independent (each run draws its own secret noise and, under the
separation or the uniform sampling, its own secret cohorts; only the workload, ``data.seed``, is
shared), so nothing pairs run i of one cell with run i of another: the comparison is unpaired.

Invocations of ``ftrl_rule_grid.py`` on the same workload combine: ``ftrl_rule_grid.py --combine
LOG ...`` reads each log's ``RESULT {json}`` line, joins the runs of equal cells, and refuses
logs of different workloads (``data_seed``, ``clients_per_round``, ``separation``, ``set``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

from scipy import stats

BASELINES = ("gaussian", "dense")  # the dense rows: DP-FedAvg amplified, DP-FTRL-FedAvg
WORKLOAD = ("data_seed", "clients_per_round", "separation", "set")


def summary(aucs: Sequence[float]) -> dict:
    """n, mean, sample standard deviation (n - 1) and standard error of one cell's runs."""
    n = len(aucs)
    sd = statistics.stdev(aucs) if n > 1 else math.nan
    return {"n": n, "mean": statistics.fmean(aucs), "sd": sd, "se": sd / math.sqrt(n)}


def compare(candidate: Sequence[float], baseline: Sequence[float]) -> dict:
    """Welch's t-test (two-sided, and one-sided: candidate > baseline) and Mann-Whitney U's
    one-sided p of one cell against another, with the difference of the means."""
    if len(candidate) < 2 or len(baseline) < 2:
        raise ValueError(
            f"a comparison needs at least 2 runs a cell, got {len(candidate)} and {len(baseline)}"
        )
    two = stats.ttest_ind(candidate, baseline, equal_var=False)
    one = stats.ttest_ind(candidate, baseline, equal_var=False, alternative="greater")
    low, high = two.confidence_interval(0.95)
    u = stats.mannwhitneyu(candidate, baseline, alternative="greater")
    return {
        "difference": statistics.fmean(candidate) - statistics.fmean(baseline),
        "ci95": (float(low), float(high)),
        "t": float(two.statistic),
        "df": float(two.df),
        "p_welch": float(two.pvalue),
        "p_welch_greater": float(one.pvalue),
        "p_mannwhitney_greater": float(u.pvalue),
    }


def split(key: str) -> tuple[str, float]:
    """(config, epsilon) of a cell key ``"{config} eps={epsilon:g}"``."""
    config, _, epsilon = key.rpartition(" eps=")
    if not config:
        raise ValueError(f"cell key {key!r} is not '<config> eps=<epsilon>'")
    return config, float(epsilon)


def combine(results: Iterable[dict]) -> dict:
    """The runs of every cell of several ``RESULT`` objects joined, per cell key; refuses
    results of different workloads."""
    merged: dict = {}
    workload = None
    for result in results:
        settings = result["settings"]
        this = {key: settings[key] for key in WORKLOAD}
        if workload is not None and this != workload:
            raise ValueError(f"results of different workloads: {workload} and {this}")
        workload = this
        for key, cell in result.items():
            if key == "settings":
                continue
            split(key)
            entry = merged.setdefault(key, {"auc": [], "rows": []})
            entry["auc"].extend(cell["auc"])
            entry["rows"].extend(cell["rows"])
    return {"settings": workload, "cells": merged}


def read(paths: Iterable[str | Path]) -> list[dict]:
    """The ``RESULT {json}`` object of each log (a log without one is refused by name)."""
    out = []
    for path in paths:
        lines = [x for x in Path(path).read_text().splitlines() if x.startswith("RESULT ")]
        if not lines:
            raise ValueError(f"{path}: no 'RESULT {{json}}' line (did the run finish?)")
        out.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return out


def table(combined: dict, baselines: Sequence[str] = BASELINES) -> dict:
    """Per cell the summary, and per candidate cell (a config that is not a baseline) its
    comparison with each baseline run at the same epsilon."""
    cells = combined["cells"]
    by = {split(key): cell for key, cell in cells.items()}
    out: dict = {"settings": combined["settings"], "cells": {}, "comparisons": {}}
    for (config, epsilon), cell in sorted(by.items(), key=lambda item: (item[0][1], item[0][0])):
        key = f"{config} eps={epsilon:g}"
        out["cells"][key] = {**summary(cell["auc"]), "rows": statistics.fmean(cell["rows"])}
        if config in baselines:
            continue
        for baseline in baselines:
            if (baseline, epsilon) in by:
                out["comparisons"][f"{key} vs {baseline}"] = compare(
                    cell["auc"], by[baseline, epsilon]["auc"]
                )
    return out


def markdown(report: dict) -> str:
    """The cells (mean ± sd, se, n) and the comparisons as two markdown tables."""
    lines = ["| cell | n | mean ± sd | se | rows / round |", "|---|---|---|---|---|"]
    for key, c in report["cells"].items():
        lines.append(
            f"| {key} | {c['n']} | {c['mean']:.4f} ± {c['sd']:.4f} | {c['se']:.4f} "
            f"| {c['rows']:.1f} |"
        )
    lines += [
        "",
        "| comparison | difference | 95% CI (Welch) | t (df) | p two-sided | p one-sided "
        "| p Mann-Whitney one-sided |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, c in report["comparisons"].items():
        lines.append(
            f"| {key} | {c['difference']:+.4f} | [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}] "
            f"| {c['t']:.2f} ({c['df']:.1f}) | {c['p_welch']:.2g} | {c['p_welch_greater']:.2g} "
            f"| {c['p_mannwhitney_greater']:.2g} |"
        )
    return "\n".join(lines)
