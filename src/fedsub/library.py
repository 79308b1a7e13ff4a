"""fedsub's Python API: load a dataset, train a model (a built-in one by name, a fedsub
``Model`` or your own ``torch.nn.Module``), compare algorithms on one schedule, and run a
config exactly as ``fedsub run`` / ``fedsub compare`` do (the command line calls ``run``).

Everything goes through the same machinery as a config file: keyword options are the
config's ``[train]`` / ``[eval]`` keys, checked by config.py; the run is set up by
run_setup.py and trained by experiment.py's ``compare`` (without a run folder unless
``run`` is given one).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from torch import nn

from fedsub import config as config_lib
from fedsub import experiment, run_setup
from fedsub.config import Config, EvalConfig, TrainConfig
from fedsub.data.federated import FederatedDataset
from fedsub.errors import ConfigError
from fedsub.models.base import Model, SliceableModel
from fedsub.models.module_tables import TableSpec
from fedsub.models.torch_module import TorchModuleModel, wrap
from fedsub.run_folder import check_folder_text
from fedsub.submodel.params import Params

DEFAULT_ALGORITHMS = ("fedavg", "fedsubavg")


@dataclass(frozen=True)
class TrainResult:
    """One algorithm's run.

    - ``history``: one dict per evaluation: ``round``, ``train_loss``, the test metrics
      (``test_loss``, ``test_auc``, ``test_accuracy``, ... as the task has them; ``None`` where
      undefined) and ``elapsed`` (training seconds so far);
    - ``summary``: ``rounds_to_target`` (None when not reached or no target is set),
      ``final`` and ``best`` metrics, ``diverged`` (``{"round", "reason"}`` or None), as in a
      run folder's summary.json;
    - ``model``: the trained model: for your ``nn.Module`` a copy of it (same class) holding
      the trained weights; for fedsub's models the trained ``Params`` (tables and dense
      tensors; ``fedsub_model`` computes with them). None when the run diverged, or when a
      resumed run read this algorithm's finished results back from its folder.
    """

    algorithm: str
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    params: Params | None
    fedsub_model: Model | None

    @property
    def diverged(self) -> str | None:
        """Why and when the run diverged ("round 7: train loss is NaN"), or None."""
        record = self.summary.get("diverged")
        return None if record is None else f"round {record['round']}: {record['reason']}"

    @cached_property
    def model(self) -> nn.Module | Params | None:
        """The trained model (see the class's docstring)."""
        if self.params is None:
            return None
        if isinstance(self.fedsub_model, TorchModuleModel):
            return self.fedsub_model.to_module(self.params)
        return self.params


@dataclass(frozen=True)
class Comparison(Mapping[str, TrainResult]):
    """Several algorithms trained on one schedule: a mapping from algorithm name to its
    ``TrainResult`` (in the order they ran), with the comparison's ``summary`` (summary.json:
    the target and every algorithm's entry), ``markdown`` (summary.md, as the command line
    prints it), ``out`` (the run folder, None when nothing was written) and ``profiles``
    (``profile=True``: where each algorithm's rounds' time went)."""

    results: dict[str, TrainResult]
    summary: dict[str, Any]
    markdown: str
    out: Path | None = None
    profiles: dict[str, dict] = dataclasses.field(default_factory=dict)

    def __getitem__(self, name: str) -> TrainResult:
        if name not in self.results:
            raise KeyError(f"{name!r}: this comparison ran {', '.join(self.results)}")
        return self.results[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    @property
    def diverged(self) -> dict[str, str]:
        """The algorithms that diverged, each with its round and reason."""
        return {n: r.diverged for n, r in self.results.items() if r.diverged is not None}

    def divergence_message(self) -> str:
        """One line naming every diverged algorithm, its round and why ("" when none)."""
        return "; ".join(
            f"{n} diverged at round {r.summary['diverged']['round']} "
            f"({r.summary['diverged']['reason']})"
            for n, r in self.results.items()
            if r.summary.get("diverged")
        )

    @staticmethod
    def of(outcome: experiment.Outcome) -> Comparison:
        """The comparison an experiment's ``Outcome`` holds."""
        entries = outcome.summary.get("algorithms", {})
        results = {
            name: TrainResult(
                name,
                [e.as_json() for e in history],
                entries.get(name, {}),
                outcome.params.get(name),
                outcome.model,
            )
            for name, history in outcome.histories.items()
        }
        return Comparison(
            results, outcome.summary, outcome.markdown, outcome.out_dir, outcome.profiles
        )


def load_dataset(
    name: str, *, path: str | os.PathLike[str] | None = None, seed: int = 0, **options: Any
) -> FederatedDataset:
    """A registered dataset (``fedsub list datasets``), loaded as ``[data]`` would load it:
    ``path`` its file or folder where it reads one, ``seed`` its draw, ``options`` its own
    keys (e.g. ``num_users`` of ``synthetic-sparse``). A bad name, option or value raises
    ``ConfigError`` naming the key and what is allowed.

    The result has ``table_rows`` (rows per table), ``train`` / ``test`` (``SampleSet`` s:
    ids per field, labels, dense features), ``num_clients``, ``client(k)`` and
    ``field_tables`` (the table each field reads when not its own name).

    Examples:
        >>> import fedsub
        >>> data = fedsub.load_dataset("synthetic-sparse", num_users=60, seed=1)
        >>> data.num_clients
        60
        >>> sorted(data.table_rows) == sorted(data.train.ids)
        True
    """
    if not isinstance(name, str):
        raise ConfigError(f"data.name must be a dataset's name (a str), got {name!r}")
    table: dict[str, Any] = {"name": name, "seed": seed, **options}
    if path is not None:
        table["path"] = os.fspath(path)
    return run_setup.load_data(config_lib.parse({"data": table}))


def train(
    model: str | Model | nn.Module,
    data: FederatedDataset | str,
    *,
    algorithm: str = "fedsubavg",
    tables: TableSpec | None = None,
    model_options: Mapping[str, Any] | None = None,
    algorithm_options: Mapping[str, Mapping[str, Any]] | None = None,
    **train_options: Any,
) -> TrainResult:
    """Train ``model`` on ``data`` with one algorithm and return its ``TrainResult``.

    - ``model``: a built-in model's name (``fedsub list models``; ``model_options`` are its
      ``[model]`` keys), a fedsub ``Model``, or your own ``torch.nn.Module`` whose
      ``forward(batch)`` reads ``batch.ids[field]`` as ``(values, offsets)`` and
      ``batch.dense``; its ``nn.Embedding`` / ``nn.EmbeddingBag`` modules are the row tables,
      given by ``tables={table: module}`` or found by the dataset's table names;
    - ``data``: a ``FederatedDataset`` (``load_dataset``, ``from_clients``,
      ``from_dataframe``, ...) or a dataset's name (loaded with its defaults);
    - ``algorithm``: ``fedsub list algorithms`` (``algorithm_options``: the
      ``[algorithms.<name>]`` tables);
    - ``train_options``: ``[train]`` and ``[eval]`` keys (``rounds``, ``clients_per_round``,
      ``local_steps``, ``batch_size``, ``lr``, ``seed``, ``device``, ``backend``, ``every``,
      ...; built-in defaults otherwise), checked as a config file's: an unknown key names the
      valid ones; ``dp={...}``: the ``[dp]`` table (differential privacy).

    Examples:
        >>> import fedsub
        >>> result = fedsub.train("sparse-lr", "synthetic-sparse", rounds=2, every=1)
        >>> [e["round"] for e in result.history]
        [0, 1, 2]
        >>> result.summary["diverged"] is None
        True
    """
    results = compare(
        model,
        data,
        algorithms=[algorithm],
        tables=tables,
        model_options=model_options,
        algorithm_options=algorithm_options,
        **train_options,
    )
    return results[algorithm]


def compare(
    model: str | Model | nn.Module,
    data: FederatedDataset | str,
    *,
    algorithms: Sequence[str] = DEFAULT_ALGORITHMS,
    tables: TableSpec | None = None,
    model_options: Mapping[str, Any] | None = None,
    algorithm_options: Mapping[str, Mapping[str, Any]] | None = None,
    **train_options: Any,
) -> Comparison:
    """Train ``model`` on ``data`` with each of ``algorithms``, from the same initial model
    on the same client schedule, and return a ``Comparison`` (algorithm -> ``TrainResult``,
    with the comparison's summary). The arguments are ``train``'s; a user's ``nn.Module`` is
    wrapped once (``models/torch_module.py``) and every algorithm trains a copy.

    Examples:
        >>> import fedsub
        >>> runs = fedsub.compare(
        ...     "sparse-lr", "synthetic-sparse", algorithms=["fedavg", "fedsubavg"], rounds=2
        ... )
        >>> list(runs)
        ['fedavg', 'fedsubavg']
        >>> runs["fedavg"].history[0]["train_loss"] == runs["fedsubavg"].history[0]["train_loss"]
        True
    """
    dataset = _dataset_of(data)
    given = _model_of(model, dataset, tables, model_options)
    model_table = dict(model_options or {})
    if isinstance(model, str):
        model_table["name"] = model
    config = config_of(train_options, list(algorithms), algorithm_options, given, model_table)
    outcome = experiment.compare(config, None, dataset=dataset, model=given)
    return Comparison.of(outcome)


def run(
    config: Config | str | os.PathLike[str],
    *,
    out: str | os.PathLike[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    profile: bool = False,
    stop_requested: Callable[[], bool] | None = None,
    on_round: Callable[[str, int], None] | None = None,
) -> Comparison:
    """Run a config as ``fedsub compare`` does (``fedsub run`` is the one-algorithm case):
    every algorithm of ``train.algorithms`` on the config's data, model and schedule.

    - ``config``: a ``Config`` (``Config.from_toml``, ``Config.from_dict``) or a TOML file;
    - ``out``: the run folder to write (run.json, config.toml, summary.json / .md,
      curves.png, per algorithm metrics.jsonl, checkpoints and model.safetensors), following
      the command line's folder rules; None: nothing is written;
    - ``resume``: continue the stopped run in ``out`` (the same config);
      ``overwrite``: replace the run already in ``out``;
    - ``profile``: time each round's phases (``Comparison.profiles``);
    - ``stop_requested``: asked after every round; True stops the run with a checkpoint
      (``engine.loop.Interrupted`` is raised; resume it later);
    - ``on_round(algorithm, round)``: called after every round.

    Examples:
        >>> import fedsub
        >>> overrides = ["train.rounds=2", "train.algorithms=['fedsubavg']"]
        >>> config = fedsub.Config.from_toml(None, overrides)
        >>> result = fedsub.run(config)
        >>> list(result), result.out is None
        (['fedsubavg'], True)
    """
    if not isinstance(config, Config):
        config = Config.from_toml(config)
    folder = None
    if out is not None:
        check_folder_text(os.fspath(out), "out")
        folder = Path(out)
    elif resume or overwrite:
        flag = "resume" if resume else "overwrite"
        raise ConfigError(f"{flag}=True acts on a run folder: give it as out=")
    outcome = experiment.compare(
        config,
        folder,
        on_round,
        resume,
        stop_requested or (lambda: False),
        overwrite,
        profile=profile,
    )
    return Comparison.of(outcome)


@dataclass(frozen=True)
class Sweep:
    """A sweep's result: ``summary`` (sweep.json: rounds to target of each algorithm at each
    value), ``markdown`` (sweep.md, as the command line prints it), ``out`` (its folder: one
    run folder per value, ``<key>=<value>/``, each as ``fedsub.run`` writes it) and
    ``diverged`` (``"<algorithm> (<key>=<value>)"``: round and reason)."""

    summary: dict[str, Any]
    markdown: str
    out: Path
    diverged: dict[str, str] = dataclasses.field(default_factory=dict)


def sweep(
    config: Config | Mapping[str, Any] | str | os.PathLike[str] | None,
    key: str,
    values: Sequence[object],
    *,
    out: str | os.PathLike[str],
    resume: bool = False,
    overwrite: bool = False,
    profile: bool = False,
    stop_requested: Callable[[], bool] | None = None,
    on_round: Callable[[str, int], None] | None = None,
) -> Sweep:
    """One comparison per value of ``key`` (``"train.clients_per_round"``) on the config's
    schedule, as ``fedsub compare --sweep key=v1,v2`` runs it; every value is checked before
    anything trains, and ``resume=True`` continues a stopped sweep in ``out``.

    - ``config``: a TOML file, TOML-shaped data (``{"train": {...}}``), a ``Config``, or None
      (the embedded default). Give a file or data to sweep ``data.name``: a ``Config`` holds
      its dataset's resolved options, which another dataset does not take.
    - ``values``: the values, as ``--sweep`` takes them (``10`` or ``"10"``; lists as TOML).

    Examples:
        >>> import tempfile, fedsub
        >>> base = {"train": {"rounds": 2, "algorithms": ["fedsubavg"]}, "eval": {"every": 1}}
        >>> out = tempfile.mkdtemp() + "/k"
        >>> result = fedsub.sweep(base, "train.clients_per_round", [5, 10], out=out)
        >>> result.summary["values"]
        ['5', '10']
    """
    texts = [v if isinstance(v, str) else config_lib.toml_value(v) for v in values]
    if not texts:
        raise ConfigError(f"sweep of {key!r}: give at least one value")
    twice = experiment.repeated_value(texts)
    if twice is not None:
        raise ConfigError(f"sweep of {key!r}: value {twice!r} is given twice")
    check_folder_text(os.fspath(out), "out")
    if isinstance(config, Config):
        base, where = tomllib.loads(config.to_toml()), "the config"
    elif isinstance(config, Mapping):
        base, where = copy.deepcopy(dict(config)), "the config"
    else:
        path = config_lib.default_config_path() if config is None else Path(config)
        base, where = config_lib.read_toml(path), str(path)
    outcome = experiment.sweep(
        key,
        texts,
        base,
        Path(out),
        on_round,
        resume=resume,
        stop_requested=stop_requested or (lambda: False),
        overwrite=overwrite,
        where=where,
        profile=profile,
    )
    diverged = {name: str(d) for name, d in outcome.diverged.items()}
    return Sweep(outcome.summary, outcome.markdown, Path(out), diverged)


def _dataset_of(data: FederatedDataset | str) -> FederatedDataset:
    if isinstance(data, str):
        return load_dataset(data)
    if not isinstance(data, FederatedDataset):
        raise ConfigError(
            "data must be a FederatedDataset (fedsub.load_dataset, fedsub.from_clients, ...) "
            f"or a dataset's name, got {type(data).__name__}"
        )
    return data


def _model_of(
    model: str | Model | nn.Module,
    dataset: FederatedDataset,
    tables: TableSpec | None,
    model_options: Mapping[str, Any] | None,
) -> Model | None:
    """The model to train when it is given as an object (None: a built-in one, by name,
    built by run_setup from the config's ``[model]``)."""
    if isinstance(model, str):
        if tables is not None:
            raise ConfigError(
                "tables= names a user nn.Module's tables; a built-in model has its own"
            )
        return None
    if model_options:
        raise ConfigError(
            "model_options are a built-in model's [model] keys; give the model by its name "
            f"(fedsub list models), not as a {type(model).__name__}"
        )
    if isinstance(model, nn.Module):
        return wrap(model, dataset, tables=tables)
    if isinstance(model, Model):
        if tables is not None:
            raise ConfigError("tables= names a user nn.Module's tables; a fedsub Model has its own")
        return model
    raise ConfigError(
        "model must be a built-in model's name (fedsub list models), a fedsub Model or a "
        f"torch.nn.Module, got {type(model).__name__}"
    )


def config_of(
    options: Mapping[str, Any],
    algorithms: list[str],
    algorithm_options: Mapping[str, Mapping[str, Any]] | None,
    model: Model | None,
    model_table: Mapping[str, Any] | None = None,
) -> Config:
    """The config that keyword ``options`` make, checked by config.py (keys, types, ranges);
    ``model``: the model given as an object (None: ``model_table``'s built-in one)."""
    sections: dict[str, dict[str, Any]] = {"train": {"algorithms": algorithms}, "eval": {}}
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)} - {"algorithms"}
    eval_keys = {f.name for f in dataclasses.fields(EvalConfig)}
    for key, value in options.items():
        if key == "algorithms":
            raise ConfigError("give the algorithms as compare(..., algorithms=[...])")
        if key == "dp":  # the [dp] table as a mapping (differential privacy, fedsub/dp)
            sections["dp"] = dict(value)
        elif key in train_keys:
            sections["train"][key] = value
        elif key in eval_keys:
            sections["eval"][key] = value
        else:
            raise ConfigError(
                f"unknown option {key!r}: expected a [train] key ({', '.join(sorted(train_keys))})"
                f" or an [eval] key ({', '.join(sorted(eval_keys))})"
            )
    masking = sections["train"].get("masking", "none")
    if model is not None and masking != "none" and not isinstance(model, SliceableModel):
        raise ConfigError(
            f"train.masking = {masking!r} needs a width-sliceable model; "
            f"{type(model).__name__} is not one"
        )
    raw: dict[str, Any] = {**sections, "algorithms": dict(algorithm_options or {})}
    if model_table:
        raw["model"] = dict(model_table)
    return config_lib.parse(raw)
