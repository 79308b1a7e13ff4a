"""Run an experiment of the registry and judge it against the paper's numbers.

Each part runs with fedsub's own machinery (``experiment.compare`` / ``sweep`` into
``OUT/<part>/``, ``data stats``, the configs' settings, or a closed form), then its numbers go
beside the paper's (``paper_numbers.toml``) with a one-line verdict: "same ranking", "within
x%", or "differs: ..." naming the first disagreement. A part whose data are not here says
which dataset it needs and the command that fetches it. ``OUT/reproduce.json`` and
``OUT/reproduce.md`` hold every part's rows and verdict; the plots are beside them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedsub import config as config_lib
from fedsub.errors import DataError
from fedsub.json_values import dumps
from fedsub.report import write_atomic
from fedsub.reproduce import closed_forms
from fedsub.reproduce.registry import (
    SMOKE,
    ClosedForm,
    Experiment,
    Part,
    Run,
    Settings,
    Stats,
    experiment,
    paper_numbers,
)
from fedsub.reproduce.request import Request, check_request, chosen_parts, refuse_nothing_to_resume
from fedsub.reproduce.status import configs_given, status_here

Cell = int | str | None  # rounds to target: a round, "R+" (not reached in R), None (no run)
WITHIN = 0.10  # numbers closer than this (relative) are "within"


@dataclass(frozen=True)
class Folders:
    """What to do with runs already in the output folder: refuse them (the default), replace
    them (``overwrite``) or continue them (``resume``, checked to be the same run); and when
    to stop (Ctrl-C: after the current round, with a checkpoint)."""

    overwrite: bool = False
    resume: bool = False
    stop_requested: Callable[[], bool] = lambda: False


@dataclass(frozen=True)
class Trained:
    """A part's runs: results by name (algorithm, or the sweep's value), the horizon, the
    target the run used (e.g. CentralSGD's measured minimum) and the plot."""

    table: dict[str, dict]
    horizon: int
    target: dict[str, float]
    plots: list[Path]


@dataclass(frozen=True)
class PartResult:
    experiment: str
    part: str
    status: str  # "ran", "ran (smoke size)", "needs data", "cannot run"
    verdict: str
    where: str = ""  # the paper's location of the numbers
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (cell, paper, fedsub)
    plots: list[str] = field(default_factory=list)
    seconds: float = 0.0


# --- running ---------------------------------------------------------------------------------


def reproduce(
    experiment_id: str,
    out: Path,
    smoke: bool = False,
    part: str | None = None,
    data_path: str | None = None,
    overrides: Sequence[str] = (),
    configs: Path | None = None,
    folders: Folders = Folders(),
) -> list[PartResult]:
    """Run every part of the experiment (or ``part``) whose data are here; write
    ``out/reproduce.json`` and ``out/reproduce.md``. A stopped run raises ``Interrupted``
    (engine/loop.py); the same call with ``Folders(resume=True)`` continues it.

    Every option is checked before anything runs: an option no chosen part uses (``--set`` on
    a closed form, ``--data-path`` on generated data, ...), an override the parts' configs
    refuse, ``--resume`` with nothing to resume are ConfigErrors naming the flag and the part."""
    e = experiment(experiment_id)
    chosen = chosen_parts(e, part)
    named = configs is not None
    request = Request(smoke, data_path, list(overrides), configs_given(configs), named)
    check_request(e, chosen, request)
    if folders.resume:
        refuse_nothing_to_resume(e, chosen, out)
    results = [
        run_part(e, p, out, smoke, data_path, request.overrides, request.configs, folders)
        for p in chosen
    ]
    write_report(e, results, out)
    return results


def run_part(
    e: Experiment,
    part: Part,
    out: Path,
    smoke: bool,
    data_path: str | None,
    overrides: list[str],
    configs: Path,
    folders: Folders,
) -> PartResult:
    numbers = paper_numbers(e.id, part.name)
    where = numbers.where if numbers else ""
    status = status_here(part, configs, data_path)
    if status != "runs here":
        kind = "needs data" if status.startswith("needs") else "cannot run"
        return PartResult(e.id, part.name, kind, status, where, _paper_only_rows(numbers))
    started = time.perf_counter()
    folder = out / part.name
    paper = numbers.values if numbers else {}
    action = part.action
    try:
        if isinstance(action, ClosedForm):
            folder.mkdir(parents=True, exist_ok=True)
            rows, verdict, plots = _closed_form(action, folder, smoke)
        elif isinstance(action, Settings):
            rows, plots = _settings(configs / action.config, paper), []
            verdict = _settings_verdict(rows)
        elif isinstance(action, Stats):
            sets = [*action.overrides, *(action.smoke if smoke else ()), *overrides]
            rows, plots = _stats(configs / action.config, sets, data_path, folder, paper)
            verdict = _numbers_verdict(rows)
        else:
            assert isinstance(action, Run)
            trained = _train(action, configs, folder, smoke, data_path, overrides, folders)
            rows, verdict = judge(paper, trained.table, trained.horizon)
            rows = _target_rows(paper, trained.target) + rows
            plots = trained.plots
    except DataError as error:  # the data are there but not what the loader expects
        return PartResult(e.id, part.name, "cannot run", f"data error: {error}", where)
    seconds = time.perf_counter() - started
    smoke = smoke and not isinstance(action, Settings)  # a config's settings have no size
    if smoke:
        verdict = f"smoke size, not comparable: {verdict}"
    return PartResult(
        e.id,
        part.name,
        "ran (smoke size)" if smoke else "ran",
        verdict,
        where,
        rows,
        [str(p) for p in plots],
        round(seconds, 1),
    )


def _closed_form(action: ClosedForm, folder: Path, smoke: bool):
    if action.name == "example-1":
        result = closed_forms.example_1(folder, smoke)
    else:
        result = closed_forms.theorem_4(folder, smoke, decayed=action.name.endswith("decayed"))
    rows = [(cell, _number(p), _number(f)) for cell, p, f in result.rows]
    return rows, result.verdict, [result.plot]


def _run_overrides(run: Run, smoke: bool, data_path: str | None, user: list[str]) -> list[str]:
    sets = list(run.overrides)
    if smoke:
        sets += [*SMOKE, *run.smoke]
    if data_path is not None:
        sets.append(f"data.path={json.dumps(str(Path(data_path).absolute()))}")
    return sets + user


def _train(
    run: Run,
    configs: Path,
    folder: Path,
    smoke: bool,
    data_path: str | None,
    user: list[str],
    folders: Folders,
) -> Trained:
    """Train the part (a comparison or a sweep)."""
    from fedsub.experiment import compare, sweep

    path = configs / run.config
    sets = _run_overrides(run, smoke, data_path, user)
    if run.sweep is None:
        config = config_lib.load(path, sets)
        resume = folders.resume and (folder / "run.json").exists()
        outcome = compare(
            config,
            folder,
            resume=resume,
            stop_requested=folders.stop_requested,
            overwrite=folders.overwrite and not resume,
        )
        return Trained(
            dict(outcome.summary["algorithms"]),
            config.train.rounds,
            dict(outcome.summary["target"]),
            [folder / "curves.png"],
        )
    key, values = run.sweep
    if smoke and run.smoke_values is not None:
        values = run.smoke_values
    base = config_lib.apply_overrides(config_lib.read_toml(path), sets)
    config_lib.load(path, sets)  # a bad override is named before any training
    resume = folders.resume and (folder / "run.json").exists()
    sweep(
        key,
        list(values),
        base,
        folder,
        resume=resume,
        stop_requested=folders.stop_requested,
        overwrite=folders.overwrite and not resume,
        where=str(path),
    )
    table: dict[str, dict] = {}
    horizon = 0
    target: dict[str, float] = {}
    for value in values:
        summary = json.loads((folder / f"{key}={value}" / "summary.json").read_text())
        target = target or dict(summary["target"])
        entries = summary["algorithms"]
        compared = [n for n in entries if n != "central-sgd"]
        table[value] = entries[compared[0]] if len(compared) == 1 else entries
        rounds = config_lib.load(path, [*sets, f"{key}={value}"]).train.rounds
        horizon = max(horizon, rounds)
    return Trained(table, horizon, target, [folder / "curves.png"])


def _target_rows(paper: dict[str, Any], target: dict[str, float]) -> list[tuple[str, str, str]]:
    """The target the paper's rounds count to beside the one fedsub's run used (Table 2's
    train-loss target is CentralSGD's minimum, measured by each side)."""
    return [
        (f"target {metric}", _number(value), _number(target.get(metric)))
        for metric, value in paper.get("target", {}).items()
    ]


# --- judging ---------------------------------------------------------------------------------


def judge(paper: dict[str, Any], table: dict[str, dict], horizon: int) -> tuple[list, str]:
    """Rows (cell, paper, fedsub) and the verdict for every kind of number the paper gives."""
    rows: list[tuple[str, str, str]] = []
    verdicts: list[str] = []
    for kind in ("rounds_to_target", "rounds_by_value"):
        if kind in paper:
            cells = {n: _fedsub_cell(table.get(n), horizon) for n in paper[kind]}
            rows += [
                (f"rounds to target: {n}", str(p), str(cells[n])) for n, p in paper[kind].items()
            ]
            verdicts.append(rounds_verdict(paper[kind], cells))
    for at in ("best", "final"):
        for metric, by_name in paper.get(at, {}).items():
            ours = {n: _metric(table.get(n), at, metric) for n in by_name}
            rows += [
                (f"{at} {metric}: {n}", _number(p), _number(ours[n])) for n, p in by_name.items()
            ]
            verdicts.append(values_verdict(by_name, ours))
    for metric, value in paper.get("lowest", {}).items():
        values = [_metric(entry, "best", metric) for entry in table.values()]
        lowest = min((v for v in values if v is not None), default=None)
        rows.append((f"lowest {metric} over the runs", _number(value), _number(lowest)))
        verdicts.append(values_verdict({"lowest": value}, {"lowest": lowest}))
    shape = paper.get("rounds_shape")
    if shape is not None:
        cells = {n: _fedsub_cell(entry, horizon) for n, entry in table.items()}
        rows += [(f"rounds to target at {n}", "", str(c)) for n, c in cells.items()]
        verdicts.append(shape_verdict(shape, cells))
    claims = paper.get("claims")
    if claims:
        results = [claim_result(c, table, horizon) for c in claims]
        rows += [(text, "holds", outcome) for text, outcome in results]
        verdicts.append(claims_verdict(results))
    return rows, "; ".join(verdicts) or "no numbers to compare (curves written)"


def _fedsub_cell(entry: dict | None, horizon: int) -> Cell:
    if entry is None:
        return None
    if entry.get("diverged"):
        return f"diverged at {entry['diverged']['round']}"
    reached = entry.get("rounds_to_target")
    return reached if reached is not None else f"{horizon}+"


def _metric(entry: dict | None, at: str, metric: str) -> float | None:
    if entry is None:
        return None
    absolute = metric.startswith("abs_")
    value = entry.get(at, {}).get(metric.removeprefix("abs_"))
    if value is None or not math.isfinite(value):
        return None
    return abs(value) if absolute else float(value)


def _rank_value(cell: Cell) -> float:
    """A cell's place in a ranking: its round, or infinity when never reached."""
    return float(cell) if isinstance(cell, int) else math.inf


def _order(a: float, b: float) -> int:
    return (a > b) - (a < b)


def ranking(
    paper: dict[str, float], ours: dict[str, float], words: tuple[str, str] = ("before", "after")
) -> tuple[list[str], list[str]]:
    """Pairs the paper orders strictly that fedsub orders the other way (reversals) or ties;
    ``words`` say "lower" and "higher" (rounds: before / after; values: below / above)."""
    reversed_, tied = [], []
    names = [n for n in paper if n in ours]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            want, got = _order(paper[a], paper[b]), _order(ours[a], ours[b])
            if want == 0:
                continue
            first, second = (a, b) if want < 0 else (b, a)
            if got == -want:
                reversed_.append(f"{second} {words[0]} {first} (paper: {words[1]})")
            elif got == 0:
                tied.append(f"{first} ties {second}")
    return reversed_, tied


def _ranking_head(reversed_: list[str], tied: list[str]) -> str:
    if reversed_:
        more = f" and {len(reversed_) - 1} more" if len(reversed_) > 1 else ""
        return f"differs: {reversed_[0]}{more}"
    if tied:
        return f"same ranking up to ties ({tied[0]})"
    return "same ranking"


def _relative(ours: float, paper: float) -> float:
    return abs(ours - paper) / abs(paper) if paper else abs(ours - paper)


def rounds_verdict(paper: dict[str, Cell], ours: dict[str, Cell]) -> str:
    """Ranking of the rounds to target (not reached = last), then how far the cells both
    reached are apart, and the cells reached by one side only."""
    if any(c is None for c in ours.values()):
        missing = [n for n, c in ours.items() if c is None]
        return f"not comparable: fedsub ran no {', '.join(missing)}"
    p = {n: _rank_value(_parse_cell(c)) for n, c in paper.items()}
    o = {n: _rank_value(c) for n, c in ours.items()}
    head = _ranking_head(*ranking(p, o))
    both = [n for n in p if math.isfinite(p[n]) and math.isfinite(o[n])]
    parts = [head]
    if both:
        worst = max(both, key=lambda n: _relative(o[n], p[n]))
        parts.append(f"reached cells within {100 * _relative(o[worst], p[worst]):.0f}% ({worst})")
    one_side = [n for n in p if math.isfinite(p[n]) != math.isfinite(o[n])]
    if one_side:
        parts.append(f"reached by one side only: {', '.join(one_side)}")
    return ", ".join(parts)


def _parse_cell(cell: Cell) -> Cell:
    """The paper's '1000+' is 'not reached'; its numbers are rounds."""
    if isinstance(cell, str) and cell.endswith("+"):
        return cell
    return int(cell) if cell is not None else None


def values_verdict(paper: dict[str, float], ours: dict[str, float | None]) -> str:
    known = {n: v for n, v in ours.items() if v is not None}
    if not known:
        return "not comparable: fedsub has none of these numbers"
    head = _ranking_head(*ranking(paper, known, ("below", "above"))) if len(known) > 1 else ""
    worst = max(known, key=lambda n: _relative(known[n], paper[n]))
    gap = _relative(known[worst], paper[worst])
    size = (
        f"within {100 * gap:.0f}%"
        if gap <= WITHIN
        else f"differs by {100 * gap:.0f}% ({worst}: {known[worst]:.4g} vs {paper[worst]:.4g})"
    )
    return f"{head}, {size}" if head else size


def shape_verdict(shape: str, cells: dict[str, Cell]) -> str:
    values = [_rank_value(c) for c in cells.values()]
    if shape == "any":
        return "rounds by value reported (the paper claims no shape here)"
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "differs: the target is reached at no value"
    best = values.index(min(values))
    if 0 < best < len(values) - 1:
        return f"same shape: rounds fall then rise (fewest at {list(cells)[best]})"
    return f"differs: fewest rounds at the {'first' if best == 0 else 'last'} value, no U"


def claim_result(claim: dict, table: dict[str, dict], horizon: int) -> tuple[str, str]:
    lower, than, metric, at = claim["lower"], claim["than"], claim["metric"], claim["at"]
    text = f"{lower} below {than} ({at} {metric})"
    if at == "rounds":
        a = _fedsub_cell(table.get(lower), horizon)
        b = _fedsub_cell(table.get(than), horizon)
        if a is None or b is None:
            return text, "n/a (not run)"
        holds = _rank_value(a) < _rank_value(b)
        return text, f"{'holds' if holds else 'fails'} ({a} vs {b})"
    x, y = _metric(table.get(lower), at, metric), _metric(table.get(than), at, metric)
    if x is None or y is None:
        return text, "n/a (not run)"
    return text, f"{'holds' if x < y else 'fails'} ({x:.4g} vs {y:.4g})"


def claims_verdict(results: list[tuple[str, str]]) -> str:
    checked = [(t, r) for t, r in results if not r.startswith("n/a")]
    failed = [t for t, r in checked if r.startswith("fails")]
    if not checked:
        return "claims not checkable on these runs"
    if failed:
        return f"differs: {failed[0]} fails ({len(checked) - len(failed)} of {len(checked)} hold)"
    return f"same ranking ({len(checked)} of {len(checked)} claims hold)"


def _number(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _paper_only_rows(numbers) -> list[tuple[str, str, str]]:
    """The paper's numbers of a part that cannot run here, beside 'n/a', labelled as a run's
    rows would be."""
    if numbers is None:
        return []
    rows: list[tuple[str, str, str]] = []
    for kind, values in numbers.values.items():
        if kind in ("rounds_to_target", "rounds_by_value"):
            rows += [(f"rounds to target: {n}", _number(v), "n/a") for n, v in values.items()]
        elif kind in ("best", "final"):
            rows += [
                (f"{kind} {metric}: {n}", _number(v), "n/a")
                for metric, by_name in values.items()
                for n, v in by_name.items()
            ]
        elif kind in ("stats", "target", "lowest"):
            prefix = "" if kind == "stats" else f"{kind} "
            rows += [(f"{prefix}{n}", _number(v), "n/a") for n, v in values.items()]
        elif kind == "claims":
            rows += [
                (f"{c['lower']} below {c['than']} ({c['at']} {c['metric']})", "holds", "n/a")
                for c in values
            ]
    return rows


# --- dataset statistics and settings ---------------------------------------------------------


def dataset_statistics(config: config_lib.Config) -> tuple[dict[str, float], Any]:
    """Table 1's numbers (``fedsub data stats``) plus seed 000's sparsity and seed 004's
    per-device mean and standard deviation of training samples."""
    from fedsub.run_setup import load_data
    from fedsub.submodel.index import SubmodelIndex
    from fedsub.submodel.stats import feature_heat, table1_row

    dataset = load_data(config)
    index = SubmodelIndex.build(dataset)
    row = dict(table1_row(dataset, index))
    heat = feature_heat(dataset, index)
    counts = dataset.sample_counts()
    row["samples_per_client"] = row["samples"] / row["clients"]
    row["train_samples_per_client"] = float(counts.mean())
    row["train_samples_per_client_std"] = float(counts.std())
    row["sparsity_percent"] = (
        100 * float(np.mean(heat)) / dataset.num_clients if len(heat) else math.nan
    )
    return row, (dataset, heat)


def _stats(
    path: Path,
    sets: list[str],
    data_path: str | None,
    folder: Path,
    paper: dict[str, Any],
) -> tuple[list[tuple[str, str, str]], list[Path]]:
    from fedsub.submodel.stats import plot_heat_distribution

    if data_path is not None:
        sets = [*sets, f"data.path={json.dumps(str(Path(data_path).absolute()))}"]
    config = config_lib.load(path, sets)
    row, (dataset, heat) = dataset_statistics(config)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "stats.json", dumps(row, indent=2) + "\n")
    plots = []
    if len(heat):
        plot_heat_distribution(heat, folder / "heat.png", dataset.name)
        plots.append(folder / "heat.png")
    wanted = paper.get("stats", {})
    rows = [(name, _number(value), _number(row.get(name))) for name, value in wanted.items()]
    return rows, plots


def _numbers_verdict(rows: list[tuple[str, str, str]]) -> str:
    paper = {n: float(p) for n, p, o in rows if o != "n/a"}
    ours = {n: float(o) for n, p, o in rows if o != "n/a"}
    if not paper:
        return "no numbers to compare (plot written)"
    worst = max(paper, key=lambda n: _relative(ours[n], paper[n]))
    gap = _relative(ours[worst], paper[worst])
    if gap <= WITHIN:
        return f"within {100 * gap:.0f}%"
    return f"differs: {worst} {ours[worst]:.6g} vs {paper[worst]:.6g} ({100 * gap:.0f}% off)"


def _settings(path: Path, paper: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The config's learning rate per algorithm (its own, else train.lr), B, I, K, and
    FedAdam's options, beside the paper's."""
    config = config_lib.load(path)
    wanted = paper.get("settings", {})
    rows = []
    for key, value in wanted.items():
        if key == "lr":
            for name, lr in value.items():
                ours = _algorithm_lr(config, name)
                rows.append((f"lr {name}", _number(lr), _number(ours)))
        elif isinstance(value, dict):  # an algorithm's options
            options = config.algorithms.get(key)
            for option, number in value.items():
                got = getattr(options, option, None) if options is not None else None
                if option == "lr":
                    got = _algorithm_lr(config, key)
                rows.append((f"{key} {option}", _number(number), _number(got)))
        else:
            rows.append((key, _number(value), _number(getattr(config.train, key))))
    in_config = set(config.train.algorithms)
    for name in wanted.get("lr", {}):
        if name not in in_config:
            rows.append((f"{name} in train.algorithms", "yes", "no"))
    return rows


def _algorithm_lr(config: config_lib.Config, name: str) -> float:
    options = config.algorithms.get(name)
    lr = getattr(options, "lr", None) if options is not None else None
    return float(lr) if lr is not None else config.train.lr


def _settings_verdict(rows: list[tuple[str, str, str]]) -> str:
    wrong = [r for r in rows if not _same_setting(r[1], r[2])]
    if not wrong:
        return f"same settings ({len(rows)} of {len(rows)})"
    cell, paper, ours = wrong[0]
    matching = len(rows) - len(wrong)
    return f"differs: {cell} is {ours}, the paper's {paper} ({matching} of {len(rows)} match)"


def _same_setting(paper: str, ours: str) -> bool:
    try:
        return math.isclose(float(paper), float(ours), rel_tol=1e-9)
    except ValueError:
        return paper == ours


# --- the report ------------------------------------------------------------------------------


def write_report(e: Experiment, results: list[PartResult], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {"experiment": e.id, "shows": e.shows, "parts": [asdict(r) for r in results]}
    write_atomic(out / "reproduce.json", dumps(record, indent=2) + "\n")
    write_atomic(out / "reproduce.md", report_markdown(e, results))


def report_markdown(e: Experiment, results: list[PartResult]) -> str:
    lines = [f"# {e.id}: {e.shows}", ""]
    if e.note:
        lines += [e.note, ""]
    for r in results:
        lines += [f"## {r.part}: {r.verdict}", ""]
        if r.where:
            lines += [f"Paper: {r.where}", ""]
        if r.rows:
            lines += ["| | paper | fedsub |", "|---|---:|---:|"]
            lines += [f"| {c} | {p} | {o} |" for c, p, o in r.rows]
            lines.append("")
        if r.plots:
            lines += [f"Plot: {', '.join(r.plots)}", ""]
    return "\n".join(lines)


def summary_lines(results: list[PartResult]) -> list[str]:
    """One line per part for the terminal."""
    return [f"{r.experiment} {r.part}: {r.verdict}" for r in results]


def not_run(results: list[PartResult]) -> str | None:
    """What a request that did not fully run says (None: every part ran): the parts that did
    not, each with its reason."""
    missed = [r for r in results if not r.status.startswith("ran")]
    if not missed:
        return None
    reasons = "; ".join(f"{r.part}: {r.verdict}" for r in missed)
    return f"{missed[0].experiment}: {len(missed)} of {len(results)} parts did not run ({reasons})"
