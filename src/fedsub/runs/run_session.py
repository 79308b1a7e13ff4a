"""A run's session in its folder, for every runtime: the folder held for the run's lifetime,
which run it holds (a new run's identity written, a resumed run's checked), where each of its
runs' checkpoints go and which one it continues, what a fresh start forgets of an earlier
attempt, the evaluations logged (metrics.jsonl) and fed to the trackers (runs/tracking.py), the
folder marked as holding training after a round, and the trained model written.

``RunSession`` is the folder (``RunSession.opened``: claimed and held); ``Attempt`` is one run's
rounds in it (a comparison's algorithm in its own folder, a Flower run in its out-dir), driven
by the one round loop (engine/loop.py's ``drive``): a runtime gives its ``RoundRuntime`` and
how it opens its rounds, and the session does the rest (``Attempt.drive``).
``fedsub run``/``compare`` (runs/experiment.py) and the Flower ServerApp (flower/apps.py) both
keep their runs this way; which run a folder holds is runs/run_identity.py's. What differs on
purpose stays with the runtime: ``compare --resume`` starts an algorithm with no intact
checkpoint from round 1 (its other algorithms may have finished: ``RunSession.resume_point``),
a Flower run with ``resume = true`` and no checkpoint is refused; a comparison's folder counts
as trained once a round completed, a Flower out-dir once the loop ended (its result, even a
failure's, kept).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fedsub.config import Config
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.loop import Evaluation, Interrupted, Progress, RunControl, drive, evaluations_of
from fedsub.engine.round_runtime import RoundRuntime
from fedsub.engine.schedule import Schedule
from fedsub.engine.server_round import ServerRound
from fedsub.errors import FedsubError
from fedsub.files.atomic_files import write_atomic
from fedsub.files.run_folder import (
    CHECKPOINTS,
    CLI_FLAGS,
    DONE,
    Claim,
    Flags,
    RunIdentity,
    check_done,
    done_record,
    new_identity,
)
from fedsub.files.tensor_files import write_tensors_atomic
from fedsub.runs.report import MetricsLog
from fedsub.runs.run_identity import (
    StartedWith,
    claim_folder,
    newest_checkpoint,
    resumed_identity,
    start_run,
)
from fedsub.runs.tracking import RoundFeed, RunCallback, TrackedRun, flat_params, status_of
from fedsub.submodel.params import Params

MODEL_FILE = "model.safetensors"
METRICS_FILE = "metrics.jsonl"
LOG = logging.getLogger("fedsub")


@contextmanager
def holding(claim: Claim | None) -> Iterator[None]:
    """Hold ``claim``'s folder (None: a process that writes nothing) while the run runs, then
    release it; a run that fails (an error; a stop after a checkpoint is not one: it is a run
    to resume) before its first round completed is undone (files/run_folder.py's rules)."""
    failed = True
    try:
        yield
        failed = False
    except Interrupted:
        failed = False
        raise
    finally:
        if claim is not None:
            claim.end(failed)


def checkpointed(
    control: RunControl,
    folder: Path | None,
    every: int,
    identity: RunIdentity,
    resume: checkpoint_lib.Checkpoint | None = None,
) -> RunControl:
    """``control`` (the runtime's own guards) with the run's checkpoints: in ``folder``'s
    checkpoints/ (None: none written) every ``every`` rounds, stamped with ``identity``,
    continuing ``resume``."""
    return dataclasses.replace(
        control,
        checkpoints=None if folder is None else folder / CHECKPOINTS,
        checkpoint_every=every,
        resume=resume,
        run=identity.as_json(),
    )


def start_fresh(folder: Path, *files: str, checkpoints: bool = True) -> None:
    """A run with no checkpoint to continue starts over in ``folder``: forget what an earlier
    attempt left there, its checkpoints (unless ``checkpoints`` is False: a runtime whose
    folder holds none then) and its progress and completion ``files``."""
    if checkpoints:
        shutil.rmtree(folder / CHECKPOINTS, ignore_errors=True)
    for name in files:
        (folder / name).unlink(missing_ok=True)


def write_model(folder: Path, params: Params) -> None:
    """The trained model, ``folder``'s model.safetensors (written whole or not at all)."""
    write_tensors_atomic(folder / MODEL_FILE, params.state_dict())


def check_free_space(out_dir: Path, needed: int = 64 * 2**20) -> None:
    """Fail before training when the output folder's disk is (nearly) full."""
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        raise FedsubError(
            f"output folder {out_dir} has {free / 2**20:.1f} MiB free; "
            f"need at least {needed / 2**20:.0f} MiB for metrics and checkpoints"
        )


@dataclass(frozen=True)
class ResumePoint:
    """What a resume picks up for one run of a folder: finished (read back), a checkpoint to
    continue from, or nothing (start from round 1)."""

    done: bool = False
    checkpoint: checkpoint_lib.Checkpoint | None = None


class Evaluations:
    """The evaluations of a run that writes no metrics.jsonl (a process that writes nothing,
    a runtime keeping them elsewhere): ``MetricsLog``'s interface without a file."""

    def __init__(self, earlier: Sequence[Evaluation]) -> None:
        self.history = list(earlier)

    def __call__(self, evaluation: Evaluation) -> None:
        self.history.append(evaluation)

    def close(self) -> None:
        """Nothing to close."""


@dataclass
class RunSession:
    """A run folder held for a run (``RunSession.opened``): ``folder`` (None: a run without
    one), ``claim`` (None: a process that reads the folder but writes nothing, torchrun's
    processes but 0), whether it ``resume`` s the run there, how the runtime names its
    options (``flags``) and, once ``begin`` (or ``resumed`` / ``started``) said it, the run's
    ``identity``, stamped on its checkpoints and completion markers."""

    folder: Path | None = None
    claim: Claim | None = None
    resume: bool = False
    flags: Flags = CLI_FLAGS
    identity: RunIdentity | None = None

    @classmethod
    @contextmanager
    def opened(
        cls,
        folder: Path | None,
        resume: bool = False,
        overwrite: bool = False,
        flags: Flags = CLI_FLAGS,
        writes: bool = True,
    ) -> Iterator[RunSession]:
        """The session of a run in ``folder`` (None: none), the folder claimed by the process
        that ``writes`` (files/run_folder.py's rules) and held until the run ends (a new run
        that fails before its first round completes is undone: ``holding``)."""
        claim = None
        if folder is not None and writes:
            claim = claim_folder(folder, resume, overwrite, flags)
        with holding(claim):
            yield cls(folder, claim, resume, flags)

    @property
    def writes(self) -> bool:
        return self.claim is not None

    def begin(
        self, config_text: str, started: StartedWith, record: Mapping[str, object]
    ) -> RunIdentity:
        """The run's identity: a resumed run's (``resumed``), or a new run's (``started``; a
        run without a folder has nothing to resume)."""
        if self.resume and self.folder is not None:
            return self.resumed(config_text, started)
        return self.started(config_text, started, record)

    def resumed(self, config_text: str, started: StartedWith) -> RunIdentity:
        """The identity of the run the folder holds, checked against ``config_text`` (the
        config being resumed, as ``config.to_toml`` writes it)."""
        assert self.folder is not None, "a resume continues a run in its folder"
        self.identity = resumed_identity(self.folder, config_text, started)
        return self.identity

    def started(
        self, config_text: str, started: StartedWith, record: Mapping[str, object]
    ) -> RunIdentity:
        """A new run's identity, written to the folder's run.json with ``record`` (its
        manifest) when this process writes; a process that writes nothing only stamps with it."""
        if self.claim is None:
            self.identity = new_identity(started.describe(config_text))
        else:
            self.identity = start_run(self.claim, config_text, dict(record), started)
        return self.identity

    def stamped(self, run_id: str) -> RunIdentity:
        """The identity under a runtime's own run id (Flower: one for every ``flwr run`` of a
        config), its config hash kept."""
        assert self.identity is not None, "begin the session first"
        self.identity = RunIdentity(run_id, self.identity.config_hash)
        return self.identity

    def training_started(self) -> None:
        """A round completed: the folder holds training (a replaced run is gone for good)."""
        if self.claim is not None:
            self.claim.training_started()

    @property
    def trained(self) -> bool:
        return self.claim is not None and self.claim.trained

    def place(self, part: str = "") -> Path | None:
        """Where a run's own files go in the folder: its subfolder ``part`` ("" the folder
        itself), when this process writes (None: it writes nothing)."""
        if self.claim is None:
            return None
        return self.claim.folder / part if part else self.claim.folder

    def newest(self, part: str = "") -> checkpoint_lib.Checkpoint | None:
        """The newest intact checkpoint of run ``part`` in the folder (None: none), refused
        when it is another run's."""
        assert self.folder is not None and self.identity is not None
        where = self.folder / part if part else self.folder
        return newest_checkpoint(where / CHECKPOINTS, self.identity, self.flags)

    def resume_point(self, name: str, part: str | None = None) -> ResumePoint:
        """What a resume picks up for run ``name`` in the folder's ``part`` (default: its
        name): finished (its completion marker checked to be this run's), its newest intact
        checkpoint, or nothing; said in the log."""
        assert self.folder is not None and self.identity is not None
        part = name if part is None else part
        where = self.folder / part if part else self.folder
        if (where / DONE).exists():
            check_done(where, self.identity)
            LOG.info("resume: %s finished earlier; its results are read back from %s", name, where)
            return ResumePoint(done=True)
        saved = self.newest(part)
        if saved is None:
            LOG.info("resume: %s has no intact checkpoint; it starts from round 1", name)
            return ResumePoint()
        LOG.info("resume: %s continues after round %d from %s", name, saved.round, saved.path)
        return ResumePoint(checkpoint=saved)

    def attempt(
        self,
        part: str,
        saved: checkpoint_lib.Checkpoint | None,
        every: int,
        keeps: Keeps | None = None,
        tracked: Tracked | None = None,
    ) -> Attempt:
        """Run ``part``'s rounds (its folder, "" the folder itself) from ``saved`` (None: from
        round 1: what an earlier attempt left is forgotten first, as ``keeps`` says), with
        checkpoints every ``every`` rounds and, with ``tracked``, the trackers fed (begun)."""
        assert self.identity is not None, "begin the session first"
        keeps = keeps or Keeps()
        folder = self.place(part)
        if saved is None and folder is not None:
            start_fresh(folder, *keeps.fresh, checkpoints=keeps.fresh_checkpoints)
        earlier = [] if saved is None else evaluations_of(saved.history)
        log: MetricsLog | Evaluations = (
            MetricsLog(folder / METRICS_FILE, earlier)
            if folder is not None and keeps.metrics
            else Evaluations(earlier)
        )
        feed = None
        if tracked is not None and tracked.callbacks:
            run = dataclasses.replace(
                tracked.run,
                folder=folder,
                run_folder=self.place(),
                resumed_after=saved.round if saved is not None else 0,
            )
            feed = RoundFeed(tracked.callbacks, run)
            feed.begin(earlier)
        return Attempt(self, folder, saved, every, log, feed)


@dataclass(frozen=True)
class Keeps:
    """What a run keeps in its folder: ``metrics`` (metrics.jsonl); what a fresh start
    forgets of an earlier attempt: the ``fresh`` files and (``fresh_checkpoints``) its
    checkpoints."""

    metrics: bool = True
    fresh: tuple[str, ...] = ()
    fresh_checkpoints: bool = True


@dataclass(frozen=True)
class Tracked:
    """The trackers of a run (runs/tracking.py): ``callbacks`` and how they name it (``run``;
    its folders and resume round are the session's)."""

    callbacks: tuple[RunCallback, ...]
    run: TrackedRun

    @staticmethod
    def of(
        callbacks: Sequence[RunCallback], config: Config, algorithm: str, name: str, runtime: str
    ) -> Tracked:
        """``callbacks`` tracking ``algorithm``'s run of ``config``, named ``[tracking]
        run_name`` + ``name``, with the config as parameters (flattened only when tracked)."""
        params = flat_params(config) if callbacks else {}
        run_name = f"{config.tracking.run_name}{name}"
        return Tracked(tuple(callbacks), TrackedRun(algorithm, run_name, params, runtime=runtime))


@dataclass
class Attempt:
    """One run's rounds in its session: its ``folder`` (None: writes nothing), the checkpoint
    it continues (``saved``), checkpoints every ``every`` rounds, its evaluations (``log``:
    metrics.jsonl or in memory) and the trackers' ``feed``; after ``drive`` the run's
    ``rounds``."""

    session: RunSession
    folder: Path | None
    saved: checkpoint_lib.Checkpoint | None
    every: int
    log: MetricsLog | Evaluations
    feed: RoundFeed | None = None
    rounds: ServerRound | None = None

    @property
    def history(self) -> list[Evaluation]:
        return self.log.history

    def control(self, guards: RunControl) -> RunControl:
        """The runtime's ``guards`` with the run's checkpoints (``checkpointed``)."""
        assert self.session.identity is not None
        return checkpointed(guards, self.folder, self.every, self.session.identity, self.saved)

    def on_evaluation(self, evaluation: Evaluation) -> None:
        """The loop's ``on_evaluation``: logged, and fed to the trackers."""
        self.log(evaluation)
        if self.feed is not None:
            self.feed.evaluation(evaluation)

    def on_round(self, round_index: int, extra: Mapping[str, float] | None = None) -> None:
        """The loop's ``on_round``: the folder holds training, and the round's metrics (with
        ``extra``) go to the trackers."""
        self.session.training_started()
        if self.feed is not None:
            self.feed.round_done(round_index, extra)

    def reporting(self, lines: Callable[[dict], None] | None) -> Callable[[dict], None] | None:
        """Where a runtime's round records go (Flower's progress lines): ``lines`` (None:
        nowhere) and the trackers."""
        feed = self.feed
        if feed is None:
            return lines

        def report(record: dict) -> None:
            if lines is not None:
                lines(record)
            feed.record(record)

        return report

    def drive(
        self,
        open_rounds: Callable[[RunControl], ServerRound],
        runtime: RoundRuntime,
        schedule: Schedule,
        guards: RunControl,
    ) -> Progress:
        """The run's rounds by the one loop: ``open_rounds`` (the runtime's server round,
        restored from the checkpoint the control continues) over ``runtime``, checkpointed,
        logged and tracked as the session says."""
        control = self.control(guards)
        self.rounds = open_rounds(control)
        return drive(self.rounds, runtime, schedule, control, self.on_evaluation, self.on_round)

    def end(self, error: BaseException | None) -> None:
        """The run ended (``error``: how, None when it finished): the log closed, the
        trackers told."""
        self.log.close()
        if self.feed is not None:
            self.feed.end(status_of(error))
            self.feed = None

    def write_model(self, params: Params) -> None:
        """The trained model, the run folder's model.safetensors (when it writes)."""
        if self.folder is not None:
            write_model(self.folder, params)

    def mark_done(self) -> None:
        """The run finished: its completion marker (digests of what it wrote, its identity)."""
        if self.folder is not None and self.session.identity is not None:
            write_atomic(self.folder / DONE, done_record(self.folder, self.session.identity))
