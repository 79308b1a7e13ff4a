"""Training from Python: a model (fedsub's, or a user's ``nn.Module``) and a dataset in memory,
with the config's ``[train]`` / ``[eval]`` keys as keyword arguments, through the same
machinery a config file's comparison runs (engine/loop.py's ``train``), writing nothing.

The smallest entry point the examples and tests need; the public ``fedsub.train`` will be
built on it (and on experiment.py's set-up) later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from fedsub import config as config_lib
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.checks import check_against_dataset
from fedsub.config import Config, EvalConfig, TrainConfig
from fedsub.data.federated import FederatedDataset
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.loop import Diverged, Evaluation, RunControl, train
from fedsub.errors import ConfigError
from fedsub.experiment import schedule_of
from fedsub.models.base import Model, SliceableModel
from fedsub.models.module_tables import TableSpec
from fedsub.models.torch_module import TorchModuleModel, wrap
from fedsub.privacy import levels as privacy_levels
from fedsub.privacy.heat_sources import HeatPrivacy
from fedsub.submodel.heat import HeatKind
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params


@dataclass(frozen=True)
class Trained:
    """One algorithm's run: its evaluations (one dict per evaluation: ``round``,
    ``train_loss``, test metrics, ``elapsed`` training seconds), the final parameters (None
    when it diverged) and why it diverged."""

    algorithm: str
    history: list[dict[str, float]]
    params: Params | None
    model: Model
    diverged: str | None = None

    def module(self) -> nn.Module:
        """The trained ``nn.Module`` (a copy of the one given, with the trained weights)."""
        if not isinstance(self.model, TorchModuleModel):
            raise TypeError(f"{type(self.model).__name__} is fedsub's model, not an nn.Module")
        if self.params is None:
            raise ValueError(f"{self.algorithm} diverged: {self.diverged}")
        return self.model.to_module(self.params)


def train_model(
    model: Model | nn.Module,
    dataset: FederatedDataset,
    *,
    algorithm: str = "fedsubavg",
    tables: TableSpec | None = None,
    algorithm_options: Mapping[str, Mapping[str, Any]] | None = None,
    **options: Any,
) -> Trained:
    """Train ``model`` on ``dataset`` with one algorithm; ``options`` are ``[train]`` and
    ``[eval]`` keys (``rounds``, ``clients_per_round``, ``lr``, ``backend``, ``every``, ...),
    checked as a config file's; ``algorithm_options``: ``[algorithms.<name>]`` tables."""
    runs = compare_models(
        model,
        dataset,
        algorithms=[algorithm],
        tables=tables,
        algorithm_options=algorithm_options,
        **options,
    )
    return runs[algorithm]


def compare_models(
    model: Model | nn.Module,
    dataset: FederatedDataset,
    *,
    algorithms: Sequence[str] = ("fedavg", "fedsubavg"),
    tables: TableSpec | None = None,
    algorithm_options: Mapping[str, Mapping[str, Any]] | None = None,
    **options: Any,
) -> dict[str, Trained]:
    """Each of ``algorithms`` trained from the same initial model on the same schedule (a
    user's ``nn.Module`` is wrapped once: ``models/torch_module.py``)."""
    fedsub_model = wrap(model, dataset, tables=tables) if isinstance(model, nn.Module) else model
    config = config_of(options, list(algorithms), algorithm_options, fedsub_model)
    check_against_dataset(config, dataset, fedsub_model)
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    index = SubmodelIndex.build(dataset)
    context = _context(config, dataset, index)
    evaluator = Evaluator.build(
        fedsub_model, dataset, config.eval.train_loss_samples, config.data.seed
    )
    schedule = schedule_of(config)
    runs = {}
    for name in config.train.algorithms:
        built = build_algorithm(name, context, config.algorithm_options(name))
        history: list[Evaluation] = []
        control = RunControl(
            max_update_norm=config.train.max_update_norm,
            divergence_factor=config.eval.divergence_factor,
        )
        diverged, params = None, None
        try:
            params = train(
                fedsub_model,
                built,
                dataset,
                index,
                schedule,
                evaluator,
                on_evaluation=history.append,
                control=control,
            )
        except Diverged as error:
            diverged = str(error)
        runs[name] = Trained(name, [e.as_json() for e in history], params, fedsub_model, diverged)
    return runs


def config_of(
    options: Mapping[str, Any],
    algorithms: list[str],
    algorithm_options: Mapping[str, Mapping[str, Any]] | None,
    model: Model,
) -> Config:
    """The config that keyword ``options`` make, checked by config.py (keys, types, ranges)."""
    sections: dict[str, dict[str, Any]] = {"train": {"algorithms": algorithms}, "eval": {}}
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    eval_keys = {f.name for f in dataclasses.fields(EvalConfig)}
    for key, value in options.items():
        if key == "algorithms":
            raise ConfigError("give the algorithms as algorithms=[...] of compare_models")
        if key in train_keys:
            sections["train"][key] = value
        elif key in eval_keys:
            sections["eval"][key] = value
        else:
            raise ConfigError(
                f"unknown option {key!r}: expected a [train] key ({', '.join(sorted(train_keys))})"
                f" or an [eval] key ({', '.join(sorted(eval_keys))})"
            )
    if sections["train"].get("masking", "none") != "none" and not isinstance(model, SliceableModel):
        raise ConfigError(
            f"train.masking = {sections['train']['masking']!r} needs a width-sliceable model; "
            f"{type(model).__name__} is not one"
        )
    raw: dict[str, Any] = {**sections, "algorithms": dict(algorithm_options or {})}
    return config_lib.parse(raw)


def _context(config: Config, dataset: FederatedDataset, index: SubmodelIndex) -> AlgorithmContext:
    """The algorithms' context (heat and its source), as experiment.prepare builds it."""
    t = config.train
    source = privacy_levels.heat_source_for(t.privacy, t.heat_source)
    privacy = HeatPrivacy(
        source, t.secagg_group, t.sketch_eps, t.sketch_delta, t.rr_epsilon, t.seed
    )
    heat = cast(HeatKind, t.heat)  # config.py has checked it against its choices
    return AlgorithmContext(dataset, index, heat, t.clients_per_round, privacy)
