"""benchmarks/grid_stats.py, the statistics of ftrl_rule_grid.py's cells: the summary against
the formulas written out here, Welch's test against its statistic computed by hand here
(t = d / sqrt(s1^2/n1 + s2^2/n2), Welch-Satterthwaite degrees of freedom, Student's t
distribution), the joining of several logs and the refusal of logs of different workloads."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from scipy import stats

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import grid_stats

RULE = [0.772, 0.771, 0.775, 0.769]
DENSE = [0.762, 0.770, 0.766]


def test_summary_is_the_mean_the_sample_sd_and_its_standard_error():
    out = grid_stats.summary(RULE)
    mean = sum(RULE) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in RULE) / 3)
    assert out["n"] == 4
    assert out["mean"] == pytest.approx(mean, rel=1e-12)
    assert out["sd"] == pytest.approx(sd, rel=1e-12)
    assert out["se"] == pytest.approx(sd / 2, rel=1e-12)


def test_compare_is_welchs_test_written_out():
    out = grid_stats.compare(RULE, DENSE)
    m1, m2 = sum(RULE) / 4, sum(DENSE) / 3
    v1 = sum((x - m1) ** 2 for x in RULE) / 3 / 4
    v2 = sum((x - m2) ** 2 for x in DENSE) / 2 / 3
    t = (m1 - m2) / math.sqrt(v1 + v2)
    df = (v1 + v2) ** 2 / (v1**2 / 3 + v2**2 / 2)
    assert out["difference"] == pytest.approx(m1 - m2, rel=1e-12)
    assert out["t"] == pytest.approx(t, rel=1e-10)
    assert out["df"] == pytest.approx(df, rel=1e-10)
    assert out["p_welch_greater"] == pytest.approx(stats.t.sf(t, df), rel=1e-8)
    assert out["p_welch"] == pytest.approx(2 * stats.t.sf(abs(t), df), rel=1e-8)
    half = stats.t.ppf(0.975, df) * math.sqrt(v1 + v2)
    assert out["ci95"] == pytest.approx((m1 - m2 - half, m1 - m2 + half), rel=1e-8)
    # 11 of the 12 pairs have RULE's run above (0.769 < 0.770): U = 11; of the C(7, 3) = 35
    # equally likely rank orders, one gives U = 12 and one U = 11, so the exact p is 2 / 35
    assert out["p_mannwhitney_greater"] == pytest.approx(2 / 35, rel=1e-10)


def test_compare_refuses_a_cell_of_one_run():
    with pytest.raises(ValueError, match="at least 2 runs"):
        grid_stats.compare([0.77], DENSE)


def result(seed: int, cells: dict) -> dict:
    settings = {"data_seed": seed, "clients_per_round": 50, "separation": 50, "set": []}
    return {"settings": {**settings, "runs": 2}, **cells}


def test_logs_of_one_workload_join_and_the_table_compares_each_candidate(tmp_path):
    first = result(0, {"rule eps=1": {"auc": RULE[:2], "rows": [146.7, 146.7]}})
    second = result(
        0,
        {
            "rule eps=1": {"auc": RULE[2:], "rows": [146.7, 146.7]},
            "dense eps=1": {"auc": DENSE, "rows": [20009] * 3},
            "dense eps=2": {"auc": DENSE, "rows": [20009] * 3},
        },
    )
    paths = []
    for index, one in enumerate((first, second)):
        paths.append(tmp_path / f"{index}.log")
        paths[-1].write_text("progress\nRESULT " + json.dumps(one) + "\n")
    report = grid_stats.table(grid_stats.combine(grid_stats.read(paths)))
    assert report["cells"]["rule eps=1"]["n"] == 4
    assert report["cells"]["rule eps=1"]["mean"] == pytest.approx(sum(RULE) / 4)
    assert list(report["comparisons"]) == ["rule eps=1 vs dense"]  # no gaussian, no rule at 2
    assert report["comparisons"]["rule eps=1 vs dense"] == grid_stats.compare(RULE, DENSE)
    assert "| rule eps=1 vs dense | +0.0058 |" in grid_stats.markdown(report)
    against_rule = grid_stats.table(grid_stats.combine(grid_stats.read(paths)), ["rule"])
    assert list(against_rule["comparisons"]) == ["dense eps=1 vs rule"]
    assert against_rule["comparisons"]["dense eps=1 vs rule"]["difference"] == pytest.approx(
        -report["comparisons"]["rule eps=1 vs dense"]["difference"]
    )


def test_logs_of_different_workloads_or_without_a_result_are_refused(tmp_path):
    cell = {"rule eps=1": {"auc": RULE, "rows": [1.0] * 4}}
    with pytest.raises(ValueError, match="different workloads"):
        grid_stats.combine([result(0, cell), result(1, cell)])
    empty = tmp_path / "unfinished.log"
    empty.write_text("rule eps 1 run 1: AUC 0.77\n")
    with pytest.raises(ValueError, match=r"unfinished\.log: no 'RESULT"):
        grid_stats.read([empty])
