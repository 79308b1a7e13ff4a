"""``[clock]``: the virtual clock's settings (fedsub/clock; docs/how-to/virtual-clock.md).

Kept in this package so that config.py only lists the section: its keys, types, ranges and
docs live here, grouped by concern (each group's keys are written flat in ``[clock]``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MODES = ("off", "synchronous", "fedbuff")
TRANSFERS = ("auto", "submodel", "whole-model")
AVAILABILITY = ("always", "markov")


@dataclass(frozen=True)
class DeviceDistribution:
    """How device profiles are drawn when no trace file gives them: each quantity lognormal,
    ``median * exp(sigma * Z)`` with Z standard normal, independently per client and quantity,
    keyed by train.seed."""

    compute_median: float = field(default=20.0, metadata={"min_exclusive": 0.0})
    """Median training speed, samples per second (a phone on a small model)."""
    compute_sigma: float = field(default=1.0, metadata={"min": 0.0})
    """Lognormal sigma of the training speed (0: every client as fast)."""
    download_median: float = field(default=1.25e6, metadata={"min_exclusive": 0.0})
    """Median download bandwidth, bytes per second (10 Mbit/s)."""
    download_sigma: float = field(default=1.0, metadata={"min": 0.0})
    """Lognormal sigma of the download bandwidth."""
    upload_median: float = field(default=2.5e5, metadata={"min_exclusive": 0.0})
    """Median upload bandwidth, bytes per second (2 Mbit/s)."""
    upload_sigma: float = field(default=1.0, metadata={"min": 0.0})
    """Lognormal sigma of the upload bandwidth."""
    memory_median: float = field(default=2.0 * 2**30, metadata={"min_exclusive": 0.0})
    """Median memory for training, bytes (2 GiB)."""
    memory_sigma: float = field(default=0.5, metadata={"min": 0.0})
    """Lognormal sigma of the memory."""


@dataclass(frozen=True)
class Availability:
    """When clients are online, when no trace file says: ``always``, or ``markov`` (each client
    alternates online and offline periods, exponentially distributed with these means, and
    starts online with probability online_mean / (online_mean + offline_mean))."""

    availability: str = field(default="always", metadata={"choices": lambda: list(AVAILABILITY)})
    """`always` or `markov` (alternating exponential online / offline periods)."""
    online_mean: float = field(default=3600.0, metadata={"min_exclusive": 0.0})
    """`markov`: mean online period, seconds."""
    offline_mean: float = field(default=3600.0, metadata={"min_exclusive": 0.0})
    """`markov`: mean offline period, seconds."""


@dataclass(frozen=True)
class SynchronousRounds:
    """``mode = "synchronous"``: a round waits for its cohort, at most ``deadline`` seconds."""

    deadline: float = field(default=0.0, metadata={"min": 0.0})
    """Seconds after a round starts past which a client's update is dropped; 0 = no deadline."""
    over_selection: float = field(default=0.0, metadata={"min": 0.0, "max": 10.0})
    """Select ceil(K (1 + x)) clients and keep the first K to finish (0 = select K)."""


@dataclass(frozen=True)
class Buffered:
    """``mode = "fedbuff"``: FedBuff (Nguyen et al., AISTATS 2022)."""

    concurrency: int = field(default=100, metadata={"min": 1})
    """C, the clients training at any time."""
    buffer_size: int = field(default=10, metadata={"min": 1})
    """B (the paper's K), the updates the server waits for before each step."""
    staleness_exponent: float = field(default=0.5, metadata={"min": 0.0})
    """a in s(tau) = (1 + tau)^-a; the paper's 1 / sqrt(1 + tau) is a = 0.5."""


@dataclass(frozen=True)
class ClockConfig:
    """[clock]: simulated time (fedsub/clock): each client's device profile and availability,
    the time its work takes, synchronous rounds under deadlines, or FedBuff."""

    mode: str = field(default="off", metadata={"choices": lambda: list(MODES)})
    """`off` (rounds cost no time), `synchronous` (rounds on the clock: deadline,
    over-selection, dropouts) or `fedbuff` (asynchronous buffered aggregation)."""
    trace: str | None = None
    """Optional: a device / availability trace file (.json, .csv; FedScale's traces as JSON):
    docs/how-to/virtual-clock.md. Unset: profiles drawn from the distributions below."""
    transfer: str = field(default="auto", metadata={"choices": lambda: list(TRANSFERS)})
    """What a client downloads and uploads: `submodel` (its rows), `whole-model`, or `auto`
    (the submodel for heat-corrected algorithms such as FedSubAvg, the whole model otherwise)."""
    devices: DeviceDistribution = field(default_factory=DeviceDistribution)
    """compute_*, download_*, upload_*, memory_* (keys of [clock])."""
    online: Availability = field(default_factory=Availability)
    """availability, online_mean, offline_mean (keys of [clock])."""
    synchronous: SynchronousRounds = field(default_factory=SynchronousRounds)
    """deadline, over_selection (keys of [clock])."""
    buffered: Buffered = field(default_factory=Buffered)
    """concurrency, buffer_size, staleness_exponent (keys of [clock])."""

    @property
    def on(self) -> bool:
        return self.mode != "off"


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
            'clock.mode = "synchronous" with a deadline, over-selection or an availability '
            f"trace cannot be combined with [dp]: {DP_REASON}",
        ),
        (
            clock.mode == "synchronous" and not dropping and dp_on,
            'clock.mode = "synchronous" cannot be combined with [dp]: a round\'s virtual_time is '
            "its slowest member's, and the members' times follow from device profiles drawn from "
            "the public train.seed, so the published times would narrow down the secret cohort "
            "(no epsilon covers them)",
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


def inert_keys(clock: ClockConfig) -> list[tuple[str, str]]:
    """``[clock]`` keys set to a value other than their default where ``clock.mode`` leaves
    them unused, each with why (config.py refuses them, as it refuses inert [masking] keys)."""
    default = ClockConfig()
    groups: dict[str, object] = {
        "devices": clock.devices,
        "online": clock.online,
        "synchronous": clock.synchronous,
        "buffered": clock.buffered,
    }
    unused = {
        "off": ("devices", "online", "synchronous", "buffered"),
        "synchronous": ("buffered",),
        "fedbuff": ("synchronous",),
    }[clock.mode]
    found = []
    if clock.mode == "off":
        for key in ("trace", "transfer"):
            if getattr(clock, key) != getattr(default, key):
                found.append((f"clock.{key}", 'clock.mode = "off"'))
    for group in unused:
        values, defaults = groups[group], getattr(default, group)
        for f in dataclasses.fields(defaults):
            if getattr(values, f.name) != getattr(defaults, f.name):
                found.append((f"clock.{f.name}", f"clock.mode = {clock.mode!r}"))
    return found


REAL_TIME = (
    "on Flower FedBuff runs in real time: time and availability are the nodes' own, so the "
    "virtual clock's device profiles, availability and trace do not apply"
)


def real_time_refusals(clock: ClockConfig) -> list[str]:
    """The ``[clock]`` keys a FedBuff run on Flower (real time, real nodes) cannot honour:
    those of the virtual clock's time model set to a value other than their default (only
    ``mode``, ``concurrency``, ``buffer_size`` and ``staleness_exponent`` apply there)."""
    default = ClockConfig()
    found = [
        f"clock.{key}"
        for key in ("trace", "transfer")
        if getattr(clock, key) != getattr(default, key)
    ]
    for group in ("devices", "online"):
        values, defaults = getattr(clock, group), getattr(default, group)
        for f in dataclasses.fields(defaults):
            if getattr(values, f.name) != getattr(defaults, f.name):
                found.append(f"clock.{f.name}")
    return found
