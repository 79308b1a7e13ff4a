"""What a run leaves behind: metrics.jsonl per algorithm, summary.json, summary.md, curves.png."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsub.engine.loop import Evaluation
from fedsub.files.atomic_files import save_figure_atomic
from fedsub.files.atomic_files import write_atomic as write_atomic  # where results' writers find it
from fedsub.files.json_values import dumps, metrics_from_json

CURVE_METRICS = (("train_loss", "train loss"), ("test_loss", "test loss"), ("test_auc", "test AUC"))
CURVE_FALLBACK = ("test_accuracy", "test accuracy")  # when no AUC (multiclass)
# (metric, column title, also show the best value)
TABLE_METRICS = (
    ("train_loss", "train loss", False),
    ("test_loss", "test loss", False),
    ("test_accuracy", "test accuracy", True),
    ("test_auc", "test AUC", True),
    ("gap_loss", "gap loss (train - test)", False),
    ("gap_accuracy", "gap accuracy (train - test)", False),
    ("epsilon", "epsilon", False),  # [dp]: the privacy spent (fedsub/dp)
    ("virtual_time", "virtual time (s)", False),  # [clock]: simulated seconds (fedsub/clock)
)
# reported, never "best": the least epsilon is round 0's, as is the least virtual time
NOT_BEST = ("epsilon", "virtual_time")
VIRTUAL_TIME = "virtual_time"  # [clock]'s metric (fedsub/clock/synchronous.py)


@dataclass(frozen=True)
class Target:
    """The rounds-to-target criterion: every target given must be met."""

    train_loss: float | None = None
    test_auc: float | None = None

    def as_json(self) -> dict[str, float]:
        out = {}
        if self.train_loss is not None:
            out["train_loss"] = self.train_loss
        if self.test_auc is not None:
            out["test_auc"] = self.test_auc
        return out

    def met(self, metrics: dict[str, float]) -> bool:
        if self.train_loss is None and self.test_auc is None:
            return False
        ok = True
        if self.train_loss is not None:
            ok &= metrics.get("train_loss", math.inf) <= self.train_loss
        if self.test_auc is not None:
            ok &= metrics.get("test_auc", -math.inf) >= self.test_auc
        return ok

    @property
    def is_set(self) -> bool:
        return self.train_loss is not None or self.test_auc is not None

    def describe(self) -> str:
        parts = []
        if self.train_loss is not None:
            parts.append(f"train loss <= {self.train_loss:g}")
        if self.test_auc is not None:
            parts.append(f"test AUC >= {self.test_auc:g}")
        return " and ".join(parts) or NO_TARGET


NO_TARGET = "no target set"


def rounds_to_target(history: list[Evaluation], target: Target) -> int | None:
    """The first evaluated round at which the target is met, or None."""
    return next((e.round for e in history if target.met(e.metrics)), None)


def time_to_target(history: list[Evaluation], target: Target) -> float | None:
    """[clock]: the virtual time (seconds) of the first evaluation meeting the target, or None
    (not reached, or a run without the clock)."""
    met = next((e for e in history if target.met(e.metrics)), None)
    return None if met is None else met.metrics.get(VIRTUAL_TIME)


def clocked(histories: dict[str, list[Evaluation]]) -> bool:
    """Whether the runs were on the virtual clock (their evaluations carry its time)."""
    return any(h and VIRTUAL_TIME in h[0].metrics for h in histories.values())


def best_metrics(history: list[Evaluation]) -> dict[str, float]:
    """Each metric's best evaluation: the highest AUC or accuracy, the smallest train - test
    gap in absolute value (``gap_*``, signed as measured), the lowest of the others."""
    best: dict[str, float] = {}
    for name in history[0].metrics:
        if name in NOT_BEST:
            continue
        values = [e.metrics[name] for e in history if not math.isnan(e.metrics[name])]
        if not values:
            continue
        if name.startswith("gap_"):
            best[name] = min(values, key=abs)
        elif name.endswith(("auc", "accuracy")):
            best[name] = max(values)
        else:
            best[name] = min(values)
    return best


class MetricsLog:
    """``<out>/<algorithm>/metrics.jsonl``: one JSON line per evaluation, flushed as written.

    A resumed run starts the file again from the checkpoint's evaluations, so the file ends
    as an uninterrupted run's would."""

    def __init__(self, path: Path, earlier: Sequence[Evaluation] = ()) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._handle = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self.history: list[Evaluation] = []
        for evaluation in earlier:
            self(evaluation)

    def __call__(self, evaluation: Evaluation) -> None:
        self.history.append(evaluation)
        self._handle.write(dumps(evaluation.as_json()) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def summary(
    histories: dict[str, list[Evaluation]],
    target: Target,
    diverged: dict[str, tuple[int, str]] | None = None,
) -> dict:
    """summary.json: per algorithm its rounds to target (null when not reached, when no
    target is set, or when it diverged), final and best metrics, and its divergence."""
    diverged = diverged or {}
    result: dict = {
        "target": target.as_json(),
        "algorithms": {
            name: {
                "rounds_to_target": None if name in diverged else rounds_to_target(history, target),
                "diverged": (
                    {"round": diverged[name][0], "reason": diverged[name][1]}
                    if name in diverged
                    else None
                ),
                "final": history[-1].metrics,
                "best": best_metrics(history),
            }
            for name, history in histories.items()
        },
    }
    if clocked(histories):  # [clock]: the virtual seconds to target beside the rounds
        for name, history in histories.items():
            reached = None if name in diverged else time_to_target(history, target)
            result["algorithms"][name]["time_to_target"] = reached
    return result


def time_cell(entry: dict, rounds: int) -> str:
    """A time-to-target cell: virtual seconds, or 'not reached' / 'diverged'."""
    if entry.get("diverged"):
        return f"diverged at round {entry['diverged']['round']}"
    seconds = entry.get("time_to_target")
    return "not reached" if seconds is None else f"{seconds:.4g}"


def rounds_cell(reached: int | None, rounds: int) -> str:
    """A rounds-to-target cell as the papers print it: the round, or 'R+' if not reached."""
    return str(reached) if reached is not None else f"{rounds}+"


def outcome_cell(entry: dict, rounds: int) -> str:
    """An algorithm's rounds-to-target cell; 'diverged at round r' for a diverged run."""
    if entry.get("diverged"):
        return f"diverged at round {entry['diverged']['round']}"
    return rounds_cell(entry["rounds_to_target"], rounds)


def number_cell(value: float | None) -> str:
    """A metric in a table: 'n/a' when undefined (e.g. AUC with one class in the test set)."""
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.4f}"


def summary_markdown(result: dict, target: Target, rounds: int) -> str:
    names = list(result["algorithms"])
    rows = [(name, entry, rounds) for name, entry in result["algorithms"].items()]
    if not target.is_set:  # no rounds to target at all: never print 'R+' cells
        diverged = [
            f"{n}: {outcome_cell(result['algorithms'][n], rounds)}"
            for n in names
            if result["algorithms"][n].get("diverged")
        ]
        lines = ["Target: no target set (no rounds to target)", ""]
        if diverged:
            lines += ["Diverged: " + "; ".join(diverged), ""]
        return "\n".join(lines + metrics_table(rows, ["algorithm"], with_rounds=False)) + "\n"
    cells = [outcome_cell(result["algorithms"][n], rounds) for n in names]
    lines = [
        f"Target: {target.describe()} (rounds to target; '{rounds}+' = not reached in {rounds})",
        "",
        f"| | {' | '.join(names)} |",
        "|---|" + "---:|" * len(names),
        f"| rounds to target | {' | '.join(cells)} |",
    ]
    entries = [result["algorithms"][n] for n in names]
    if any("time_to_target" in e for e in entries):  # [clock]
        times = [time_cell(e, rounds) for e in entries]
        lines.append(f"| time to target (virtual s) | {' | '.join(times)} |")
    lines += [
        "",
    ]
    return "\n".join(lines + metrics_table(rows, ["algorithm"])) + "\n"


def metrics_table(rows: list[tuple], labels: list[str], with_rounds: bool = True) -> list[str]:
    """Markdown lines: per row (its label cells..., summary entry, rounds) the rounds to target
    (unless ``with_rounds`` is false) and the final (and best) value of every metric some row
    has ('n/a' where undefined)."""
    shown = [
        (m, title, with_best)
        for m, title, with_best in TABLE_METRICS
        if any(m in row[-2]["final"] for row in rows)
    ]
    columns = [*labels, *(["rounds to target"] if with_rounds else [])]
    for _, title, with_best in shown:
        columns += [f"final {title}"] + ([f"best {title}"] if with_best else [])
    lines = [f"| {' | '.join(columns)} |", "|---|" + "---:|" * (len(columns) - 1)]
    for *label, entry, rounds in rows:
        cells = [*label, *([outcome_cell(entry, rounds)] if with_rounds else [])]
        for metric, _, with_best in shown:
            cells.append(number_cell(entry["final"].get(metric)))
            if with_best:
                cells.append(number_cell(entry["best"].get(metric)))
        lines.append(f"| {' | '.join(cells)} |")
    return lines


Histories = dict[str, list[Evaluation]] | dict[str, dict[str, list[Evaluation]]]
Rounds = dict[str, int] | dict[str, dict[str, int]]


def plot_curves(
    histories: Histories,
    path: Path,
    title: str,
    target: Target | None = None,
    diverged: Rounds | None = None,
) -> None:
    """curves.png: one panel per metric; ``histories`` either maps line names to histories
    (one row of panels) or row titles to such maps (one row per title, e.g. per algorithm of
    a sweep, so that no panel holds more lines than there are values). ``diverged``, keyed
    like ``histories``: the round at which a line's run diverged (marked on its panels)."""
    fig = curves_figure(histories, title, target, diverged)
    save_figure_atomic(fig, path)
    flat = [h for row in _panel_rows(histories).values() for h in row.values()]
    if any(h and VIRTUAL_TIME in h[0].metrics for h in flat):  # [clock]: against time too
        timed = curves_figure(histories, title, target, None, x=VIRTUAL_TIME)
        save_figure_atomic(timed, path.with_name(f"{path.stem}_time{path.suffix}"))


def _panel_rows(histories: Histories | Rounds) -> dict[str, dict]:
    """One row of panels per outer key; entries not nested under one form the row ""."""
    rows: dict[str, dict] = {}
    for key, value in histories.items():
        if isinstance(value, dict):
            rows[key] = value
        else:
            rows.setdefault("", {})[key] = value
    return rows or {"": {}}


def _plotted_metrics(histories: list[list[Evaluation]]) -> list[tuple[str, str]]:
    """(metric, axis label) of each panel: the ``CURVE_METRICS`` some history has, and
    ``CURVE_FALLBACK`` when no test AUC is there."""

    def present(metric: str) -> bool:
        return any(h and metric in h[0].metrics for h in histories)

    metrics = [(m, label) for m, label in CURVE_METRICS if present(m)]
    if not present("test_auc") and present(CURVE_FALLBACK[0]):
        metrics.append(CURVE_FALLBACK)
    return metrics


def curves_figure(
    histories: Histories,
    title: str,
    target: Target | None = None,
    diverged: Rounds | None = None,
    x: str = "round",
):
    """The matplotlib figure of ``plot_curves`` (``x``: "round", or [clock]'s
    "virtual_time": the curves against simulated seconds, written to curves_time.png): each
    line's finite values (a marker on each when there are few), the target, when set, as a
    dashed horizontal line labelled with its value on its metric's panel, a diverged run's
    round as a dotted vertical line in its colour, and whole rounds on the x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = _panel_rows(histories)
    stopped = _panel_rows(diverged or {})
    metrics = _plotted_metrics([h for row in rows.values() for h in row.values()])
    targets = {} if target is None else target.as_json()
    fig, axes = plt.subplots(
        len(rows),
        len(metrics),
        figsize=(5.5 * len(metrics), 4 * len(rows)),
        squeeze=False,
    )
    for row_axes, (row_title, row) in zip(axes, rows.items(), strict=True):
        row_stopped = stopped.get(row_title, {})
        last = max([1, *(_x(e, x) for h in row.values() for e in h), *row_stopped.values()])
        for ax, (metric, label) in zip(row_axes, metrics, strict=True):
            _plot_lines(ax, row, metric, row_stopped, x)
            if metric in targets:
                ax.axhline(
                    targets[metric],
                    color="black",
                    linestyle="--",
                    linewidth=1,
                    label=f"target {targets[metric]:g}",
                )
            ax.set_xlim(0, last)
            if x == "round":
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("round" if x == "round" else "virtual time (s)")
            ax.set_ylabel(label)
            if row_title:
                ax.set_title(row_title)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _plot_lines(
    ax: Any, row: dict[str, list[Evaluation]], metric: str, stopped: dict[str, int], x: str
) -> None:
    """One panel's curves: each run's finite values of ``metric`` (a marker on each when
    there are few) and, for a run that diverged, its round as a dotted line in its colour."""
    for name, history in row.items():
        points = [
            (_x(e, x), e.metrics[metric])
            for e in history
            if metric in e.metrics and math.isfinite(e.metrics[metric])
        ]
        marker = "o" if len(points) < 8 else None
        (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, label=name)
        if name in stopped:
            ax.axvline(
                stopped[name],
                color=line.get_color(),
                linestyle=":",
                label=f"{name} diverged at round {stopped[name]}",
            )


def _x(evaluation: Evaluation, x: str) -> float:
    """An evaluation's position on the x axis: its round, or a metric (virtual time)."""
    return evaluation.round if x == "round" else evaluation.metrics.get(x, math.nan)


def read_metrics(path: Path) -> list[Evaluation]:
    """The evaluations of a finished algorithm's metrics.jsonl."""
    history = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        round_index, elapsed = record.pop("round"), record.pop("elapsed")
        history.append(Evaluation(round_index, metrics_from_json(record), elapsed))
    return history


class JsonLines:
    """An append-only JSON-lines log (e.g. rejected client updates)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(dumps(record) + "\n")
