"""A comparison: several algorithms trained on the same data, model init and client schedule;
and sweeps of one key over several values (the papers' Table 3)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fedsub import config as config_lib
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm, heat_coefficients
from fedsub.config import Config
from fedsub.data.federated import FederatedDataset
from fedsub.data.registry import load_dataset
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.diagnostics import gradient_norms
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.guards import Rejection
from fedsub.engine.loop import Diverged, Evaluation, RunControl, train
from fedsub.engine.schedule import DTYPES, Schedule
from fedsub.errors import FedsubError
from fedsub.masking.capacity import Capacities
from fedsub.masking.schemes import Masking
from fedsub.models.base import Model
from fedsub.models.registry import build_model
from fedsub.privacy.heat_sources import HeatPrivacy, describe
from fedsub.progress import current as current_reporter
from fedsub.progress import phase
from fedsub.report import (
    JsonLines,
    MetricsLog,
    Target,
    metrics_table,
    plot_curves,
    read_metrics,
    rounds_cell,
    save_tensors_atomic,
    summary,
    summary_markdown,
    write_atomic,
)
from fedsub.submodel.index import SubmodelIndex

CENTRAL = "central-sgd"
DONE = "done"
LOG = logging.getLogger("fedsub")


@dataclass(frozen=True)
class Outcome:
    summary: dict
    markdown: str
    out_dir: Path


def load_data(config: Config) -> FederatedDataset:
    with phase(f"loading {config.data.name}"):
        return load_dataset(
            config.data.name, config.data.options, config.data.path, config.data.seed
        )


def model_of(config: Config, dataset: FederatedDataset) -> Model:
    """The configured model, shaped for ``dataset``."""
    options = {
        f.name: getattr(config.model, f.name)
        for f in dataclasses.fields(config.model)
        if f.name != "name"
    }
    return build_model(config.model.name, dataset, options)


def check_writable(out_dir: Path) -> None:
    """Fail before any training when results could not be written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".fedsub-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise FedsubError(f"output folder {out_dir} is not writable: {error}") from None


def check_free_space(out_dir: Path, needed: int = 64 * 2**20) -> None:
    """Fail before training when the output folder's disk is (nearly) full."""
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        raise FedsubError(
            f"output folder {out_dir} has {free / 2**20:.1f} MiB free; "
            f"need at least {needed / 2**20:.0f} MiB for metrics and checkpoints"
        )


def _start_fresh(folder: Path) -> None:
    """A new run of this algorithm: forget a previous run's checkpoints and completion."""
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    (folder / DONE).unlink(missing_ok=True)
    (folder / "rejections.jsonl").unlink(missing_ok=True)


def _resume_point(folder: Path) -> checkpoint_lib.Checkpoint | None:
    newest = checkpoint_lib.latest(folder / "checkpoints")
    return None if newest is None else checkpoint_lib.load(newest)


def _fields(record: dict) -> dict:
    return {
        "round": record["round"],
        "metrics": record["metrics"],
        "elapsed_train_seconds": record["elapsed"],
    }


def _log_rejection(algorithm: str, rejection: Rejection, log: JsonLines) -> None:
    LOG.warning(
        "%s round %d: rejected client %d: %s",
        algorithm,
        rejection.round,
        rejection.client,
        rejection.reason,
    )
    log(rejection.as_json())


def schedule_of(config: Config) -> Schedule:
    t = config.train
    return Schedule(
        rounds=t.rounds,
        clients_per_round=t.clients_per_round,
        local_steps=t.local_steps,
        batch_size=t.batch_size,
        lr=t.lr,
        seed=t.seed,
        dtype=DTYPES[t.dtype],
        eval_every=config.eval.every,
        backend=t.backend,  # type: ignore[arg-type]
        lr_schedule=t.lr_schedule,  # type: ignore[arg-type]
        lr_decay=t.lr_decay,
        weight_decay=t.weight_decay,
        clip_norm=t.clip_norm,
        momentum=t.momentum,
        masking=Masking(
            t.masking,  # type: ignore[arg-type]
            Capacities(
                tuple(t.capacities),
                tuple(t.capacity_proportions),
                t.capacity_assignment,  # type: ignore[arg-type]
            ),
            t.mask_average,  # type: ignore[arg-type]
        ),
    )


def algorithms_to_run(config: Config) -> list[str]:
    """The configured algorithms; CentralSGD first when the target is its minimum loss."""
    names = list(config.train.algorithms)
    if config.eval.target_train_loss == "central-min":
        names = [CENTRAL, *(n for n in names if n != CENTRAL)]
    return names


def target_of(config: Config, histories: dict[str, list[Evaluation]]) -> Target:
    loss = config.eval.target_train_loss
    if loss == "central-min":
        loss = min(e.metrics["train_loss"] for e in histories[CENTRAL])
    return Target(loss, config.eval.target_test_auc)  # type: ignore[arg-type]


@dataclass(frozen=True)
class AlgorithmRun:
    """One algorithm of a comparison in its folder: metrics log, rejections, checkpoints,
    resume point, final model and completion marker."""

    name: str
    folder: Path
    config: Config
    resume: bool
    stop_requested: Callable[[], bool]
    on_round: Callable[[str, int], None] | None

    def train(self, model, algorithm, dataset, index, schedule, evaluator) -> list[Evaluation]:
        saved = _resume_point(self.folder) if self.resume else _start_fresh(self.folder)
        earlier = [] if saved is None else [Evaluation(**_fields(e)) for e in saved.history]
        log = MetricsLog(self.folder / "metrics.jsonl", earlier)
        rejections = JsonLines(self.folder / "rejections.jsonl")
        control = RunControl(
            checkpoints=self.folder / "checkpoints",
            checkpoint_every=self.config.train.checkpoint_every,
            max_update_norm=self.config.train.max_update_norm,
            resume=saved,
            stop_requested=self.stop_requested,
            on_reject=lambda rejection: _log_rejection(self.name, rejection, rejections),
        )
        on_round = self.on_round
        try:
            final = train(
                model,
                algorithm,
                dataset,
                index,
                schedule,
                evaluator,
                on_evaluation=log,
                on_round=None if on_round is None else (lambda r: on_round(self.name, r)),
                control=control,
            )
        except Diverged as error:
            raise FedsubError(str(error)) from None
        finally:
            log.close()
        save_tensors_atomic(self.folder / "model.safetensors", final.state_dict())
        write_atomic(self.folder / DONE, "finished\n")
        return log.history


def compare(
    config: Config,
    out_dir: Path,
    on_round: Callable[[str, int], None] | None = None,
    resume: bool = False,
    stop_requested: Callable[[], bool] = lambda: False,
    label: str = "",
) -> Outcome:
    """Train every algorithm of the comparison and write the run's outputs.

    With ``resume``, algorithms already finished in ``out_dir`` are read back, an interrupted
    one continues from its newest checkpoint, and the rest run from the start. Data are loaded
    and checked before the training bar appears; ``label`` prefixes the bar's algorithm names
    (a sweep's value)."""
    check_writable(out_dir)
    check_free_space(out_dir)
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    if not resume:
        write_atomic(out_dir / "config.toml", config_lib.to_toml(config))
    dataset = load_data(config)
    with phase("indexing the clients' rows"):
        index = SubmodelIndex.build(dataset)
    model = model_of(config, dataset)
    t = config.train
    privacy = HeatPrivacy(
        t.heat_source, t.secagg_group, t.sketch_eps, t.sketch_delta, t.rr_epsilon, t.seed
    )
    context = AlgorithmContext(
        dataset,
        index,
        t.heat,
        t.clients_per_round,
        privacy,  # type: ignore[arg-type]
    )
    if privacy.source != "exact":
        record = describe(dataset, index, t.heat, privacy)  # type: ignore[arg-type]
        write_atomic(out_dir / "heat_source.json", json.dumps(record, indent=2) + "\n")
        LOG.info("heat source: %s", json.dumps(record))
    extra = None
    if config.eval.gradient_norms:
        coefficients = heat_coefficients(context)
        extra = lambda params: gradient_norms(model, params, dataset.train, coefficients)  # noqa: E731
    evaluator = Evaluator.build(
        model, dataset, config.eval.train_loss_samples, config.data.seed, extra
    )
    schedule = schedule_of(config)

    histories: dict[str, list[Evaluation]] = {}
    reporter = current_reporter()
    reporter.training([(label + name, schedule.rounds) for name in algorithms_to_run(config)])
    for name in algorithms_to_run(config):
        folder = out_dir / name
        if resume and (folder / DONE).exists():
            histories[name] = read_metrics(folder / "metrics.jsonl")
            reporter.round(label + name, schedule.rounds)
            continue
        run = AlgorithmRun(name, folder, config, resume, stop_requested, _reported(label, on_round))
        with phase(f"{label}{name}: preparing"):
            algorithm = build_algorithm(name, context, config.algorithm_options(name))
        histories[name] = run.train(
            model,
            algorithm,
            dataset,
            index,
            schedule,
            evaluator,
        )

    target = target_of(config, histories)
    result = summary(histories, target)
    markdown = summary_markdown(result, target, schedule.rounds)
    write_atomic(out_dir / "summary.json", json.dumps(result, indent=2) + "\n")
    write_atomic(out_dir / "summary.md", markdown)
    plot_curves(
        histories, out_dir / "curves.png", f"{dataset.name}: {', '.join(histories)}", target
    )
    return Outcome(result, markdown, out_dir)


def _reported(
    label: str, on_round: Callable[[str, int], None] | None
) -> Callable[[str, int], None]:
    """A round callback that also advances the training bar (when one is shown)."""

    def report(name: str, round_index: int) -> None:
        current_reporter().round(label + name, round_index)
        if on_round is not None:
            on_round(name, round_index)

    return report


def sweep(
    key: str,
    values: list[str],
    load: Callable[[str], Config],
    out_dir: Path,
    on_round: Callable[[str, int], None] | None = None,
) -> Outcome:
    """One comparison per value of ``key`` (in ``out_dir/<key>=<value>/``), then a Table-3
    style table: rounds to target of each algorithm at each value."""
    check_writable(out_dir)
    outcomes = {
        v: compare(load(v), out_dir / f"{key}={v}", on_round, label=f"{key}={v}: ") for v in values
    }
    rounds = {v: load(v).train.rounds for v in values}
    names = [n for n in next(iter(outcomes.values())).summary["algorithms"] if n != CENTRAL]
    result = {
        "key": key,
        "values": values,
        "targets": {v: o.summary["target"] for v, o in outcomes.items()},
        "rounds_to_target": {
            n: {v: o.summary["algorithms"][n]["rounds_to_target"] for v, o in outcomes.items()}
            for n in names
        },
    }
    header = f"| algorithm | {' | '.join(f'{key}={v}' for v in values)} |"
    lines = [
        f"Rounds to target for each {key} ('R+' = not reached in R rounds)",
        "",
        header,
        "|---|" + "---:|" * len(values),
    ]
    for n in names:
        cells = [rounds_cell(result["rounds_to_target"][n][v], rounds[v]) for v in values]
        lines.append(f"| {n} | {' | '.join(cells)} |")
    targets = [f"{key}={v}: {_describe(result['targets'][v])}" for v in values]
    lines += ["", "Targets: " + "; ".join(targets), ""]
    rows = [
        (n, v, o.summary["algorithms"][n], rounds[v])
        for v, o in outcomes.items()
        for n in o.summary["algorithms"]
    ]
    lines += metrics_table(rows, ["algorithm", key])
    markdown = "\n".join(lines) + "\n"
    panels = {  # one row of panels per algorithm, one line per value
        n: {
            f"{key}={v}": read_metrics(out_dir / f"{key}={v}" / n / "metrics.jsonl")
            for v, o in outcomes.items()
            if n in o.summary["algorithms"]
        }
        for n in dict.fromkeys(n for o in outcomes.values() for n in o.summary["algorithms"])
    }
    shared = {json.dumps(o.summary["target"], sort_keys=True) for o in outcomes.values()}
    target = Target(**json.loads(shared.pop())) if len(shared) == 1 else None
    plot_curves(panels, out_dir / "curves.png", f"sweep of {key}", target)
    write_atomic(out_dir / "sweep.json", json.dumps(result, indent=2) + "\n")
    write_atomic(out_dir / "sweep.md", markdown)
    return Outcome(result, markdown, out_dir)


def _describe(target: dict[str, float]) -> str:
    parts = [f"{k} {'<=' if k == 'train_loss' else '>='} {v:.4g}" for k, v in target.items()]
    return " and ".join(parts) if parts else "none"
