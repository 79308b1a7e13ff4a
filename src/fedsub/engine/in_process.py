"""The in-process engine: the round loop (engine/loop.py) over every client in this process
(or a torchrun group), the run's features assembled (engine/features/assembly.py) around the
configured backend.

Everything that differs between algorithms comes from the ``Algorithm`` (fedsub.algorithms):
the scheme's sampler and weighting, the local rule, control variates, the server optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec

import numpy as np

from fedsub.algorithms.registry import Algorithm
from fedsub.data.federated import FederatedDataset
from fedsub.engine.cohort_job import CohortJob, RunCohort
from fedsub.engine.contribution import Evaluate
from fedsub.engine.evaluate import Evaluator
from fedsub.engine.features.assembly import Assembly, assemble
from fedsub.engine.initial import ModelStart
from fedsub.engine.loop import Evaluation, RunControl, drive
from fedsub.engine.round_runtime import RoundFailed, RoundRuntime
from fedsub.engine.schedule import Schedule
from fedsub.engine.server_round import RoundPlan, ServerRound
from fedsub.models.base import Model
from fedsub.numerics import segment_sum
from fedsub.numerics.float32 import ieee_float32
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import Updates

P = ParamSpec("P")

WrapRuntime = Callable[[RoundRuntime, ServerRound, FederatedDataset, SubmodelIndex], RoundRuntime]
"""A runtime around the in-process one, given (runtime, rounds, dataset, index) before round 1;
it may adjust ``rounds`` (its schedule, combine, features): [clock]'s virtual clock
(fedsub/clock/hooks.py ``wrapper``, issue 51)."""


def pooled(dataset: FederatedDataset) -> FederatedDataset:
    """All training data as one client (CentralSGD)."""
    offsets = np.array([0, len(dataset.train)], dtype=np.int64)
    return dataclasses.replace(dataset, name=f"{dataset.name} (pooled)", client_offsets=offsets)


def central_setup(
    dataset: FederatedDataset, schedule: Schedule
) -> tuple[FederatedDataset, SubmodelIndex, Schedule]:
    """CentralSGD as a round of one client holding every sample, batch K * B, I steps."""
    central = pooled(dataset)
    return (
        central,
        SubmodelIndex.build(central),
        dataclasses.replace(
            schedule,
            clients_per_round=1,
            local=dataclasses.replace(
                schedule.local, batch_size=schedule.clients_per_round * schedule.batch_size
            ),
        ),
    )


def run_rounds(
    model: Model,
    algorithm: Algorithm,
    dataset: FederatedDataset,
    index: SubmodelIndex,
    schedule: Schedule,
    evaluator: Evaluator | None = None,
    on_evaluation: Callable[[Evaluation], None] | None = None,
    on_round: Callable[[int], None] | None = None,
    control: RunControl | None = None,
    start: ModelStart | None = None,
    wrap_runtime: WrapRuntime | None = None,
) -> Params:
    """Run ``schedule.rounds`` rounds of ``algorithm`` in process; evaluate at round 0, every
    ``eval_every`` rounds and at the last round. Returns the final global model.

    Round 0's model is the seeded draw, or (``start``) a model file's values (a warm start;
    checked against the model by runs/initial_model.py). With ``control.resume`` the run
    continues after the checkpoint's round and ends with the same model and evaluations as an
    uninterrupted run. Under torchrun with [dp] every process adds the same noise
    (dp/mechanism.py draws it on the host from a generator keyed by the run's secret, process
    0's, and the round, after the gather), so the processes' models stay equal.
    ``wrap_runtime``: a runtime around the in-process one (the virtual clock), or None."""
    control = control or RunControl()
    if algorithm.central:
        dataset, index, schedule = central_setup(dataset, schedule)
    if algorithm.whole_model:  # every client trains (and sends) every row (exact SCAFFOLD)
        index = SubmodelIndex.whole_model(dataset)
    assembly = Assembly(control.max_update_norm, control.on_reject, control.watch)
    run = assemble(model, algorithm, dataset, index, schedule, assembly, start)
    features = run.rounds.features
    evaluate = None if evaluator is None else features.evaluate(evaluator)
    runtime: RoundRuntime = InProcess(
        model, dataset, index, schedule, run.run_cohort, evaluate, features.after_round
    )
    if wrap_runtime is not None:
        runtime = wrap_runtime(runtime, run.rounds, dataset, index)
    drive(run.rounds, runtime, schedule, control, on_evaluation, on_round)
    return run.rounds.params


def no_after_round(round_index: int) -> None:
    return None


@dataclass
class InProcess:
    """The in-process engine as a ``RoundRuntime`` (engine/round_runtime.py): every client is
    available, the cohort's work runs on the configured backend inside the features' stages,
    and the model is evaluated centrally by ``evaluate`` (the features' way: on the host, by
    shares); ``after_round``: the features' hooks after each round (traffic logs)."""

    model: Model
    dataset: FederatedDataset
    index: SubmodelIndex
    schedule: Schedule
    backend: RunCohort
    evaluate_model: Evaluate | None = None
    after_round: Callable[[int], None] = no_after_round

    def available(self, round_index: int, rounds: ServerRound) -> np.ndarray | None:
        return None

    def run_cohort(self, plan: RoundPlan, params: Params) -> Updates | RoundFailed:
        if len(plan.cohort) == 0:
            return RoundFailed("an empty Poisson draw")
        job = CohortJob(
            self.model, params, self.dataset, self.index, plan.cohort, plan.round, self.schedule,
            plan.work,
        )  # fmt: skip
        return self.backend(job)  # host staging, when the tables live there, is a stage of it

    def close_round(self, round_index: int, updated: bool, diverged: str | None) -> None:
        self.after_round(round_index)

    def evaluate(self, round_index: int, params: Params) -> dict[str, float] | None:
        if self.evaluate_model is None:
            return None
        return self.evaluate_model(params)

    def history(self) -> list[dict]:
        return []

    def restore_history(self, history: list[dict]) -> None:
        return None


def deterministic(run: Callable[P, Params]) -> Callable[P, Params]:
    """``run`` under ``torch.use_deterministic_algorithms`` when the ``schedule`` it is given
    says ``deterministic`` (execution.deterministic; fedsub/numerics/segment_sum.py), and
    always with TensorFloat-32 off (numerics/float32.py)."""
    signature = inspect.signature(run)

    @functools.wraps(run)
    def under_schedule(*args: P.args, **kwargs: P.kwargs) -> Params:
        schedule = signature.bind(*args, **kwargs).arguments["schedule"]
        with segment_sum.deterministic_run(schedule.execution.deterministic), ieee_float32():
            return run(*args, **kwargs)

    return under_schedule


train = deterministic(run_rounds)
"""``run_rounds`` (same arguments), deterministic when its schedule says so."""
