"""Run an experiment of the registry and judge it against the paper's numbers.

Each part runs with fedsub's own machinery (``experiment.compare`` / ``sweep`` into
``OUT/<part>/``, ``data stats``, the configs' settings, or a closed form), then its numbers go
beside the paper's (``paper_numbers.toml``) with a one-line verdict (``verdicts.py``: "differs:
..." first whenever a claim fails, else "same ranking", "within", "holds", "not checked"). A
part whose data are not here says which dataset it needs and the command that fetches it.
``OUT/reproduce.json`` and ``OUT/reproduce.md`` hold every part's rows and verdict; the plots
are beside them.
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
from fedsub.files.json_values import dumps
from fedsub.keys import flat_values
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
from fedsub.reproduce.verdicts import judge, number, numbers_verdict, settings_verdict
from fedsub.runs.report import write_atomic


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
            verdict = settings_verdict(rows)
        elif isinstance(action, Stats):
            sets = [*action.overrides, *(action.smoke if smoke else ()), *overrides]
            rows, plots = _stats(configs / action.config, sets, data_path, folder, paper)
            verdict = numbers_verdict(rows)
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
    rows = [(cell, number(p), number(f)) for cell, p, f in result.rows]
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
    from fedsub.runs.experiment import compare, recorded_key, sweep

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
    key = recorded_key(folder, key)  # a sweep started before its key moved keeps its folders
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
        (f"target {metric}", number(value), number(target.get(metric)))
        for metric, value in paper.get("target", {}).items()
    ]


def _paper_only_rows(numbers) -> list[tuple[str, str, str]]:
    """The paper's numbers of a part that cannot run here, beside 'n/a', labelled as a run's
    rows would be."""
    if numbers is None:
        return []
    rows: list[tuple[str, str, str]] = []
    for kind, values in numbers.values.items():
        if kind in ("rounds_to_target", "rounds_by_value"):
            rows += [(f"rounds to target: {n}", number(v), "n/a") for n, v in values.items()]
        elif kind in ("best", "final"):
            rows += [
                (f"{kind} {metric}: {n}", number(v), "n/a")
                for metric, by_name in values.items()
                for n, v in by_name.items()
            ]
        elif kind in ("stats", "target", "lowest"):
            prefix = "" if kind == "stats" else f"{kind} "
            rows += [(f"{prefix}{n}", number(v), "n/a") for n, v in values.items()]
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
    from fedsub.runs.run_setup import load_data
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
    rows = [(name, number(value), number(row.get(name))) for name, value in wanted.items()]
    return rows, plots


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
                rows.append((f"lr {name}", number(lr), number(ours)))
        elif isinstance(value, dict):  # an algorithm's options
            options = config.algorithms.get(key)
            for option, wanted_value in value.items():
                got = getattr(options, option, None) if options is not None else None
                if option == "lr":
                    got = _algorithm_lr(config, key)
                rows.append((f"{key} {option}", number(wanted_value), number(got)))
        else:
            rows.append((key, number(value), number(flat_values(config.train)[key])))
    in_config = set(config.train.algorithms)
    for name in wanted.get("lr", {}):
        if name not in in_config:
            rows.append((f"{name} in train.algorithms", "yes", "no"))
    return rows


def _algorithm_lr(config: config_lib.Config, name: str) -> float:
    options = config.algorithms.get(name)
    lr = getattr(options, "lr", None) if options is not None else None
    return float(lr) if lr is not None else config.train.client_step.lr


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
