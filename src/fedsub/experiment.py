"""A comparison: several algorithms trained on the same data, model init and client schedule."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedsub import config as config_lib
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.config import Config
from fedsub.data.federated import FederatedDataset
from fedsub.data.registry import load_dataset
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.loop import Evaluation, train
from fedsub.engine.schedule import DTYPES, Schedule
from fedsub.errors import FedsubError
from fedsub.models.registry import build_model
from fedsub.report import (
    MetricsLog,
    Target,
    plot_curves,
    summary,
    summary_markdown,
    write_atomic,
)
from fedsub.submodel.index import SubmodelIndex


@dataclass(frozen=True)
class Outcome:
    summary: dict
    markdown: str
    out_dir: Path


def load_data(config: Config) -> FederatedDataset:
    return load_dataset(config.data.name, config.data.options, config.data.path, config.data.seed)


def check_writable(out_dir: Path) -> None:
    """Fail before any training when results could not be written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".fedsub-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise FedsubError(f"output folder {out_dir} is not writable: {error}") from None


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
    )


def compare(
    config: Config,
    out_dir: Path,
    on_round: Callable[[str, int], None] | None = None,
) -> Outcome:
    """Train every algorithm of ``config.train.algorithms`` and write the run's outputs."""
    check_writable(out_dir)
    write_atomic(out_dir / "config.toml", config_lib.to_toml(config))
    dataset = load_data(config)
    index = SubmodelIndex.build(dataset)
    model_options = {
        f.name: getattr(config.model, f.name)
        for f in dataclasses.fields(config.model)
        if f.name != "name"
    }
    model = build_model(config.model.name, dataset, model_options)
    evaluator = Evaluator.build(model, dataset, config.eval.train_loss_samples, config.data.seed)
    context = AlgorithmContext(dataset, index, config.train.heat)  # type: ignore[arg-type]
    schedule = schedule_of(config)
    target = Target(config.eval.target_train_loss, config.eval.target_test_auc)

    histories: dict[str, list[Evaluation]] = {}
    for name in config.train.algorithms:
        log = MetricsLog(out_dir / name / "metrics.jsonl")
        try:
            train(
                model,
                build_algorithm(name, context),
                dataset,
                index,
                schedule,
                evaluator,
                on_evaluation=log,
                on_round=None if on_round is None else (lambda r, n=name: on_round(n, r)),
            )
        finally:
            log.close()
        histories[name] = log.history

    result = summary(histories, target)
    markdown = summary_markdown(result, target, schedule.rounds)
    write_atomic(out_dir / "summary.json", json.dumps(result, indent=2) + "\n")
    write_atomic(out_dir / "summary.md", markdown)
    plot_curves(histories, out_dir / "curves.png", f"{dataset.name}: {', '.join(histories)}")
    return Outcome(result, markdown, out_dir)
