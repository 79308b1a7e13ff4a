"""What a feature contributes to a round: typed pieces, never an edit of the round loop.

The round loop (engine/loop.py) and the server round (engine/server_round.py) name no feature.
A cross-cutting feature (the torchrun split, width-slice masking, private rounds, host tables,
row-sharded tables, differential privacy, and what comes next) is one *adapter* in
``engine/features/`` that looks at the run (``RoundSetup``) and returns a ``RoundContribution``
of the pieces it needs, or None when the run does not use it. One assembler
(``engine/features/assembly.py``) asks the adapters in one explicit order (``FEATURES``) and
folds their contributions into what the loop runs:

- ``client_stage``: wraps the backend's cohort work, innermost first (``composed``);
- ``combining``: how the round's update becomes the server's: ``aggregation`` adjusts the
  algorithm's aggregation, ``combine`` builds the round's combine from it (the last one given
  wins: width slices, the private rounds' aggregation), ``received`` is applied to the
  combined update in order (host rows), ``override`` replaces all of that, given the round
  (the first one given wins: a central DP mechanism), ``combines_empty``: a round with no
  member left still combines (its noise is added all the same); each takes the round's
  ``Updates`` (a combine of one form is made one with ``taking``);
- ``hooks``: ``before_finish`` at the start of each server step (a privacy ledger's round),
  ``stop_before`` before each round (True stops the run there: a spent budget),
  ``after_round`` after each round (traffic logs), ``metrics`` added to each evaluation
  (epsilon so far);
- ``stages``: named checkpoint state (``Stateful``), saved and restored by name;
- ``draw`` (a ``CohortDraw``): its ``key``, the key the cohort is drawn with (default
  ``train.seed``), and its ``filter``, who may be drawn in a round and what a drawn cohort
  leaves behind (``CohortFilter``: ``eligible`` narrows the clients before the draw, ``record``
  is told the cohort after it; each filter in order): DP-FTRL's participation pattern,
  enforced on every runtime;
- ``processes`` (a ``Processes``): its ``agreement`` and ``saver``, how processes agree on a
  round's checks and write one checkpoint (row-sharded tables);
- ``evaluator``: how the central evaluator evaluates (on the host, by shares);
- ``checks``: checks of the built server optimizer (row-local steps);
- ``handle``: the feature's own object, for whoever must read it (``handle_of``).

Before them, an adapter may *place* round 0's model (``Feature.place``: the tables kept on the
host, or each process's rows): the first adapter in order that places it wins, and its handle
is seen by the adapters after it (``RoundSetup.earlier``).

A new feature writes its adapter (a ``Feature``: a name, ``contribute`` and maybe ``place``),
adds it to ``FEATURES`` at its place, and nothing else: docs/develop/extending.md, "A feature
of the round". What is not a feature: a new central DP mechanism is an entry of
dp/mechanisms.py's registry ([dp]'s adapter builds whichever ``dp.mechanism`` names); a new
place where the client work runs (Flower, a simulated clock) is a ``RoundRuntime``
(engine/round_runtime.py), which may also add hooks of its own through a feature.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np

from fedsub.algorithms.aggregation import Aggregation, ServerUpdate, as_model_delta
from fedsub.algorithms.registry import Algorithm
from fedsub.algorithms.sampling import Cohort, SamplingKind, draw_cohort
from fedsub.algorithms.server_optimizer import ServerOptimizer
from fedsub.client.work import CohortTensors, CohortWork
from fedsub.engine.checkpoint import Checkpoint
from fedsub.engine.cohort_job import Stage
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.guards import Rejection
from fedsub.engine.schedule import Schedule
from fedsub.models.base import Model
from fedsub.numerics.seeding import Seed
from fedsub.stateful import Stateful, kept_from_the_start
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import Updates

Combine = Callable[[Updates], ServerUpdate]
"""A round's cohort update (a ``CohortUpdate``, a ``MaskedCohortUpdate``, the clock's buffer)
in, the server's update out; a combine of one form is made one by ``taking``."""

Override = Callable[[Updates, int], ServerUpdate]
"""A combine given the round too (a central DP mechanism's noise is keyed by the round)."""

Evaluate = Callable[[Params], dict[str, float]]
"""The central evaluation of a model: its metrics."""

Stages = dict[str, Stateful]
"""Named checkpoint state: what a checkpoint saves and a resume restores, by name."""

T = TypeVar("T")


def narrowed(value: object, kind: type[T]) -> T:
    """``value`` (a round's update, a feature's handle) as the ``kind`` its reader reads;
    another kind is refused by name."""
    if not isinstance(value, kind):
        raise TypeError(f"expected a {kind.__name__}, got a {type(value).__name__}")
    return value


def taking(kind: type[T], combine: Callable[[T], ServerUpdate]) -> Combine:
    """``combine``, which reads updates of the form ``kind``, as a round's ``Combine``."""
    return lambda update: combine(narrowed(update, kind))


def watching(kind: type[T], watch: Callable[[T], None]) -> Callable[[object], None]:
    """``watch`` as a watcher of a feature's handle (``RunControl.watch``), given the handle
    when it is a ``kind``."""
    return lambda handle: watch(narrowed(handle, kind))


@dataclass(frozen=True)
class RoundSetup:
    """What an adapter sees of the run: the model, the algorithm, the schedule, the clients'
    sample counts, round 0's model (None while it is being placed) and the handles of the
    adapters before it (by name), e.g. [dp]'s random streams for the private rounds."""

    model: Model | None  # None: a runtime that runs its own client work (Flower)
    algorithm: Algorithm
    schedule: Schedule
    counts: np.ndarray
    params: Params | None = None
    earlier: Mapping[str, object] = field(default_factory=dict)


class Variates(Stateful, Protocol):
    """What the server round asks of an algorithm's control variates (SCAFFOLD's,
    algorithms/scaffold.py): each cohort's corrections, added to its work, and the finished
    round folded in after the server step; a checkpoint stage (``variates``)."""

    def corrections(self, cohort: Cohort) -> CohortTensors:
        """``c - c_i`` for every member, in the cohort layout."""
        ...

    def update(self, update: Updates, work: CohortWork, local_steps: int) -> None:
        """Fold the round's kept ``update`` and ``work`` into the variates."""
        ...


class Agreement(Protocol):
    """How the processes of a run agree on a round (row-sharded tables: one all-reduce)."""

    def agree(self, flags: list[bool]) -> list[bool]:
        """Each flag true when it holds in any process."""
        ...

    def all_rejected(self, rejected: list[Rejection]) -> list[Rejection]:
        """Every process's rejected members, in member order."""
        ...


class Saver(Protocol):
    """How a checkpoint is written (row-sharded tables: every process its shard)."""

    def writes(self, due: bool) -> bool:
        """Whether this process takes part in writing a checkpoint it finds ``due``."""
        ...

    def save(self, folder: Path | None, checkpoint: Checkpoint) -> Path: ...


class CohortFilter(Protocol):
    """Who may take part in a round (e.g. DP-FTRL's participation pattern, dp/participation.py):
    asked before each cohort draw and told the cohort drawn, on every runtime."""

    def eligible(self, round_index: int, among: np.ndarray | None) -> np.ndarray:
        """The clients of ``among`` (sorted positions; None: all) that may take part in round
        ``round_index``."""
        ...

    def record(self, round_index: int, clients: np.ndarray) -> None:
        """Round ``round_index``'s cohort was drawn (once per round)."""
        ...


@dataclass(frozen=True)
class OneProcess:
    """One process's agreement: each check holds as it holds here."""

    def agree(self, flags: list[bool]) -> list[bool]:
        return flags

    def all_rejected(self, rejected: list[Rejection]) -> list[Rejection]:
        return list(rejected)


@dataclass(frozen=True)
class Combining:
    """A feature's part in how the round's cohort update becomes the server's update."""

    aggregation: Callable[[Aggregation], Aggregation] | None = None
    combine: Callable[[Aggregation], Combine] | None = None
    received: Callable[[ServerUpdate], ServerUpdate] | None = None
    override: Override | None = None
    combines_empty: bool = False


@dataclass(frozen=True)
class RoundHooks:
    """A feature's hooks around the round."""

    before_finish: Callable[[int], None] | None = None
    stop_before: Callable[[int], bool] | None = None
    after_round: Callable[[int], None] | None = None
    metrics: Callable[[], dict[str, float]] | None = None


@dataclass(frozen=True)
class CohortDraw:
    """A feature's part in drawing a round's cohort: the ``key`` it is drawn with (default
    ``train.seed``; [dp]'s secret) and a ``filter`` of who may be drawn (DP-FTRL's pattern)."""

    key: Callable[[], Seed] | None = None
    filter: CohortFilter | None = None


@dataclass(frozen=True)
class Processes:
    """How a run's processes act as one (row-sharded tables): how they ``agree`` on a round's
    checks and how a checkpoint is written (``saver``: every process its shard)."""

    agreement: Agreement | None = None
    saver: Saver | None = None


@dataclass(frozen=True)
class RoundContribution:
    """One feature's pieces (module docstring's table); every piece is optional."""

    name: str
    client_stage: Stage | None = None
    combining: Combining = field(default_factory=Combining)
    hooks: RoundHooks = field(default_factory=RoundHooks)
    stages: Mapping[str, Stateful] = field(default_factory=dict)
    draw: CohortDraw = field(default_factory=CohortDraw)
    processes: Processes = field(default_factory=Processes)
    evaluator: Callable[[Evaluator], Evaluate] | None = None
    checks: Callable[[ServerOptimizer], None] | None = None
    handle: object = None


@dataclass
class Safety:
    """How the run's rounds are kept safe: updates over ``max_update_norm`` (0: only NaN and
    Inf) rejected and reported to ``on_reject``; the last good checkpoint, which ``Diverged``
    names (``ServerRound.checkpointed`` keeps it current)."""

    max_update_norm: float = 0.0
    on_reject: Callable[[Rejection], None] | None = None
    last_checkpoint: Path | None = None


@dataclass(frozen=True)
class RoundFeatures:
    """The contributions the server round and the loop run, folded in ``FEATURES`` order
    (engine/features/assembly.py's ``folded``), and the run's ``Safety``;
    ``RoundFeatures()``: a plain round."""

    contributions: tuple[RoundContribution, ...] = ()
    agreement: Agreement = field(default_factory=OneProcess)
    saver: Saver | None = None
    safety: Safety = field(default_factory=Safety)

    def of(self, name: str) -> RoundContribution | None:
        """The contribution of the feature ``name``, or None when the run does not use it."""
        return next((c for c in self.contributions if c.name == name), None)

    def override(self) -> Override | None:
        """The round's combine override: the first feature's in order that gives one."""
        given = [c.combining.override for c in self.contributions]
        return next((override for override in given if override is not None), None)

    def combined(
        self, combine: Combine, update: Updates, round_index: int, params: Params
    ) -> ServerUpdate:
        """Round ``round_index``'s aggregate: a feature's override (given the round), else
        ``combine``'s; a model-average update (Scheme II) as the change of the whole model
        ``params`` (``as_model_delta``), for every runtime."""
        override = self.override()
        combined = combine(update) if override is None else override(update, round_index)
        return as_model_delta(combined, params)

    def combines_empty(self) -> bool:
        return any(c.combining.combines_empty for c in self.contributions)

    def sampling_key(self, seed: int) -> Seed:
        """The key of round r's cohort: the last contribution's, or ``seed``."""
        keys = [c.draw.key for c in self.contributions if c.draw.key is not None]
        return keys[-1]() if keys else seed

    def eligible(self, round_index: int, among: np.ndarray | None) -> np.ndarray | None:
        """The clients of ``among`` (None: all) that every contributed ``draw.filter`` lets
        take part in round ``round_index``; ``among`` as it is without one."""
        for contribution in self.contributions:
            if contribution.draw.filter is not None:
                among = contribution.draw.filter.eligible(round_index, among)
        return among

    def draw(
        self,
        kind: SamplingKind,
        schedule: Schedule,
        counts: np.ndarray,
        round_index: int,
        among: np.ndarray | None,
    ) -> Cohort:
        """Round ``round_index``'s cohort (algorithms/sampling.py's ``draw_cohort``, the
        scheme's sampling ``kind``) as the features take part in it: ``among`` narrowed by
        every ``draw.filter`` (``eligible``), drawn with the key ``sampling_key`` gives, then
        told to each filter (``drawn``), unless nobody could take part (an empty round, the
        caller's)."""
        among = self.eligible(round_index, among)
        seed, k = self.sampling_key(schedule.seed), schedule.clients_per_round
        cohort = draw_cohort(kind, schedule.sampling, k, counts, seed, round_index, among)
        if len(counts if among is None else among):
            self.drawn(round_index, cohort.clients)
        return cohort

    def drawn(self, round_index: int, clients: np.ndarray) -> None:
        """Round ``round_index``'s cohort, told to each contributed ``draw.filter``."""
        for contribution in self.contributions:
            if contribution.draw.filter is not None:
                contribution.draw.filter.record(round_index, clients)

    def keep_from_the_start(self) -> bool:
        """Whether a contributed stage must be checkpointed before round 1 (a secret key:
        fedsub/stateful.py's ``kept_from_the_start``)."""
        return any(kept_from_the_start(s) for c in self.contributions for s in c.stages.values())

    def stages(self, built_in: Stages | None = None) -> Stages:
        """The ``built_in`` stages (the server round's), then every contributed stage by name,
        in order; a name given twice is refused."""
        stages: Stages = dict(built_in or {})
        for contribution in self.contributions:
            for name, stage in contribution.stages.items():
                if name in stages:
                    taken = "a built-in stage" if name in (built_in or {}) else "another stage"
                    raise ValueError(f"stage name {name!r} is taken by {taken}")
                stages[name] = stage
        return stages

    def before_finish(self, round_index: int) -> None:
        for hooks in self._hooks():
            if hooks.before_finish is not None:
                hooks.before_finish(round_index)

    def stop_before(self, round_index: int) -> bool:
        """Whether a contribution stops the run before round ``round_index`` (it says why)."""
        stops = [h.stop_before for h in self._hooks() if h.stop_before is not None]
        return any(stop(round_index) for stop in stops)

    def after_round(self, round_index: int) -> None:
        for hooks in self._hooks():
            if hooks.after_round is not None:
                hooks.after_round(round_index)

    def evaluate(self, evaluator: Evaluator) -> Evaluate:
        """How ``evaluator`` evaluates this run's model: the last contribution's way, or as
        it is."""
        given = [c.evaluator for c in self.contributions if c.evaluator is not None]
        return given[-1](evaluator) if given else evaluator.evaluate

    def check(self, server: ServerOptimizer) -> None:
        """Each contribution's checks of the built server round (a ``ConfigError`` if not)."""
        for contribution in self.contributions:
            if contribution.checks is not None:
                contribution.checks(server)

    def metrics(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for hooks in self._hooks():
            if hooks.metrics is not None:
                metrics.update(hooks.metrics())
        return metrics

    def _hooks(self) -> list[RoundHooks]:
        return [c.hooks for c in self.contributions]


@dataclass(frozen=True)
class Placed:
    """Round 0's model as a feature keeps it, and the feature's handle (e.g. the tables'
    partition)."""

    params: Params
    handle: object


@dataclass(frozen=True)
class Feature:
    """A feature of the round: ``contribute`` gives its pieces for a run (None: the run does
    not use it); ``place`` (optional) keeps round 0's model its way."""

    name: str
    contribute: Callable[[RoundSetup], RoundContribution | None]
    place: Callable[[RoundSetup], Placed | None] | None = None


def handle_of(features: RoundFeatures, name: str, kind: type[T]) -> T | None:
    """The handle of feature ``name`` when the run uses it and it is a ``kind``, else None."""
    contribution = features.of(name)
    if contribution is None or not isinstance(contribution.handle, kind):
        return None
    return contribution.handle
