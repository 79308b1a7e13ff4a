"""fedsub's Python API: load a dataset, train a model (a built-in one by name, a fedsub
``Model`` or your own ``torch.nn.Module``), compare algorithms on one schedule, and run a
config exactly as ``fedsub run`` / ``fedsub compare`` do (the command line calls ``run``).

Everything goes through the same machinery as a config file: keyword options are the
config's ``[train]`` / ``[eval]`` keys, checked by config.py; the run is set up by
runs/run_setup.py and trained by runs/experiment.py's ``compare`` (without a run folder unless
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

from fedsub import api_arguments as arguments
from fedsub import config as config_lib
from fedsub import moved_keys
from fedsub.config import Config, EvalConfig, ExecutionConfig, TrainConfig
from fedsub.data.federated import FederatedDataset
from fedsub.engine.initial import ModelFile
from fedsub.errors import ArgumentError, ConfigError
from fedsub.files.run_folder import check_folder_text
from fedsub.keys import key_names
from fedsub.models.base import Model, SliceableModel, Task
from fedsub.models.module_tables import TableSpec
from fedsub.models.torch_module import Loss, TorchModuleModel, wrap
from fedsub.runs import experiment, run_setup
from fedsub.runs.initial_model import StartFile
from fedsub.runs.tracking import RunCallback
from fedsub.submodel.params import Params
from fedsub.vocabulary import RUN_FLAGS, spoken_as

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
      resumed run read this algorithm's finished results back from its folder. With
      row-sharded tables (``table_sharding = "rows"`` under torchrun) no process holds the
      whole model: every process's result reads it, on the CPU, from the one
      ``model.safetensors`` the processes wrote (``model_file``) when ``model`` or ``params``
      is first asked for.
    """

    algorithm: str
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    trained: Params | ModelFile | None  # row-sharded: the file, read when asked for
    fedsub_model: Model | None

    @cached_property
    def params(self) -> Params | None:
        """The trained ``Params`` (read from ``model_file`` on first use when the tables were
        row-sharded)."""
        if self.trained is None or isinstance(self.trained, Params):
            return self.trained
        return self.trained.load()

    @property
    def model_file(self) -> Path | None:
        """A row-sharded run's model file (its run folder's ``model.safetensors``, or, for a
        run without a folder, this process's temporary link to it, removed when its Python
        exits); None when the model is in memory."""
        if self.trained is None or isinstance(self.trained, Params):
            return None
        return self.trained.path

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
        raise ArgumentError(
            f"name must be a dataset's name (fedsub list datasets), got {arguments.described(name)}"
        )
    table: dict[str, Any] = {"name": name, "seed": seed, **options}
    given_path = arguments.folder(path, "path")
    if given_path is not None:
        table["path"] = given_path
    with spoken_as(arguments.data_terms(), arguments=True):
        return run_setup.load_data(config_lib.parse({"data": table}))


def train(
    model: str | Model | nn.Module,
    data: FederatedDataset | str,
    *,
    algorithm: str = "fedsubavg",
    tables: TableSpec | None = None,
    model_options: Mapping[str, Any] | None = None,
    algorithm_options: Mapping[str, Mapping[str, Any]] | None = None,
    loss: Loss | None = None,
    task: Task | None = None,
    initial_model: str | os.PathLike[str] | None = None,
    callbacks: Sequence[RunCallback] | None = None,
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
    - ``loss``, ``task``: for your own ``nn.Module`` only: ``loss(outputs, labels)``, the
      batch mean of a per-sample loss, and the task (``"binary"``, ``"multiclass"``,
      ``"regression"``), when the outputs' shape does not tell them (see
      ``models/torch_module.py: wrap``);
    - ``initial_model``: a ``model.safetensors`` fedsub wrote (a run folder's, or a
      result's ``model_file``) to start from instead of the seeded initial draw (a warm
      start: its tensors are round 0's model; server state and the round count start
      afresh); refused before training, naming every tensor that differs, when it is not a
      model of this model's names, shapes and dtypes;
    - ``train_options``: ``[train]`` and ``[eval]`` keys (``rounds``, ``clients_per_round``,
      ``local_steps``, ``batch_size``, ``lr``, ``seed``, ``every``, ...) and the
      ``[execution]`` / ``[privacy]`` / ``[masking]`` keys by their former ``[train]`` names
      (moved_keys.py: ``device``, ``backend``, ``privacy``, ``masking``, ...) and
      ``table_sharding`` (``[execution]``, row-sharded tables under torchrun); built-in
      defaults otherwise, checked by the rules a config file's keys are (an error names the
      keyword, its value and what is allowed: ``ArgumentError`` / ``ConfigError``);
      ``dp={...}``, ``tracking={...}``, ``privacy={...}``: the ``[dp]``, ``[tracking]`` and
      ``[privacy]`` tables (``privacy="download"``: the level alone);
    - ``callbacks``: after-round hooks (``fedsub.TensorBoardWriter``, ``MlflowWriter`` or
      your ``RunCallback``): each sees the run begin, every round's metrics, its end.

    Examples:
        >>> import fedsub
        >>> result = fedsub.train("sparse-lr", "synthetic-sparse", rounds=2, every=1)
        >>> [e["round"] for e in result.history]
        [0, 1, 2]
        >>> result.summary["diverged"] is None
        True
    """
    _check_one_algorithm(algorithm, train_options)
    given = _Given(
        model, data, tables, model_options, algorithm_options, loss, task, initial_model, callbacks
    )
    terms = arguments.train_terms("algorithm")
    return _compare(given, [algorithm], train_options, terms)[algorithm]


def _check_one_algorithm(algorithm: Any, train_options: Mapping[str, Any]) -> None:
    """``train`` trains one algorithm, given by its name (``compare`` takes several)."""
    if "algorithms" in train_options:
        raise ArgumentError(
            "train() trains one algorithm: give it as algorithm='fedavg' (fedsub.compare "
            "takes algorithms=[...])"
        )
    if not isinstance(algorithm, str):
        raise ArgumentError(
            "algorithm must be an algorithm's name (fedsub list algorithms), got "
            f"{arguments.described(algorithm)}"
        )


def compare(
    model: str | Model | nn.Module,
    data: FederatedDataset | str,
    *,
    algorithms: Sequence[str] = DEFAULT_ALGORITHMS,
    tables: TableSpec | None = None,
    model_options: Mapping[str, Any] | None = None,
    algorithm_options: Mapping[str, Mapping[str, Any]] | None = None,
    loss: Loss | None = None,
    task: Task | None = None,
    initial_model: str | os.PathLike[str] | None = None,
    callbacks: Sequence[RunCallback] | None = None,
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
    names = arguments.names(algorithms, "algorithms")
    given = _Given(
        model, data, tables, model_options, algorithm_options, loss, task, initial_model, callbacks
    )
    return _compare(given, names, train_options, arguments.train_terms())


@dataclass(frozen=True)
class _Given:
    """What ``train`` and ``compare`` were given beside the algorithms and the ``[train]``
    keys, as given (checked by ``_compare``)."""

    model: Any
    data: Any
    tables: Any
    model_options: Any
    algorithm_options: Any
    loss: Any
    task: Any
    initial_model: Any
    callbacks: Any


def _compare(
    given: _Given, algorithms: list[str], train_options: Mapping[str, Any], terms: Mapping[str, str]
) -> Comparison:
    """``compare``'s work for ``train`` and ``compare``: the arguments checked, the config
    built and checked by config.py, errors in the caller's ``terms``."""
    model, tables, loss, task = given.model, given.tables, given.loss, given.task
    options = arguments.mapping(given.model_options, "model_options", "{'embedding_dim': 4}")
    hooks = arguments.tracking_callbacks(given.callbacks)
    start = _start_file(given.initial_model)
    per_algorithm = arguments.tables_of(given.algorithm_options)
    trained = {name.split("@")[0] for name in algorithms}  # fedavg@scheme2 reads fedavg's
    unused = [name for name in per_algorithm if name not in trained]
    if unused:
        raise ArgumentError(
            f"algorithm_options[{unused[0]!r}] is for an algorithm this call does not train "
            f"(it trains {', '.join(algorithms)}); add it to the algorithms or drop its options"
        )
    if isinstance(model, str):
        arguments.model_options_of(model, options)
    model_table = {**options, "name": model} if isinstance(model, str) else dict(options)
    with spoken_as(terms, arguments=True), moved_keys.notes_once():
        dataset = _dataset_of(given.data)
        dtype = train_options.get("dtype", "float32")  # checked by config_of when not one
        dtype = dtype if isinstance(dtype, str) and dtype in ("float32", "float64") else None
        built = _model_of(model, dataset, tables, options, loss, task, dtype)
        config = config_of(train_options, algorithms, per_algorithm, built, model_table)
        outcome = experiment.compare(
            config, None, dataset=dataset, model=built, initial_model=start, callbacks=hooks
        )
    return Comparison.of(outcome)


def _start_file(initial_model: Any) -> StartFile | None:
    """``initial_model``, checked to be a path (its errors name ``--initial-model``, which
    the Python API's terms (vocabulary.RUN_FLAGS) say as ``initial_model``)."""
    path = arguments.model_file(initial_model, "initial_model")
    return None if path is None else StartFile(path)


def run(
    config: Config | Mapping[str, Any] | str | os.PathLike[str],
    *,
    out: str | os.PathLike[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    profile: bool = False,
    stop_requested: Callable[[], bool] | None = None,
    on_round: Callable[[str, int], None] | None = None,
    initial_model: str | os.PathLike[str] | None = None,
    callbacks: Sequence[RunCallback] | None = None,
) -> Comparison:
    """Run a config as ``fedsub compare`` does (``fedsub run`` is the one-algorithm case):
    every algorithm of ``train.algorithms`` on the config's data, model and schedule.

    - ``config``: a ``Config`` (``Config.from_toml``, ``Config.from_dict``), TOML-shaped
      data (a dict: ``Config.from_dict``'s), or a TOML file (or text);
    - ``out``: the run folder to write (run.json, config.toml, summary.json / .md,
      curves.png, per algorithm metrics.jsonl, checkpoints and model.safetensors), following
      the command line's folder rules; None: nothing is written;
    - ``resume``: continue the stopped run in ``out`` (the same config);
      ``overwrite``: replace the run already in ``out``;
    - ``profile``: time each round's phases (``Comparison.profiles``);
    - ``stop_requested``: asked after every round; True stops the run with a checkpoint
      (``engine.loop.Interrupted`` is raised; resume it later);
    - ``on_round(algorithm, round)``: called after every round;
    - ``initial_model``: start every algorithm from this model file (``train``'s
      ``initial_model``); a resume gives the same file (its bytes) again;
    - ``callbacks``: after-round hooks (``train``'s), beside the config's ``[tracking]``.

    Examples:
        >>> import fedsub
        >>> overrides = ["train.rounds=2", "train.algorithms=['fedsubavg']"]
        >>> config = fedsub.Config.from_toml(None, overrides)
        >>> result = fedsub.run(config)
        >>> list(result), result.out is None
        (['fedsubavg'], True)
    """
    with spoken_as(RUN_FLAGS), moved_keys.notes_once():
        return run_config(
            config,
            out=out,
            resume=resume,
            overwrite=overwrite,
            profile=profile,
            stop_requested=stop_requested,
            on_round=on_round,
            initial_model=initial_model,
            callbacks=callbacks,
        )


def run_config(
    config: Config | Mapping[str, Any] | str | os.PathLike[str],
    *,
    out: str | os.PathLike[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    profile: bool = False,
    stop_requested: Callable[[], bool] | None = None,
    on_round: Callable[[str, int], None] | None = None,
    initial_model: str | os.PathLike[str] | None = None,
    callbacks: Sequence[RunCallback] | None = None,
) -> Comparison:
    """``run`` with the run-folder errors in the command line's terms (``--overwrite``,
    ``--resume DIR``, ``--out``): what ``fedsub run`` / ``fedsub compare`` call."""
    config = _config_of(config)
    text = arguments.folder(out, "out")
    for name, value in (("resume", resume), ("overwrite", overwrite), ("profile", profile)):
        arguments.flag(value, name)
    stop, on_round = arguments.run_callbacks(stop_requested, on_round)
    hooks = arguments.tracking_callbacks(callbacks)
    start = _start_file(initial_model)
    folder = None
    if text is not None:
        check_folder_text(text, "out")
        folder = Path(text)
    elif resume or overwrite:
        flag = "resume" if resume else "overwrite"
        raise ArgumentError(f"{flag}=True acts on a run folder: give it as out=")
    outcome = experiment.compare(
        config,
        folder,
        on_round,
        resume,
        stop,
        overwrite,
        profile=profile,
        initial_model=start,
        callbacks=hooks,
    )
    return Comparison.of(outcome)


def _config_of(config: Any) -> Config:
    """``run``'s config: a ``Config``, TOML-shaped data (a dict), or a TOML file or text."""
    if isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return Config.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return Config.from_toml(config)
    raise ArgumentError(
        "config must be a fedsub.Config, a dict of TOML tables ({'train': {...}}), or a TOML "
        f"file's path or text, got {arguments.described(config)}"
    )


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
    texts = _sweep_values(key, values)
    folder = arguments.folder(out, "out")
    if folder is None:
        raise ArgumentError("out must be the sweep's folder (a str or pathlib.Path), got None")
    check_folder_text(folder, "out")
    for name, value in (("resume", resume), ("overwrite", overwrite), ("profile", profile)):
        arguments.flag(value, name)
    stop, on_round = arguments.run_callbacks(stop_requested, on_round)
    base, where = _sweep_base(config)
    with spoken_as(RUN_FLAGS), moved_keys.notes_once():
        outcome = experiment.sweep(
            key,
            texts,
            base,
            Path(folder),
            on_round,
            resume=resume,
            stop_requested=stop,
            overwrite=overwrite,
            where=where,
            profile=profile,
        )
    diverged = {name: str(d) for name, d in outcome.diverged.items()}
    return Sweep(outcome.summary, outcome.markdown, Path(folder), diverged)


def _sweep_values(key: Any, values: Any) -> list[str]:
    """``sweep``'s values as ``--sweep`` texts (a non-text value as TOML), refused unless
    ``key`` is text and the values a non-empty list without repeats."""
    if not isinstance(key, str):
        raise ArgumentError(
            f"key must be a config key such as 'train.lr', got {arguments.described(key)}"
        )
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise ArgumentError(
            f"values must be a list of the values of {key!r} to sweep, e.g. [5, 10], got "
            f"{arguments.described(values)}"
        )
    texts = [v if isinstance(v, str) else config_lib.toml_value(v) for v in values]
    if not texts:
        raise ArgumentError(f"sweep of {key!r}: give at least one value")
    twice = experiment.repeated_value(texts)
    if twice is not None:
        raise ArgumentError(f"sweep of {key!r}: value {twice!r} is given twice")
    return texts


def _sweep_base(config: Any) -> tuple[dict[str, Any], str]:
    """``sweep``'s config as TOML tables (each value is applied to them before they are
    checked) and where an error says they come from."""
    if isinstance(config, Config):
        return tomllib.loads(config.to_toml()), "the config"
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config)), "the config"
    if config is None or isinstance(config, (str, os.PathLike)):
        path = config_lib.default_config_path() if config is None else Path(config)
        return config_lib.read_toml(path), str(path)
    raise ArgumentError(
        "config must be a TOML file's path, a dict of TOML tables, a fedsub.Config or "
        f"None, got {arguments.described(config)}"
    )


def _dataset_of(data: FederatedDataset | str) -> FederatedDataset:
    if isinstance(data, str):  # a dataset's name: loaded with its defaults
        with spoken_as({r"data\.name": "data"}, arguments=True):
            return run_setup.load_data(config_lib.parse({"data": {"name": data}}))
    if not isinstance(data, FederatedDataset):
        raise ArgumentError(
            "data must be a FederatedDataset (fedsub.load_dataset, fedsub.from_clients, ...) "
            f"or a dataset's name, got {arguments.described(data)}"
        )
    return data


def _model_of(
    model: str | Model | nn.Module,
    dataset: FederatedDataset,
    tables: Any,
    model_options: Mapping[str, Any],
    loss: Any,
    task: Any,
    dtype: Any,
) -> Model | None:
    """The model to train when it is given as an object (None: a built-in one, by name,
    built by run_setup from the config's ``[model]``)."""
    for_module = [
        n for n, v in (("tables", tables), ("loss", loss), ("task", task)) if v is not None
    ]
    if isinstance(model, nn.Module):
        if model_options:
            raise ArgumentError(
                "model_options are a built-in model's [model] keys; give the model by its name "
                f"(fedsub list models), not as a {type(model).__name__}"
            )
        if tables is not None and not isinstance(tables, Mapping):
            raise ArgumentError(
                "tables must be a dict from table name to the embedding module (or its "
                f"attribute path), e.g. tables={{'item': module.items}}, got "
                f"{arguments.described(tables)}"
            )
        return wrap(model, dataset, tables=tables, loss=loss, task=task, dtype=dtype)
    if not isinstance(model, (str, Model)):
        raise ArgumentError(
            "model must be a built-in model's name (fedsub list models), a fedsub Model or a "
            f"torch.nn.Module, got {arguments.described(model)}"
        )
    if for_module:
        owner = "a built-in model" if isinstance(model, str) else "a fedsub Model"
        raise ArgumentError(
            f"{'= and '.join(for_module)}= are for your own torch.nn.Module (its tables, loss "
            f"and task); {owner} has its own"
        )
    if isinstance(model, str):
        return None
    if model_options:
        raise ArgumentError(
            "model_options are a built-in model's [model] keys; give the model by its name "
            f"(fedsub list models), not as a {type(model).__name__}"
        )
    return model


def _merge_section(
    sections: dict[str, dict[str, Any]], name: str, keys: Mapping[str, Any], keyword: str
) -> None:
    """Add ``keys`` to the ``[name]`` table, refusing a key two keyword arguments give (the
    ``privacy={...}`` table and a key's former ``[train]`` name, e.g. ``download=``)."""
    section = sections.setdefault(name, {})
    twice = sorted(set(section) & set(keys))
    if twice:
        raise ArgumentError(
            f"{keyword}: [{name}] {', '.join(twice)} given twice (once in privacy={{...}}, "
            "once by its own keyword); give each key once"
        )
    section.update(keys)


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
    train_keys = set(key_names(TrainConfig)) - {"algorithms"}
    train_keys |= set(moved_keys.MOVED)  # execution, privacy and masking keys, by old name
    eval_keys = set(key_names(EvalConfig))
    # [execution] keys added since the move, by their own name (table_sharding)
    execution_keys = set(key_names(ExecutionConfig)) - train_keys
    for key, value in options.items():
        if key == "algorithms":
            raise ArgumentError("give the algorithms as compare(..., algorithms=[...])")
        if key in ("dp", "tracking"):  # [dp] (differential privacy), [tracking]: mappings
            if not isinstance(value, Mapping):
                example = "clip=1.0" if key == "dp" else "tensorboard=True"
                raise ArgumentError(
                    f"{key} must be a dict of [{key}] keys (e.g. {example}), got {value!r}"
                )
            sections[key] = dict(value)
        elif key == "privacy" and isinstance(value, Mapping):  # the whole [privacy] table
            _merge_section(sections, "privacy", value, key)
        elif (place := moved_keys.keyword_place(key)) is not None:
            _merge_section(sections, place[0], {place[1]: value}, key)
        elif key in execution_keys:
            sections.setdefault("execution", {})[key] = value
        elif key in train_keys:
            sections["train"][key] = value
        elif key in eval_keys:
            sections["eval"][key] = value
        else:
            raise ArgumentError(
                f"unknown option {key!r}: expected a [train] key or an [execution] / [privacy] / "
                f"[masking] key by its former [train] name ({', '.join(sorted(train_keys))})"
                f", an [execution] key ({', '.join(sorted(execution_keys))}), an [eval] key "
                f"({', '.join(sorted(eval_keys))}), dp or tracking"
            )
    masking = sections.get("masking", {}).get("scheme", "none")
    masked = isinstance(masking, str) and masking != "none"  # a non-string: config.py refuses
    if model is not None and masked and not isinstance(model, SliceableModel):
        raise ConfigError(
            f"masking.scheme = {masking!r} needs a width-sliceable model; "
            f"{type(model).__name__} is not one"
        )
    raw: dict[str, Any] = {**sections, "algorithms": dict(algorithm_options or {})}
    if model_table:
        raw["model"] = dict(model_table)
    return config_lib.parse(raw)
