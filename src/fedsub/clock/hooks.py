"""The clock's one entry into a run: engine/in_process.py's ``run_rounds`` takes a
``wrap_runtime``, which runs/experiment.py sets to ``wrapper(config.clock)`` (the engine never
imports the clock; the round loop, engine/loop.py, names no feature). ``clocked`` wraps the
in-process runtime (a ``RoundRuntime``) on the virtual clock and adjusts the ServerRound
(over-selection's larger draw; FedBuff's combine), with the clock's state a checkpoint stage
(a ``RoundContribution`` of its own, engine/contribution.py). It refuses, with the reason,
what the clock does not combine with; the config-level refusals ([dp], privacy levels,
masking) are clock/settings.py's ``config_refusals``."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from fedsub.algorithms.aggregation import ServerUpdate
from fedsub.clock.fedbuff import BufferedUpdate, FedBuffClock, fedbuff_combine
from fedsub.clock.profiles import Profiles, Trace, clock_inputs
from fedsub.clock.settings import Buffered, ClockConfig
from fedsub.clock.synchronous import SynchronousClock
from fedsub.clock.timing import submodel_bytes, whole_model_bytes
from fedsub.engine.contribution import Combine, Combining, RoundContribution, taking
from fedsub.engine.round_runtime import RoundRuntime
from fedsub.engine.server_round import ServerRound
from fedsub.errors import ConfigError
from fedsub.stateful import Stateful

if TYPE_CHECKING:
    from fedsub.data.federated import FederatedDataset
    from fedsub.engine.schedule import Schedule
    from fedsub.submodel.index import SubmodelIndex

STAGE = "clock"  # the checkpoint stage of the clock's state


def wrapper(clock: ClockConfig) -> Callable[..., RoundRuntime] | None:
    """What engine/in_process.py's ``run_rounds`` takes as ``wrap_runtime`` for ``clock``
    (None: off)."""
    return functools.partial(clocked, clock=clock) if clock.on else None


def clocked(
    runtime: RoundRuntime,
    rounds: ServerRound,
    dataset: FederatedDataset,
    index: SubmodelIndex,
    clock: ClockConfig | None,
) -> RoundRuntime:
    """``runtime`` on the virtual clock ``clock`` (unchanged when it is None or off, or for
    CentralSGD, which has no clients)."""
    schedule, algorithm = rounds.schedule, rounds.algorithm
    if clock is None or not clock.on or algorithm.central:
        return runtime
    name = f"[clock] with algorithm {algorithm.name!r}"
    if algorithm.control_variates:
        raise ConfigError(f"{name}: control variates (SCAFFOLD) need every sampled member's work")
    if algorithm.aggregation.model_average:
        raise ConfigError(f"{name}: Scheme II's model average rescales by the round's cohort")
    n = dataset.num_clients
    profiles, trace = clock_inputs(clock, schedule.seed, n)
    whole = clock.transfer == "whole-model" or (
        clock.transfer == "auto" and algorithm.aggregation.coefficients is None
    )
    params = rounds.params
    exchanged = whole_model_bytes(params, n) if whole else submodel_bytes(index, params, n)
    samples = float(schedule.local_steps * schedule.batch_size)
    if clock.mode == "fedbuff":
        return _fedbuff(runtime, rounds, clock, profiles, trace, exchanged, samples, name)
    k = schedule.clients_per_round
    selected = min(n, math.ceil(k * (1 + clock.synchronous.over_selection)))
    over_selecting = dataclasses.replace(schedule, clients_per_round=selected)
    share = work_share(schedule, n)
    clocked_runtime = SynchronousClock(
        runtime, profiles, trace, exchanged, samples, clock.synchronous, k, share
    )
    _contribute(rounds, clocked_runtime.time, schedule=over_selecting)
    return clocked_runtime


@runtime_checkable
class ScalesWork(Protocol):
    """A feature's settings that shrink each member's work and bytes (width-slice masking's
    ``Masking``): its share of the full model's, (round, members) -> shares, or None."""

    def work_share(
        self, seed: int, num_clients: int
    ) -> Callable[[int, np.ndarray], np.ndarray] | None: ...


def work_share(schedule: Schedule, num_clients: int) -> Callable | None:
    """Each member's share of the full model's work in a round, by the first of the run's
    feature settings that scales it (None: every member does the full model's)."""
    for settings in schedule.settings:
        if isinstance(settings, ScalesWork):
            share = settings.work_share(schedule.seed, num_clients)
            if share is not None:
                return share
    return None


def _fedbuff(
    runtime: RoundRuntime,
    rounds: ServerRound,
    clock: ClockConfig,
    profiles: Profiles,
    trace: Trace,
    exchanged: np.ndarray,
    samples: float,
    name: str,
) -> RoundRuntime:
    buffered = FedBuffClock(runtime, rounds, profiles, trace, exchanged, samples, clock.buffered)
    buffered_rounds(rounds, clock.buffered, name, buffered.state)
    return buffered


def buffered_rounds(rounds: ServerRound, rules: Buffered, name: str, stage: Stateful) -> None:
    """Make ``rounds`` FedBuff's server (the virtual clock's, and Flower's asynchronous
    server, flower/fedbuff_server.py): refused, naming ``name``, for what FedBuff's step does
    not combine with; its combine ``fedbuff_combine`` (over the algorithm's aggregation, again
    when Flower's membership rebuilds the algorithm), with ``stage`` its checkpoint stage."""
    algorithm = rounds.algorithm
    if algorithm.control_variates:
        raise ConfigError(f"{name}: control variates (SCAFFOLD) need every sampled member's work")
    if algorithm.aggregation.model_average:
        raise ConfigError(f"{name}: Scheme II's model average rescales by the round's cohort")
    weighting = algorithm.aggregation.weighting
    if weighting not in ("samples", "uniform") or algorithm.aggregation.combine_step:
        raise ConfigError(
            f'{name}: clock.mode = "fedbuff" takes the samples or uniform weighting and the '
            f"weighted sum (its buffer's mean), got weighting {weighting!r}"
        )
    if rounds.features.safety.max_update_norm > 0:
        raise ConfigError(
            'clock.mode = "fedbuff" cannot screen updates (train.max_update_norm): set it to 0'
        )
    exponent = rules.staleness_exponent
    built: list = [None, None]  # the algorithm the aggregation below is of, and it

    def buffered_combine(update: BufferedUpdate) -> ServerUpdate:
        if built[0] is not rounds.algorithm:  # built again after Flower's repopulate
            built[:] = [rounds.algorithm, rounds.algorithm.aggregation.to(rounds.params.device)]
        return fedbuff_combine(update, built[1], exponent)

    combine = taking(BufferedUpdate, buffered_combine)
    # FedBuff's rule is the round's whole combine: an override, ahead of any later one
    override = Combining(override=lambda update, round_index: combine(update))
    _contribute(rounds, stage, override, combine=combine)


def _contribute(
    rounds: ServerRound,
    stage: Stateful,
    combining: Combining | None = None,
    schedule: Schedule | None = None,
    combine: Combine | None = None,
) -> None:
    """The clock's part of the round (engine/contribution.py), first in order: its state, the
    ``clock`` checkpoint stage, and (FedBuff) its combine, which wins over later overrides;
    its own schedule (over-selection) or combine (FedBuff) (``ServerRound.wrapped``)."""
    mine = RoundContribution(STAGE, combining=combining or Combining(), stages={STAGE: stage})
    rounds.wrapped(mine, schedule, combine)


__all__ = ["STAGE", "buffered_rounds", "clocked", "wrapper"]
