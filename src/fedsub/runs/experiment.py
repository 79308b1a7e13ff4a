"""A comparison: several algorithms trained on the same data, model init and client schedule;
and sweeps of one key over several values (the papers' Table 3)."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from fedsub import config as config_lib
from fedsub import distributed
from fedsub.algorithms.registry import build_algorithm
from fedsub.clock.hooks import wrapper as clock_wrapper
from fedsub.config import Config
from fedsub.data.federated import FederatedDataset
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.features.dp import dp_scope_markdown  # a sweep's summary of [dp] runs
from fedsub.engine.features.private import PrivateReport  # privacy.json, the costs
from fedsub.engine.features.row_sharding import written_model
from fedsub.engine.guards import Rejection
from fedsub.engine.in_process import train
from fedsub.engine.initial import ModelFile
from fedsub.engine.loop import Diverged, Evaluation, RunControl
from fedsub.errors import ConfigError, FedsubError
from fedsub.files.json_values import dumps
from fedsub.files.run_folder import (
    DONE,
    RUN_FILE,
    Claim,
    RunIdentity,
    comparison_outputs,
    hash_config,
    identity_of,
    new_identity,
    read_run_file,
    sweep_outputs,
)
from fedsub.models.base import Model
from fedsub.moved_keys import current_name, in_sections
from fedsub.profiling import RoundProfile, profiling
from fedsub.progress import current as current_reporter
from fedsub.progress import phase
from fedsub.runs.initial_model import RECORD, StartFile, check_resumed_start
from fedsub.runs.report import (
    JsonLines,
    Target,
    metrics_table,
    outcome_cell,
    plot_curves,
    read_metrics,
    summary,
    summary_markdown,
    write_atomic,
)
from fedsub.runs.run_identity import (
    IN_CONFIG_FILE,
)
from fedsub.runs.run_session import (
    Attempt,
    Keeps,
    ResumePoint,
    RunSession,
    Tracked,
    check_free_space,
)
from fedsub.runs.run_setup import (
    Reports,
    Setup,
    checked_model,
    load_data,
    prepare,
    reports_of,
    resolve_path,
    settle_heat_coins,
    with_resolved_paths,
)
from fedsub.runs.tracking import (
    RunCallback,
    numbers,
    tracking_outputs,
    writers_of,
)
from fedsub.submodel.params import Params

CENTRAL = "central-sgd"
REJECTIONS = "rejections.jsonl"  # an algorithm's updates the guards rejected
PROFILE = "profile.json"  # in an algorithm's folder, with --profile (run_folder.ALGORITHM_FILES)
LOG = logging.getLogger("fedsub")


@dataclass(frozen=True)
class Outcome:
    """What a comparison (or a sweep) gave: its summary (summary.json's record) and
    summary.md, where it was written (None: nowhere), and per algorithm its evaluations,
    final parameters (those trained in this call, not diverged) and divergence."""

    summary: dict
    markdown: str
    out_dir: Path | None
    diverged: dict[str, Diverged] = dataclasses.field(default_factory=dict)  # by algorithm
    # by algorithm: where its rounds' time went (``--profile``; fedsub/profiling.py)
    profiles: dict[str, dict] = dataclasses.field(default_factory=dict)
    histories: dict[str, list[Evaluation]] = dataclasses.field(default_factory=dict)
    # row-sharded runs (fedsub/sharding): the model file instead, read when asked for
    params: dict[str, Params | ModelFile] = dataclasses.field(default_factory=dict)
    model: Model | None = None  # the model every algorithm trained (a comparison's)

    def divergence_message(self) -> str:
        """One line naming every diverged algorithm, its round and why ("" when none)."""
        return "; ".join(
            f"{name} diverged at round {d.round} ({d.reason})" for name, d in self.diverged.items()
        )


DP_WITHHELD = (
    "withheld under [dp]: bytes per client and clipped values are statistics of the sampled "
    "clients' data that epsilon does not cover (docs: the run folder)"
)


def _log_rejection(algorithm: str, rejection: Rejection, log: JsonLines) -> None:
    LOG.warning(
        "%s round %d: rejected client %d: %s",
        algorithm,
        rejection.round,
        rejection.client,
        rejection.reason,
    )
    log(rejection.as_json())


def algorithms_to_run(config: Config) -> list[str]:
    """The configured algorithms; CentralSGD first when the target is its minimum loss."""
    names = list(config.train.algorithms)
    if config.eval.target_train_loss == "central-min":
        names = [CENTRAL, *(n for n in names if n != CENTRAL)]
    return names


def target_of(config: Config, histories: dict[str, list[Evaluation]]) -> Target:
    wanted = config.eval.target_train_loss
    loss: float | None
    if wanted == "central-min":
        losses = [e.metrics["train_loss"] for e in histories[CENTRAL]]
        loss = min((x for x in losses if math.isfinite(x)), default=None)
    elif isinstance(wanted, str):
        raise ConfigError(
            f'eval.target_train_loss = {wanted!r}: expected a number or "central-min"'
        )
    else:
        loss = wanted
    return Target(loss, config.eval.target_test_auc)


@dataclass(frozen=True)
class AlgorithmRun:
    """One algorithm of a comparison in its folder (its ``Attempt`` in the comparison's
    session, runs/run_session.py: metrics log, checkpoints, resume point, final model and
    completion marker) with its rejections, privacy record and profile (all written only by
    a process that writes: under torchrun, process 0 writes and the others train silently
    alongside; from Python, a run without a folder writes nothing)."""

    name: str
    session: RunSession  # the comparison's folder: this algorithm's is its subfolder ``name``
    config: Config
    saved: checkpoint_lib.Checkpoint | None
    stop_requested: Callable[[], bool]
    on_round: Callable[[str, int], None] | None
    # where the time of each round goes (per phase), written to profile.json (``--profile``)
    profile: RoundProfile | None = None
    label: str = ""  # the progress bar's prefix of this run's name (a sweep's value)
    start: ModelFile | None = None  # round 0's model from a file (a warm start), or drawn
    callbacks: tuple[RunCallback, ...] = ()  # after-round hooks (runs/tracking.py)

    @property
    def seeded_dp(self) -> bool:
        """[dp] with dp.randomness = "seeded": its epsilon is not a guarantee."""
        d = self.config.dp
        return d.mechanism != "none" and d.trust.randomness == "seeded"

    def train(
        self, model, algorithm, dataset, index, schedule, evaluator
    ) -> tuple[list[Evaluation], Diverged | None, Params | ModelFile | None]:
        """The algorithm's evaluations, its divergence when it diverged (then no final
        model or completion marker is written; the other algorithms still run) and its final
        parameters (None when it diverged)."""
        with profiling(self.profile):
            try:
                return self._train(model, algorithm, dataset, index, schedule, evaluator)
            finally:
                folder = self.session.place(self.name)
                if self.profile is not None and folder is not None:
                    text = dumps(self.profile.as_json(), indent=2) + "\n"
                    write_atomic(folder / PROFILE, text)

    def _train(
        self, model, algorithm, dataset, index, schedule, evaluator
    ) -> tuple[list[Evaluation], Diverged | None, Params | ModelFile | None]:
        every = self.config.train.checkpoint_every
        attempt = self.session.attempt(
            self.name, self.saved, every, Keeps(fresh=(DONE, REJECTIONS)), self._tracked()
        )
        folder, reports = attempt.folder, reports_of(self.config, schedule)
        on_reject = None
        if folder is not None:
            rejections = JsonLines(folder / REJECTIONS)
            on_reject = lambda rejection: _log_rejection(self.name, rejection, rejections)  # noqa: E731
        private = PrivateReport()
        guards = RunControl(
            max_update_norm=self.config.train.max_update_norm,
            stop_requested=self.stop_requested,
            on_reject=on_reject,
            divergence_factor=self.config.eval.divergence_factor,
            watch=private.watch(),
        )
        ended: BaseException | None = None
        try:
            final = train(
                model,
                algorithm,
                dataset,
                index,
                schedule,
                evaluator,
                on_evaluation=lambda evaluation: self._record(attempt, evaluation),
                on_round=lambda r: self._round_done(reports, r, attempt, private),
                control=attempt.control(guards),
                start=self.start,
                wrap_runtime=clock_wrapper(self.config.clock),  # [clock] (fedsub/clock, issue 51)
            )
        except Diverged as error:
            LOG.warning("%s", error)
            ended = error
            return attempt.history, error, None
        except BaseException as error:
            ended = error
            raise
        finally:
            attempt.end(ended)
            if folder is not None:  # process 0 writes
                self._write_privacy(folder, private, reports)
        written = written_model(folder, final)  # row-sharded: every process writes its rows
        if written is None:
            attempt.write_model(final)
        attempt.mark_done()
        return attempt.history, None, final if written is None else written

    def _tracked(self) -> Tracked:
        """How the trackers name this algorithm's run: the sweep's value, the algorithm."""
        return Tracked.of(
            self.callbacks, self.config, self.name, self.label + self.name, "in-process"
        )

    def _round_done(
        self, reports: Reports, r: int, attempt: Attempt, private: PrivateReport
    ) -> None:
        """After round ``r``: the caller's hook, under [dp] the progress line's epsilon
        spent so far, evaluated or not (in process a function of the settings and r), and the
        round's metrics to the trackers (with a private level's costs so far, withheld
        under [dp] as in privacy.json). The epsilon is computed only when a tracker or the
        progress line reads it (the silent reporter, no tracker: not computed; an
        evaluation's epsilon is the ledger's, unchanged)."""
        if self.on_round is not None:
            self.on_round(self.name, r)
        extra: dict[str, float] = {}
        if reports and attempt.feed is None and not current_reporter().shows_notes:
            attempt.on_round(r, extra)  # nobody reads [dp]'s epsilon now: not computed
            return
        for report in reports:  # the features' (engine/features/: [dp]'s epsilon)
            extra.update(report.round_metrics(r))
        if "epsilon" in extra:
            self._note_epsilon(extra["epsilon"])
        elif (costs := private.costs()) is not None:
            extra.update(numbers(costs, "privacy/"))
        attempt.on_round(r, extra)

    def _record(self, attempt: Attempt, evaluation: Evaluation) -> None:
        """Log an evaluation (to the trackers too); under [dp] the progress line shows the
        epsilon spent so far."""
        attempt.on_evaluation(evaluation)
        if "epsilon" in evaluation.metrics:
            self._note_epsilon(evaluation.metrics["epsilon"])

    def _note_epsilon(self, spent: float) -> None:
        """The progress line's epsilon, said to be no guarantee when the randomness is seeded."""
        text = f"epsilon {spent:.3g}" + (" (seeded: not a guarantee)" if self.seeded_dp else "")
        current_reporter().note(self.label + self.name, text)

    def _write_privacy(self, folder: Path, private: PrivateReport, reports: Reports) -> None:
        """privacy.json: the privacy level's guarantees and what it cost; under [dp] without
        its costs (the means of the sampled clients' bytes, the clipped values: statistics of
        the clients' data that no epsilon covers, so not in a file meant for publication)."""
        withheld = DP_WITHHELD if self.config.dp.mechanism != "none" else None
        for record, clipped, clip in private.records(withheld):
            for report in reports:  # [dp] with seeded randomness: not a guarantee
                record.update(report.notes())
            write_atomic(folder / "privacy.json", dumps(record, indent=2) + "\n")
            if clipped:
                LOG.warning(
                    "%s: secure aggregation clipped %d values to privacy.secagg_clip = %g; "
                    "raise it if that is not intended",
                    self.name,
                    clipped,
                    clip,
                )


def compare(
    config: Config,
    out_dir: Path | None,
    on_round: Callable[[str, int], None] | None = None,
    resume: bool = False,
    stop_requested: Callable[[], bool] = lambda: False,
    overwrite: bool = False,
    label: str = "",
    profile: bool = False,
    *,
    dataset: FederatedDataset | None = None,
    model: Model | None = None,
    initial_model: StartFile | None = None,
    callbacks: Sequence[RunCallback] = (),
) -> Outcome:
    """Train every algorithm of the comparison and write the run's outputs (``out_dir``
    None: write nothing, e.g. from Python, where ``dataset`` and ``model`` may be given in
    memory instead of the config's ``[data]`` and ``[model]``).

    ``initial_model``: every algorithm's round-0 model is that file's (a warm start,
    runs/initial_model.py), checked before anything is written: a missing or unreadable file
    before the folder is claimed, a file that is not the run's model before its run.json;
    its digest is part of the run's identity, and a resume must give the same bytes.

    ``profile``: time each round's phases (fedsub/profiling.py) into each algorithm's
    profile.json and the outcome's ``profiles`` (on a GPU the device is synchronized at every
    phase boundary, so only then).

    The folder follows run_folder.py's rules: a new run refuses a folder holding another run
    unless ``overwrite``, holds the folder's lock while it runs, and when it fails before its
    first round completes leaves the folder as it found it (a replaced run put back, a folder
    it made removed). With ``resume``,
    every piece read back is checked to belong to the run in ``out_dir/run.json``: finished
    algorithms are read back, an interrupted one continues from its newest intact
    checkpoint, and the rest run from the start. Data are loaded and checked before the
    training bar appears; ``label`` prefixes the bar's algorithm names (a sweep's value).

    Under torchrun every process runs this (each reads the folder when resuming), trains its
    share of each cohort, and only process 0 checks and writes the folder."""
    config = with_resolved_paths(config)
    writes, trackers = _before_claiming(config, out_dir is not None, initial_model, callbacks)
    if out_dir is None:
        if resume:
            raise ConfigError("resume continues a run in its folder: give the folder")
        with _fits_in_memory(dataset):
            return _compare_in(
                config, RunSession(), on_round, stop_requested, label, profile,
                dataset=dataset, model=model, initial_model=initial_model, callbacks=trackers,
            )  # fmt: skip
    _check_folder_run(
        out_dir, dataset is not None or model is not None, initial_model, overwrite and not resume
    )
    opened = RunSession.opened(out_dir, resume, overwrite, writes=writes)
    with opened as session, _fits_in_memory(None):
        return _compare_in(
            config, session, on_round, stop_requested, label, profile,
            initial_model=initial_model, callbacks=trackers,
        )  # fmt: skip


def _before_claiming(
    config: Config,
    to_folder: bool,
    initial_model: StartFile | None,
    callbacks: Sequence[RunCallback],
) -> tuple[bool, tuple[RunCallback, ...]]:
    """What is refused before the folder is claimed (a start file missing or unreadable, a
    tracker's library missing); whether this process writes, and its trackers (process 0's
    only: the config's writers, then ``callbacks``)."""
    if initial_model is not None:
        initial_model.opened()
    writes = distributed.from_environment().writes
    trackers = (*writers_of(config.tracking, to_folder), *callbacks) if writes else ()
    return writes, trackers


def _check_folder_run(
    out_dir: Path, in_memory: bool, initial_model: StartFile | None, replacing: bool
) -> None:
    """Refuse a run to a folder that cannot be recorded: data or a model given in memory (the
    folder's config would not make the run), or a start file inside the folder a new run
    replaces (``--overwrite`` would delete it)."""
    if in_memory:
        raise ConfigError(
            "a run folder records the config that made the run, so a run written to "
            f"{out_dir} reads its data and model from the config, not from memory"
        )
    if initial_model is not None and replacing:
        initial_model.outside(out_dir, "--overwrite")


@contextmanager
def _fits_in_memory(dataset: FederatedDataset | None) -> Iterator[None]:
    """A run that runs out of host or GPU memory ends in a FedsubError saying so (with the
    tables' sizes when the dataset is at hand), not a MemoryError from inside torch."""
    try:
        yield
    except (MemoryError, torch.OutOfMemoryError) as error:
        tables = ""
        if dataset is not None and dataset.table_rows:
            sizes = ", ".join(f"{t}: {rows:,} rows" for t, rows in dataset.table_rows.items())
            tables = f"; the dataset's tables have {sizes}"
        raise FedsubError(
            f"the run does not fit in memory ({type(error).__name__}: {error}){tables}. Smaller "
            "tables (table_rows, the dataset's options), a smaller model or cohort, or "
            'execution.table_placement = "host" on a GPU may fit'
        ) from None


def _trained(
    session: RunSession,
    on_round: Callable[[str, int], None] | None,
    name: str,
    round_index: int,
) -> None:
    """After a round of ``name``: the folder has training in it, and the caller is told."""
    session.training_started()
    if on_round is not None:
        on_round(name, round_index)


def _train_algorithm(
    run: AlgorithmRun, setup: Setup, config: Config
) -> tuple[list[Evaluation], Diverged | None, Params | ModelFile | None]:
    """``run``'s algorithm built for ``setup`` and trained: its evaluations, why it diverged
    (or None) and its final model."""
    with phase(f"{run.label}{run.name}: preparing"):
        algorithm = build_algorithm(run.name, setup.context, config.algorithm_options(run.name))
    return run.train(
        setup.model, algorithm, setup.dataset, setup.index, setup.schedule, setup.evaluator
    )


def _compare_in(
    config: Config,
    session: RunSession,
    on_round: Callable[[str, int], None] | None,
    stop_requested: Callable[[], bool],
    label: str,
    profile: bool = False,
    *,
    dataset: FederatedDataset | None = None,
    model: Model | None = None,
    initial_model: StartFile | None = None,
    callbacks: Sequence[RunCallback] = (),
) -> Outcome:
    """``compare`` in its folder, held by ``session`` (its claim None: a process that writes
    nothing; its folder None: no folder at all)."""
    names = algorithms_to_run(config)
    out_dir, claim = session.folder, session.claim
    setup, points, start = _started(config, session, names, dataset, model, initial_model)
    if distributed.joined() is not None:
        stop_requested = distributed.agreed(stop_requested)

    trained = functools.partial(_trained, session, on_round)
    histories: dict[str, list[Evaluation]] = {}
    diverged: dict[str, Diverged] = {}
    profiles: dict[str, dict] = {}
    finals: dict[str, Params | ModelFile] = {}
    reporter = current_reporter()
    reporter.training([(label + name, setup.schedule.rounds) for name in names])
    for name in names:
        if points[name].done and out_dir is not None:
            histories[name] = read_metrics(out_dir / name / "metrics.jsonl")
            reporter.round(label + name, setup.schedule.rounds)
            continue
        saved = points[name].checkpoint
        run = AlgorithmRun(
            name,
            session,
            config,
            saved,
            stop_requested,
            _reported(label, trained),
            RoundProfile(synchronizer(setup.schedule.execution.device)) if profile else None,
            label,
            start,
            tuple(callbacks),
        )
        histories[name], divergence, final = _train_algorithm(run, setup, config)
        if divergence is not None:
            diverged[name] = divergence
        if final is not None:
            finals[name] = final  # row-sharded: the model file every process can read
        if run.profile is not None:
            profiles[name] = run.profile.as_json()

    result, markdown = _summary(config, setup, histories, diverged)
    if claim is not None:
        _write_summary(config, setup, histories, diverged, claim.folder, result, markdown)
    return Outcome(result, markdown, out_dir, diverged, profiles, histories, finals, setup.model)


def _heat_secret_holders(
    session: RunSession, points: dict[str, ResumePoint]
) -> list[checkpoint_lib.StageStates]:
    """The stages of the checkpoints that keep the run's randomized-response heat secret
    (privacy/randomness.py ``HeatCoins``): those the run continues, or, when it continues none,
    a finished algorithm's newest (so an algorithm that starts now computes the same heat)."""
    resumed = [p.checkpoint.stages for p in points.values() if p.checkpoint is not None]
    if resumed or session.folder is None:
        return resumed
    finished = (session.newest(name) for name, p in points.items() if p.done)
    return [saved.stages for saved in finished if saved is not None][:1]


def _started(
    config: Config,
    session: RunSession,
    names: list[str],
    dataset: FederatedDataset | None,
    model: Model | None,
    initial_model: StartFile | None,
) -> tuple[Setup, dict[str, ResumePoint], ModelFile | None]:
    """The run made ready to train, in the order the folder's rules need: a resumed run
    checked against its folder (its algorithms' resume points read) before anything is
    prepared, the data, model and start file prepared and checked, this process joined to
    the others, and only then a new run's identity and the data records written. The setup,
    each algorithm's resume point and the checked start file."""
    config_text = config_lib.to_toml(config)
    started = IN_CONFIG_FILE if initial_model is None else initial_model.started_with()
    out_dir, claim, resume = session.folder, session.claim, session.resume
    if resume and out_dir is not None:
        check_resumed_start(out_dir, initial_model)
        session.resumed(config_text, started)
        points = {n: session.resume_point(n) for n in names}
    if claim is not None:
        check_free_space(claim.folder)
    setup = prepare(config, dataset, model)
    start = None if initial_model is None else initial_model.check(setup.model, setup.schedule)
    processes = distributed.join(setup.schedule.execution.device)
    if (
        setup.schedule.execution.table_sharding == "rows" and processes.split
    ):  # this process's rows' heat
        setup = dataclasses.replace(setup, context=setup.context.sharded(processes))
    distributed.barrier("starting the run")  # all have read the folder: 0 may write
    if not resume:
        _new_run(session, config, names, initial_model)
        points = {n: ResumePoint() for n in names}
    if setup.context.privacy.coins is not None:  # before any algorithm computes the heat
        settle_heat_coins(setup, _heat_secret_holders(session, points))
    if claim is not None:
        _write_data_records(setup, claim.folder)
    return setup, points, start


def _new_run(
    session: RunSession, config: Config, names: list[str], initial_model: StartFile | None
) -> RunIdentity:
    """A new run's identity, written to its folder's run.json (when ``session`` writes; with
    the model file it starts from, when it does); a process that writes nothing only stamps
    with it."""
    started, config_text = IN_CONFIG_FILE, config_lib.to_toml(config)
    outputs = [*comparison_outputs(names), *tracking_outputs(config.tracking, names)]
    manifest: dict[str, object] = {"outputs": outputs}
    if initial_model is not None:
        started = initial_model.started_with()
        manifest[RECORD] = initial_model.record()
    return session.started(config_text, started, manifest)


def synchronizer(device: torch.device) -> Callable[[], None] | None:
    """What makes a phase's timing include its queued kernels: a CUDA device's synchronize
    (None elsewhere: CPU ops finish before they return)."""
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.synchronize(device)


def _write_data_records(setup: Setup, out_dir: Path) -> None:
    """What the run's data gave: the heat source's guarantees and the feature scaling."""
    if setup.heat_source is not None:
        text = dumps(setup.heat_source, indent=2) + "\n"
        write_atomic(out_dir / "heat_source.json", text)
    if setup.dataset.feature_scaling is not None:
        scaling = dumps(setup.dataset.feature_scaling, indent=2) + "\n"
        write_atomic(out_dir / "feature_scaling.json", scaling)


def _summary(
    config: Config,
    setup: Setup,
    histories: dict[str, list[Evaluation]],
    diverged: dict[str, Diverged],
) -> tuple[dict, str]:
    """The comparison's summary.json record and summary.md text."""
    target = target_of(config, histories)
    result = summary(histories, target, {n: (d.round, d.reason) for n, d in diverged.items()})
    markdown = summary_markdown(result, target, setup.schedule.rounds)
    for report in reports_of(config, setup.schedule):  # the features' ([dp]'s epsilon)
        for name, history in histories.items():
            result["algorithms"][name].update(report.summary(history))
        markdown += report.markdown()
    return result, markdown


def _write_summary(
    config: Config,
    setup: Setup,
    histories: dict[str, list[Evaluation]],
    diverged: dict[str, Diverged],
    out_dir: Path,
    result: dict,
    markdown: str,
) -> None:
    """The comparison's summary.json, summary.md and curves.png, written."""
    write_atomic(out_dir / "summary.json", dumps(result, indent=2) + "\n")
    write_atomic(out_dir / "summary.md", markdown)
    stopped = {n: d.round for n, d in diverged.items()}
    target = target_of(config, histories)
    plot_curves(
        histories, out_dir / "curves.png", _title(config, setup, histories), target, stopped
    )


def _title(config: Config, setup: Setup, histories: dict[str, list[Evaluation]]) -> str:
    """curves.png's title: the data, the algorithms and, when set, the masking scheme."""
    title = f"{setup.dataset.name}: {', '.join(histories)}"
    if config.masking.scheme != "none":
        title += f" (masking {config.masking.scheme})"
    return title


def value_folder(key: str, value: str) -> str:
    """The folder of a sweep's value: ``key=value``, a path separator in the value written
    ``%2F`` (a value such as a data.path stays one folder)."""
    return f"{key}={value}".replace("%", "%25").replace("/", "%2F").replace(os.sep, "%2F")


def repeated_value(values: list[str]) -> str | None:
    """The first (in sorted order) of ``values`` given more than once, or None: a sweep runs
    each value once, in a folder named by it."""
    twice = sorted({v for v in values if values.count(v) > 1})
    return twice[0] if twice else None


def sweep_config(base: dict, key: str, value: str, where: str) -> Config:
    """The comparison a sweep runs at one value: the base config with ``key = value``."""
    try:
        return config_lib.parse(config_lib.apply_overrides(base, [f"{key}={value}"]))
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def _check_every_value(key: str, configs: dict[str, Config]) -> None:
    """Each value's data loaded and its model checked against them (run_setup.checked_model:
    clients per round, batch size, targets, ...) before the first value trains, so that a
    later impossible value is refused before any training; data shared by several values
    are loaded once."""
    datasets: dict[str, FederatedDataset] = {}
    for value, config in configs.items():
        try:
            resolved = with_resolved_paths(config)
            data_key = config_lib.toml_value(dataclasses.asdict(resolved.data))
            if data_key not in datasets:
                datasets[data_key] = load_data(resolved)
            checked_model(resolved, datasets[data_key])
        except FedsubError as error:
            raise type(error)(f"sweep value {key}={value}: {error}") from None


def resolved_base(base: dict) -> dict:
    """A sweep's raw base config with ``data.path`` absolute (see ``resolve_path``)."""
    path = base.get("data", {}).get("path")
    if not isinstance(path, str):
        return base
    return {**base, "data": {**base["data"], "path": resolve_path(path)}}


def read_sweep(out_dir: Path) -> tuple[str, list[str], dict]:
    """The key, values and base config of the sweep in ``out_dir`` (for ``--resume``)."""
    record = read_run_file(out_dir)
    if record.get("kind") != "sweep":
        raise FedsubError(f"{out_dir / RUN_FILE} is not a sweep's run file")
    try:
        return str(record["key"]), [str(v) for v in record["values"]], dict(record["base"])
    except (KeyError, TypeError, ValueError) as error:
        raise FedsubError(f"{out_dir / RUN_FILE}: not a readable sweep record ({error})") from None


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
    base: dict,
    out_dir: Path,
    on_round: Callable[[str, int], None] | None = None,
    resume: bool = False,
    stop_requested: Callable[[], bool] = lambda: False,
    overwrite: bool = False,
    where: str = "sweep",
    profile: bool = False,
) -> Outcome:
    """One comparison per value of ``key`` (in ``out_dir/<key>=<value>/``), then a Table-3
    style table: rounds to target of each algorithm at each value.

    ``base`` is the raw config (TOML tables, overrides applied) every value starts from; it is
    stored in ``out_dir/run.json`` so ``resume`` can rebuild each value's config: finished
    values are read back (and checked), an interrupted one continues, the rest start."""
    base = resolved_base(base)
    if resume:
        key = recorded_key(out_dir, key)
    configs = {v: sweep_config(base, key, v, where) for v in values}  # all valid before training
    _check_every_value(key, configs)
    writes = distributed.from_environment().writes
    with RunSession.opened(out_dir, resume, overwrite, writes=writes) as session:
        if session.claim is not None:
            _open_sweep_folder(session.claim, key, values, base, resume)
        outcomes = _sweep_values(
            key, values, configs, out_dir, session, on_round, resume, stop_requested, profile
        )
        return _sweep_summary(key, values, configs, outcomes, out_dir, writes)


def _sweep_summary(
    key: str,
    values: list[str],
    configs: dict[str, Config],
    outcomes: dict[str, Outcome],
    out_dir: Path,
    writes: bool,
) -> Outcome:
    """The sweep's Outcome, and (``writes``) its sweep.json, sweep.md and curves.png."""
    diverged = {f"{n} ({key}={v})": d for v, o in outcomes.items() for n, d in o.diverged.items()}
    if not writes:
        return Outcome({}, "", out_dir, diverged)
    rounds = {v: configs[v].train.rounds for v in values}
    result = _sweep_result(key, values, outcomes)
    markdown = _sweep_markdown(key, values, outcomes, rounds)
    panels, target = _sweep_curves(key, outcomes, out_dir)
    stopped = {
        n: {
            f"{key}={v}": d.round
            for v, o in outcomes.items()
            for m, d in o.diverged.items()
            if m == n
        }
        for n in panels
    }
    plot_curves(panels, out_dir / "curves.png", f"sweep of {key}", target, stopped)
    write_atomic(out_dir / "sweep.json", dumps(result, indent=2) + "\n")
    write_atomic(out_dir / "sweep.md", markdown)
    return Outcome(result, markdown, out_dir, diverged)


def _sweep_values(
    key: str,
    values: list[str],
    configs: dict[str, Config],
    out_dir: Path,
    session: RunSession,
    on_round: Callable[[str, int], None] | None,
    resume: bool,
    stop_requested: Callable[[], bool],
    profile: bool = False,
) -> dict[str, Outcome]:
    """Each value's comparison in its folder (``out_dir/<key>=<value>``), one after another."""

    trained = functools.partial(_trained, session, on_round)
    outcomes: dict[str, Outcome] = {}
    for v in values:
        folder = out_dir / value_folder(key, v)
        distributed.barrier(f"starting {key}={v}")  # all look at the folder before 0 writes
        again = resume and (folder / RUN_FILE).exists()
        if resume and not again:
            LOG.info("resume: %s=%s starts fresh in %s", key, v, folder)
        outcomes[v] = compare(
            configs[v],
            folder,
            trained,
            again,
            stop_requested,
            label=f"{key}={v}: ",
            profile=profile,
        )
    return outcomes


def _open_sweep_folder(claim: Claim, key: str, values: list[str], base: dict, resume: bool) -> None:
    """Claim the folder for a new sweep (its values' folders are its nested runs), or check a
    resumed one's base config."""
    base_text = json.dumps(base, sort_keys=True, default=str)
    out_dir = claim.folder
    if resume:
        identity = identity_of(read_run_file(out_dir))
        if identity.config_hash != hash_config(base_text) and not _same_base(out_dir, base):
            raise FedsubError(f"{out_dir / RUN_FILE}: its base config does not match its hash")
        return
    record = {
        "kind": "sweep",
        "key": key,
        "values": values,
        "base": base,
        "outputs": sweep_outputs(),
        "runs": [value_folder(key, v) for v in values],
    }
    claim.write_run_file({**new_identity(base_text).as_json(), **record})


def recorded_key(out_dir: Path, key: str) -> str:
    """The swept key as the sweep in ``out_dir`` recorded it, when it names the same setting
    as ``key`` (a sweep started before its key moved out of ``[train]``, moved_keys.py, keeps
    its values' folders); else ``key``."""
    if not (out_dir / RUN_FILE).exists():
        return key
    recorded = str(read_run_file(out_dir).get("key", key))
    return recorded if current_name(recorded) == current_name(key) else key


def _same_base(out_dir: Path, base: dict) -> bool:
    """Whether the base config recorded in ``out_dir`` is ``base`` once keys that moved out
    of ``[train]`` are read at their new places (a sweep started before they moved)."""
    recorded = read_sweep(out_dir)[2]
    return in_sections(recorded, note=None) == in_sections(base, note=None)


def _compared_algorithms(outcomes: dict[str, Outcome]) -> list[str]:
    """The algorithms of the sweep's table, in the order they ran (CentralSGD left out)."""
    return [n for n in next(iter(outcomes.values())).summary["algorithms"] if n != CENTRAL]


def _sweep_result(key: str, values: list[str], outcomes: dict[str, Outcome]) -> dict:
    """sweep.json: the targets, and each algorithm's rounds to target and divergence per value."""
    names = _compared_algorithms(outcomes)
    return {
        "key": key,
        "values": values,
        "targets": {v: o.summary["target"] for v, o in outcomes.items()},
        "rounds_to_target": {
            n: {v: o.summary["algorithms"][n]["rounds_to_target"] for v, o in outcomes.items()}
            for n in names
        },
        "diverged": {
            n: {v: o.summary["algorithms"][n]["diverged"] for v, o in outcomes.items()}
            for n in names
        },
        # [clock] (fedsub/clock): each value's virtual seconds to target, when on the clock
        **_sweep_times(names, outcomes),
    }


def _sweep_times(names: list[str], outcomes: dict[str, Outcome]) -> dict:
    """sweep.json's ``time_to_target`` per algorithm and value, when the runs had [clock]."""
    entries = [o.summary["algorithms"][n] for o in outcomes.values() for n in names]
    if not any("time_to_target" in e for e in entries):
        return {}
    return {
        "time_to_target": {
            n: {v: o.summary["algorithms"][n].get("time_to_target") for v, o in outcomes.items()}
            for n in names
        }
    }


def _privacy_records(outcomes: dict[str, Outcome]) -> dict[str, dict[str, dict]]:
    """Per algorithm and value, its privacy.json (level, guarantees, bytes, seconds; kept out
    of sweep.json, whose numbers a resumed sweep must reproduce)."""
    records: dict[str, dict[str, dict]] = {}
    for v, o in outcomes.items():
        for n in o.summary["algorithms"]:
            path = o.out_dir / n / "privacy.json" if o.out_dir is not None else None
            if path is not None and path.exists():
                records.setdefault(n, {})[v] = json.loads(path.read_text())
    return records


def _privacy_markdown(key: str, outcomes: dict[str, Outcome]) -> list[str]:
    """sweep.md's table of what each privacy level cost per round (when recorded)."""
    records = _privacy_records(outcomes)
    levels = {r["level"] for by_value in records.values() for r in by_value.values()}
    if levels <= {"none"}:
        return []  # a sweep of something else: nothing private to report
    lines = [
        "Privacy cost per round (privacy.json): bytes per client each way, the cohort's "
        "training, each client's privacy work (requests, encoding, masking) and the server's "
        "aggregation",
        "",
        f"| algorithm | {key} | level | bytes up | bytes down | training s | client privacy s "
        "| server s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for n, by_value in records.items():
        for v, r in by_value.items():
            if "bytes_up_per_client_round" not in r:  # withheld under [dp]
                lines.append(f"| {n} | {v} | {r['level']} | withheld ([dp]) | | | | |")
                continue
            lines.append(
                f"| {n} | {v} | {r['level']} | {r['bytes_up_per_client_round']:.0f} | "
                f"{r['bytes_down_per_client_round']:.0f} | "
                f"{r['training_seconds_per_round']:.2g} | "
                f"{r['privacy_client_seconds_per_client_round']:.2g} | "
                f"{r['server_seconds_per_round']:.2g} |"
            )
    return [*lines, ""]


def _sweep_markdown(
    key: str, values: list[str], outcomes: dict[str, Outcome], rounds: dict[str, int]
) -> str:
    """sweep.md: the Table-3 style table (when a target is set), then the metrics table."""
    targets = {v: o.summary["target"] for v, o in outcomes.items()}
    with_target = any(targets.values())
    lines = []
    if with_target:
        header = f"| algorithm | {' | '.join(f'{key}={v}' for v in values)} |"
        lines += [
            f"Rounds to target for each {key} ('R+' = not reached in R rounds)",
            "",
            header,
            "|---|" + "---:|" * len(values),
        ]
        for n in _compared_algorithms(outcomes):
            entries = [outcomes[v].summary["algorithms"][n] for v in values]
            cells = [outcome_cell(e, rounds[v]) for e, v in zip(entries, values, strict=True)]
            lines.append(f"| {n} | {' | '.join(cells)} |")
        described = [f"{key}={v}: {_describe(targets[v])}" for v in values]
        lines += ["", "Targets: " + "; ".join(described), ""]
    else:
        lines += [f"Sweep of {key}: no target set (no rounds to target)", ""]
    rows = [
        (n, v, o.summary["algorithms"][n], rounds[v])
        for v, o in outcomes.items()
        for n in o.summary["algorithms"]
    ]
    lines += metrics_table(rows, ["algorithm", key], with_rounds=with_target)
    privacy = _privacy_markdown(key, outcomes)
    if privacy:
        lines += ["", *privacy]
    records = [e["dp"] for o in outcomes.values() for e in o.summary["algorithms"].values()
               if "dp" in e]  # fmt: skip
    if records:  # what epsilon covers (the test split public only if every run declares it)
        public = all(r.get("public_test", False) for r in records)
        lines += ["", dp_scope_markdown(public).rstrip("\n")]
    return "\n".join(lines) + "\n"


def _sweep_curves(
    key: str, outcomes: dict[str, Outcome], out_dir: Path
) -> tuple[dict[str, dict[str, list[Evaluation]]], Target | None]:
    """The sweep's curves, one row of panels per algorithm and one line per value, and the
    target line when every value has the same target."""
    panels = {
        n: {
            f"{key}={v}": read_metrics(out_dir / value_folder(key, v) / n / "metrics.jsonl")
            for v, o in outcomes.items()
            if n in o.summary["algorithms"]
        }
        for n in dict.fromkeys(n for o in outcomes.values() for n in o.summary["algorithms"])
    }
    shared = {json.dumps(o.summary["target"], sort_keys=True) for o in outcomes.values()}
    target = Target(**json.loads(shared.pop())) if len(shared) == 1 else None
    return panels, target


def _describe(target: dict[str, float]) -> str:
    parts = [f"{k} {'<=' if k == 'train_loss' else '>='} {v:.4g}" for k, v in target.items()]
    return " and ".join(parts) if parts else "no target set"
