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
    data_overrides,
    experiment,
    paper_numbers,
)
from fedsub.reproduce.request import Request, check_request, chosen_parts, refuse_nothing_to_resume
from fedsub.reproduce.status import configs_given, status_here
from fedsub.reproduce.verdicts import (
    across_seeds,
    judge_all,
    number,
    numbers_verdict,
    seeds_verdict,
    settings_verdict,
    spread,
)
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
    target the run used (e.g. CentralSGD's measured minimum), the plot, and the setting the
    runs had (``setting_of``: every override, the data, the threads)."""

    table: dict[str, dict]
    horizon: int
    target: dict[str, float]
    plots: list[Path]
    setting: dict[str, Any] = field(default_factory=dict)


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
    # what the part ran with: every override, the dataset (and the paper's), its path and
    # split, the seed, the threads
    setting: dict[str, Any] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)  # each claim: holds / differs / not checked


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
    seeds: int = 1,
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
    request = Request(smoke, data_path, list(overrides), configs_given(configs), named, seeds)
    check_request(e, chosen, request)
    if folders.resume:
        refuse_nothing_to_resume(e, chosen, out)
    results = [
        run_part(e, p, out, smoke, data_path, request.overrides, request.configs, folders, seeds)
        for p in chosen
    ]
    write_report(e, results, out, asked(request, part))
    return results


def asked(request: Request, part: str | None) -> dict[str, Any]:
    """What ``fedsub reproduce`` was asked, and which fedsub answered: recorded in the
    report."""
    return {
        "part": part,
        "smoke": request.smoke,
        "data_path": str(Path(request.data_path).absolute()) if request.data_path else None,
        "overrides": list(request.overrides),
        "seeds": request.seeds,
        "configs": str(request.configs),
        "fedsub": fedsub_source(),
    }


def fedsub_source(root: Path | None = None) -> dict[str, Any]:
    """fedsub's version and, in a git checkout (``root``: the one this fedsub is in), its
    commit and whether tracked files differ from it; None outside a checkout or without git."""
    import subprocess

    from fedsub import __version__

    root = root or Path(__file__).resolve().parents[3]
    record: dict[str, Any] = {"version": __version__, "commit": None, "modified": None}
    if not (root / ".git").exists():
        return record
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return record
    record["commit"] = head.stdout.strip() or None
    record["modified"] = bool(status.stdout.strip())
    return record


def run_part(
    e: Experiment,
    part: Part,
    out: Path,
    smoke: bool,
    data_path: str | None,
    overrides: list[str],
    configs: Path,
    folders: Folders,
    seeds: int = 1,
) -> PartResult:
    """One part run (``seeds`` times for a training part: train.seed, train.seed + 1, ...) and
    judged against the paper's numbers."""
    numbers = paper_numbers(e.id, part.name)
    where = numbers.where if numbers else ""
    status = status_here(part, configs, data_path)
    if status != "runs here":
        kind = "needs data" if status.startswith("needs") else "cannot run"
        return PartResult(e.id, part.name, kind, status, where, _paper_only_rows(numbers))
    started = time.perf_counter()
    paper = numbers.values if numbers else {}
    data_sets = data_overrides(part.data, data_path)
    try:
        rows, verdict, checks, plots, setting = _act(
            part, out, paper, smoke, data_sets, overrides, configs, folders, seeds
        )
    except DataError as error:  # the data are there but not what the loader expects
        return PartResult(e.id, part.name, "cannot run", f"data error: {error}", where)
    seconds = time.perf_counter() - started
    smoke = smoke and not isinstance(part.action, Settings)  # a config's settings have no size
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
        setting,
        checks,
    )


def _act(
    part: Part,
    out: Path,
    paper: dict[str, Any],
    smoke: bool,
    data_sets: list[str],
    overrides: list[str],
    configs: Path,
    folders: Folders,
    seeds: int,
) -> tuple[list[tuple[str, str, str]], str, list[str], list[Path], dict[str, Any]]:
    """What the part's action does (a closed form, a config's settings, the data's statistics
    or training runs): its rows, verdict, checks, plots and setting."""
    action, folder = part.action, out / part.name
    if isinstance(action, ClosedForm):
        folder.mkdir(parents=True, exist_ok=True)
        rows, verdict, plots = _closed_form(action, folder, smoke)
        return rows, verdict, [], plots, {}
    if isinstance(action, Settings):
        rows = _settings(configs / action.config, paper)
        return rows, settings_verdict(rows), [], [], {}
    if isinstance(action, Stats):
        sets = [*action.overrides, *(action.smoke if smoke else ()), *data_sets, *overrides]
        rows, plots, config = _stats(configs / action.config, sets, folder, paper)
        setting = setting_of(part, config_setting(config, sets), overrides)
        return rows, numbers_verdict(rows), [], plots, setting
    assert isinstance(action, Run)
    runs = Runs(action, configs, smoke, data_sets, overrides, folders)
    rows, verdict, checks, plots, ran = runs.judged(part.name, out, paper, seeds)
    return rows, verdict, checks, plots, setting_of(part, ran, overrides)


@dataclass(frozen=True)
class Runs:
    """A training part's runs: its action and everything the request adds to it."""

    action: Run
    configs: Path
    smoke: bool
    data_sets: list[str]
    user: list[str]
    folders: Folders

    def judged(
        self, name: str, out: Path, paper: dict[str, Any], seeds: int
    ) -> tuple[list[tuple[str, str, str]], str, list[str], list[Path], dict[str, Any]]:
        """Rows, verdict, checks, plots and setting of the part run with ``seeds`` seeds: the
        config's train.seed in OUT/<part>, each further one in OUT/<part>@train.seed=S;
        fedsub's numbers are their mean, standard deviation and range, and each claim is
        judged on every seed (``verdicts.across_seeds``)."""
        path = self.configs / self.action.config
        sets = [*self.action.overrides, *self.data_sets, *self.user]
        base = config_lib.load(path, sets).train.seed
        all_rows, verdicts, found, plots = [], [], [], []
        setting: dict[str, Any] = {}
        for i in range(seeds):
            folder = out / (name if i == 0 else f"{name}@train.seed={base + i}")
            user = self.user if i == 0 else [*self.user, f"train.seed={base + i}"]
            trained = _train(
                self.action, self.configs, folder, self.smoke, self.data_sets, user, self.folders
            )
            rows, verdict, judged = judge_all(paper, trained.table, trained.horizon)
            all_rows.append(_target_rows(paper, trained.target) + rows)
            verdicts.append(verdict)
            found.append(judged)
            plots += trained.plots
            setting = setting or dict(trained.setting)
        setting["seeds"] = [base + i for i in range(seeds)]
        rows = all_rows[0]
        if all(len(r) == len(rows) for r in all_rows):
            rows = [
                (cell, paper_value, spread([r[k][2] for r in all_rows]))
                for k, (cell, paper_value, _) in enumerate(rows)
            ]
        lines = [c.line() for c in across_seeds(found)]
        return rows, seeds_verdict(verdicts), lines, plots, setting


def setting_of(part: Part, ran: dict[str, Any], user: list[str]) -> dict[str, Any]:
    """What a part ran with, for the report: the paper's dataset and fedsub's (a stand-in is
    named beside it), the data's path and split, every override (the part's own, smoke size,
    --data-path, the threads, --set: ``ran``, from ``config_setting``) and the user's --set
    alone, the seed and the threads."""
    setting: dict[str, Any] = {"paper_dataset": part.data.name, "user_overrides": list(user)}
    if ran:
        stand_in = ran["dataset"] != part.data.name
        setting["split"] = STAND_IN_SPLIT if stand_in else part.data.split
    return {**setting, **ran}


def config_setting(config: config_lib.Config, sets: list[str]) -> dict[str, Any]:
    """The config's data, seed and threads as the runs have them, and the overrides that
    made it."""
    import torch

    options = config.data.options
    return {
        "dataset": config.data.name,
        "data_path": config.data.path,
        "test_fraction": getattr(options, "test_fraction", None),
        "overrides": list(sets),
        "seed": config.data.seed,
        "threads": config.execution.threads,
        "threads_used": config.execution.threads or torch.get_num_threads(),
    }


STAND_IN_SPLIT = "a seeded random data.test_fraction of each user's samples held out"


def _closed_form(action: ClosedForm, folder: Path, smoke: bool):
    if action.name == "example-1":
        result = closed_forms.example_1(folder, smoke)
    else:
        result = closed_forms.theorem_4(folder, smoke, decayed=action.name.endswith("decayed"))
    rows = [(cell, number(p), number(f)) for cell, p, f in result.rows]
    return rows, result.verdict, [result.plot]


def _run_overrides(
    run: Run, smoke: bool, data_sets: list[str], user: list[str], path: Path, resumed: Path | None
) -> list[str]:
    """The part's overrides, smoke size's, --data-path's, the threads pinned, then --set.

    A config whose execution.threads is 0 (torch's default, which depends on the machine and
    its environment) runs with the count this process has, written into the run's config so
    that the number is recorded and a resume runs with the same count (a resume reads it back
    from the stopped run's config in ``resumed``); --set execution.threads replaces it."""
    sets = list(run.overrides)
    if smoke:
        sets += [*SMOKE, *run.smoke]
    sets += data_sets
    if config_lib.load(path, sets).execution.threads == 0:
        threads = None if resumed is None else _recorded_threads(resumed)
        if threads is None:
            import torch

            threads = torch.get_num_threads()
        sets.append(f"execution.threads={threads}")
    return sets + user


def _recorded_threads(folder: Path) -> int | None:
    """The execution.threads a stopped run in ``folder`` was started with (a comparison's
    config.toml, or a sweep's first value's); None when there is none."""
    import tomllib

    for path in [folder / "config.toml", *sorted(folder.glob("*/config.toml"))]:
        try:
            threads = tomllib.loads(path.read_text())["execution"]["threads"]
        except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError):
            continue
        return int(threads)
    return None


def _train(
    run: Run,
    configs: Path,
    folder: Path,
    smoke: bool,
    data_sets: list[str],
    user: list[str],
    folders: Folders,
) -> Trained:
    """Train the part (a comparison or a sweep)."""
    path = configs / run.config
    sets = _run_overrides(run, smoke, data_sets, user, path, folder if folders.resume else None)
    setting = config_setting(config_lib.load(path, sets), sets)
    if run.sweep is None:
        return _train_comparison(path, sets, folder, folders, setting)
    key, values = run.sweep
    if smoke and run.smoke_values is not None:
        values = run.smoke_values
    return _train_sweep(key, list(values), path, sets, folder, folders, setting)


def _train_comparison(
    path: Path, sets: list[str], folder: Path, folders: Folders, setting: dict[str, Any]
) -> Trained:
    """One comparison of the config's algorithms (runs/experiment.py ``compare``)."""
    from fedsub.runs.experiment import compare

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
        setting,
    )


def _train_sweep(
    key: str,
    values: list[str],
    path: Path,
    sets: list[str],
    folder: Path,
    folders: Folders,
    setting: dict[str, Any],
) -> Trained:
    """A sweep of ``key`` over ``values`` (runs/experiment.py ``sweep``), its results read
    back from each value's summary.json."""
    from fedsub.runs.experiment import recorded_key, sweep

    base = config_lib.apply_overrides(config_lib.read_toml(path), sets)
    config_lib.load(path, sets)  # a bad override is named before any training
    resume = folders.resume and (folder / "run.json").exists()
    sweep(
        key,
        values,
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
    return Trained(table, horizon, target, [folder / "curves.png"], setting)


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
    folder: Path,
    paper: dict[str, Any],
) -> tuple[list[tuple[str, str, str]], list[Path], config_lib.Config]:
    from fedsub.submodel.stats import plot_heat_distribution

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
    return rows, plots, config


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


def write_report(
    e: Experiment, results: list[PartResult], out: Path, request: dict[str, Any] | None = None
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "experiment": e.id,
        "shows": e.shows,
        "request": request or {},
        "parts": [asdict(r) for r in results],
    }
    write_atomic(out / "reproduce.json", dumps(record, indent=2) + "\n")
    write_atomic(out / "reproduce.md", report_markdown(e, results, request or {}))


def _request_lines(request: dict[str, Any]) -> list[str]:
    if not request:
        return []
    source = request.get("fedsub", {})
    commit = source.get("commit")
    where = "not in a git checkout" if commit is None else f"commit {commit}"
    if source.get("modified"):
        where += " with modified files"
    sets = request.get("overrides") or []
    lines = [
        f"fedsub {source.get('version')} ({where}); "
        + ("smoke size; " if request.get("smoke") else "")
        + f"--set: {', '.join(sets) if sets else 'none'}"
        + (f"; --data-path {request['data_path']}" if request.get("data_path") else ""),
        "",
    ]
    return lines


def _setting_lines(setting: dict[str, Any]) -> list[str]:
    if "dataset" not in setting:
        return []
    dataset = setting["dataset"]
    paper = setting.get("paper_dataset")
    named = dataset if dataset == paper else f"{dataset} (the paper's: {paper})"
    at = setting.get("data_path") or "fedsub's download cache"
    split = setting.get("split") or "the loader's"
    fraction = setting.get("test_fraction")
    held = f" (test_fraction {fraction:g})" if isinstance(fraction, float) else ""
    threads = setting.get("threads_used")
    seeds = setting.get("seeds") or []
    runs = (
        f"train.seed {', '.join(map(str, seeds))} ({len(seeds)} runs: mean ± std (min-max))"
        if len(seeds) > 1
        else f"train.seed {seeds[0]}"
        if seeds
        else "no training"
    )
    lines = [
        f"Data: {named} at {at}; split: {split}{held}",
        f"data.seed {setting.get('seed')}, {runs}, {threads} thread{'s' if threads != 1 else ''}"
        + ("" if setting.get("threads") else " (torch's default)"),
        f"Overrides: {', '.join(setting.get('overrides') or []) or 'none'}",
        "",
    ]
    return [line if not line else line + "  " for line in lines[:-1]] + [""]


def report_markdown(
    e: Experiment, results: list[PartResult], request: dict[str, Any] | None = None
) -> str:
    lines = [f"# {e.id}: {e.shows}", ""]
    if e.note:
        lines += [e.note, ""]
    lines += _request_lines(request or {})
    for r in results:
        lines += [f"## {r.part}: {r.verdict}", ""]
        if r.where:
            lines += [f"Paper: {r.where}", ""]
        lines += _setting_lines(r.setting)
        if r.checks:
            lines += [f"- {c}" for c in r.checks]
            lines.append("")
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
