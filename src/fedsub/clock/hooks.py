"""The clock's one entry from the round loop (engine/loop.py's ``run_rounds``): the in-process
runtime wrapped on the virtual clock, and the ServerRound adjusted (over-selection's larger
draw; FedBuff's combine), with the clock's state a checkpoint stage.

``clocked`` refuses, with the reason, what the clock does not combine with; the config-level
refusals ([dp], privacy levels, masking) are ``config_refusals`` (config.py calls it)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import numpy as np

from fedsub.clock.fedbuff import FedBuffClock, fedbuff_combine
from fedsub.clock.profiles import clock_inputs
from fedsub.clock.settings import ClockConfig
from fedsub.clock.synchronous import SynchronousClock
from fedsub.clock.timing import submodel_bytes, whole_model_bytes
from fedsub.engine.round_runtime import RoundRuntime
from fedsub.engine.server_round import ServerRound
from fedsub.errors import ConfigError

if TYPE_CHECKING:
    from fedsub.data.federated import FederatedDataset
    from fedsub.submodel.index import SubmodelIndex

STAGE = "clock"  # the checkpoint stage of the clock's state

DP_REASON = (
    "[dp]'s accounting assumes the configured cohort sampling: FedBuff's buffers mix model "
    "versions and a deadline, over-selection or dropouts choose members by device speed and "
    "availability, which the accountant does not model"
)
PRIVACY_REASON = (
    "privacy levels' secure aggregation sums one round's cohort, and FedBuff's buffer or a "
    "round's dropouts change who is summed after the cohort is set up"
)


def drops_clients(clock: ClockConfig) -> bool:
    """Whether synchronous rounds may drop members (deadline, over-selection, availability)."""
    sync = clock.synchronous
    return (
        sync.deadline > 0
        or sync.over_selection > 0
        or clock.online.availability != "always"
        or clock.trace is not None
    )


def config_refusals(
    clock: ClockConfig, dp_on: bool, private_level: bool, masking: bool
) -> list[tuple[bool, str]]:
    """(refused?, why) for each combination of ``[clock]`` the config cannot run."""
    fedbuff = clock.mode == "fedbuff"
    dropping = clock.mode == "synchronous" and drops_clients(clock)
    return [
        (fedbuff and dp_on, f'clock.mode = "fedbuff" cannot be combined with [dp]: {DP_REASON}'),
        (
            dropping and dp_on,
            "clock.mode = \"synchronous\" with a deadline, over-selection or an availability "
            f"trace cannot be combined with [dp]: {DP_REASON}",
        ),
        (
            (fedbuff or dropping) and private_level,
            f"[clock] (FedBuff, or rounds that drop members) cannot be combined with "
            f"privacy.level other than 'none': {PRIVACY_REASON}",
        ),
        (
            fedbuff and masking,
            'clock.mode = "fedbuff" cannot be combined with masking: width slices are '
            "aggregated per synchronous round",
        ),
    ]


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
    rounds.schedule = dataclasses.replace(schedule, clients_per_round=selected)
    clocked_runtime = SynchronousClock(
        runtime, profiles, trace, exchanged, samples, clock.synchronous, k
    )
    rounds.more_stages[STAGE] = clocked_runtime.time
    return clocked_runtime


def _fedbuff(runtime, rounds, clock, profiles, trace, exchanged, samples, name) -> RoundRuntime:  # type: ignore[no-untyped-def]
    weighting = rounds.algorithm.aggregation.weighting
    if weighting not in ("samples", "uniform") or rounds.algorithm.aggregation.combine_step:
        raise ConfigError(
            f'{name}: clock.mode = "fedbuff" takes the samples or uniform weighting and the '
            f"weighted sum (its buffer's mean), got weighting {weighting!r}"
        )
    if rounds.max_update_norm > 0:
        raise ConfigError(
            'clock.mode = "fedbuff" cannot screen updates (train.max_update_norm): set it to 0'
        )
    aggregation = rounds.algorithm.aggregation.to(rounds.params.device)
    exponent = clock.buffered.staleness_exponent
    rounds.combine = functools.partial(fedbuff_combine, aggregation=aggregation, exponent=exponent)
    buffered = FedBuffClock(runtime, rounds, profiles, trace, exchanged, samples, clock.buffered)
    rounds.more_stages[STAGE] = buffered.state
    return buffered


__all__ = ["STAGE", "clocked", "config_refusals", "np"]
