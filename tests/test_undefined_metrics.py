"""Undefined metrics are null in JSON (always valid JSON) and n/a in tables; no target set
means no rounds-to-target at all."""

from __future__ import annotations

import json
import math

from fedsub.cli import main
from fedsub.engine.loop import Evaluation
from fedsub.files.json_values import dumps
from fedsub.runs.report import MetricsLog, Target, read_metrics, summary, summary_markdown


def strict_json(text: str):
    def refuse(constant: str):
        raise AssertionError(f"invalid JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def history() -> list[Evaluation]:
    return [
        Evaluation(0, {"train_loss": 0.69, "test_auc": math.nan}, 0.0),
        Evaluation(2, {"train_loss": 0.5, "test_auc": math.nan}, 1.0),
    ]


def test_nan_is_null_in_metrics_jsonl_and_nan_again_when_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for evaluation in history():
        log(evaluation)
    log.close()
    records = [strict_json(line) for line in path.read_text().splitlines()]
    assert records[0] == {"round": 0, "train_loss": 0.69, "test_auc": None, "elapsed": 0.0}
    back = read_metrics(path)
    assert math.isnan(back[1].metrics["test_auc"]) and back[1].metrics["train_loss"] == 0.5


def test_summary_json_is_valid_and_tables_say_n_a():
    target = Target(train_loss=0.6)
    result = summary({"fedavg": history()}, target)
    parsed = strict_json(dumps(result))
    assert parsed["algorithms"]["fedavg"]["final"]["test_auc"] is None
    assert "test_auc" not in parsed["algorithms"]["fedavg"]["best"]  # no defined value
    assert parsed["algorithms"]["fedavg"]["rounds_to_target"] == 2
    markdown = summary_markdown(result, target, rounds=2)
    assert "| fedavg | 2 | 0.5000 | n/a | n/a |" in markdown


def test_no_target_means_no_rounds_to_target_anywhere():
    result = summary({"fedavg": history()}, Target())
    assert result["target"] == {} and result["algorithms"]["fedavg"]["rounds_to_target"] is None
    markdown = summary_markdown(result, Target(), rounds=50)
    assert markdown.startswith("Target: no target set (no rounds to target)")
    assert "rounds to target |" not in markdown and "50+" not in markdown
    assert "| algorithm | final train loss | final test AUC | best test AUC |" in markdown


def test_a_one_class_test_split_runs_with_null_auc_end_to_end(tmp_path, capsys):
    lines = ["user,clicked,item,split"]
    for u in range(4):
        for i in range(6):
            lines.append(f"u{u},{(u + i) % 2},i{i},train")
        lines.append(f"u{u},1,i{u},test")  # every test label is 1: AUC is undefined
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    config = tmp_path / "c.toml"
    config.write_text(f"""
[data]
name = "table"
path = "{tmp_path / "t.csv"}"
client_column = "user"
label_column = "clicked"
features = ["item"]
split_column = "split"

[train]
algorithms = ["fedavg"]
rounds = 2
clients_per_round = 2
local_steps = 2
batch_size = 2

[eval]
every = 1
""")
    out = tmp_path / "out"
    assert main(["compare", str(config), "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "no target set" in printed and "Target: none" not in printed
    for line in (out / "fedavg" / "metrics.jsonl").read_text().splitlines():
        assert strict_json(line)["test_auc"] is None
    parsed = strict_json((out / "summary.json").read_text())
    assert parsed["algorithms"]["fedavg"]["final"]["test_auc"] is None
    assert "n/a" in (out / "summary.md").read_text()
