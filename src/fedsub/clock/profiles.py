"""Every client's device profile and availability trace: drawn from stated distributions
(keyed by train.seed, so every algorithm of a comparison sees the same devices), or read from a
trace file.

A profile is four numbers per client: training speed (samples per second), download and upload
bandwidth (bytes per second) and memory (bytes). Availability is a list of toggle times per
client (online <-> offline), repeating with a period: FedScale's traces wrap around their
``finish_time``; a drawn ``markov`` trace repeats after ``CYCLES`` online / offline cycles.

Trace files (docs/how-to/virtual-clock.md):

- fedsub JSON: ``{"clients": [{"compute": 50.0, "download": 1.25e6, "upload": 2.5e5,
  "memory": 2e9, "online": [[0, 3600], [7200, 9000]], "period": 10800}, ...]}``; every key
  but ``compute`` optional (bandwidths / memory then drawn; ``online`` absent: always online);
- FedScale JSON (their ``client_device_capacity`` and ``client_behave_trace`` pickles written
  as JSON, fedsub reads no pickles): ``{"device_capacity": {"<id>": {"computation": ms per
  sample, "communication": kbit/s}}, "behave_trace": {"<id>": {"active": [...], "inactive":
  [...], "finish_time": s}}}``, either part optional. FedScale's latency model is
  ``3 * batch * steps * computation / 1000 + kbits / communication`` seconds, so compute speed
  is ``1000 / (3 * computation)`` samples/s and both bandwidths ``communication * 1000 / 8``
  bytes/s;
- CSV: a header with ``compute`` and optionally ``download, upload, memory`` (one row per
  client; availability: always).

Client k of the data uses the file's entry k mod M (M entries, in file order; FedScale's ids in
increasing numeric order), so a trace of any size covers any population.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedsub.clock.settings import ClockConfig, DeviceDistribution
from fedsub.errors import ConfigError
from fedsub.numerics import seeding

CLOCK = 51  # seeding purpose of the clock's draws
CYCLES = 32  # a drawn markov trace repeats after this many online / offline cycles
INF = math.inf


@dataclass(frozen=True)
class Profiles:
    """Per client (arrays of length N): speed (samples/s), bandwidths (bytes/s), memory."""

    compute: np.ndarray
    download: np.ndarray
    upload: np.ndarray
    memory: np.ndarray

    def __len__(self) -> int:
        return len(self.compute)


@dataclass(frozen=True)
class Trace:
    """Availability: per client toggle times (rows of ``toggles``, sorted, padded with inf)
    within a period (``period``, inf: no repeat); ``starts_online``: the state at time 0 before
    any toggle. A client is online at t when ``starts_online`` xor (the number of toggles
    <= t mod period is odd)."""

    toggles: np.ndarray  # [N, M] float64
    period: np.ndarray  # [N] float64
    starts_online: np.ndarray  # [N] bool

    @staticmethod
    def always(num_clients: int) -> Trace:
        return Trace(
            np.full((num_clients, 1), INF), np.full(num_clients, INF), np.ones(num_clients, bool)
        )

    def _local(self, t: float) -> np.ndarray:
        return np.where(np.isfinite(self.period), np.fmod(t, self.period), t)

    def online(self, t: float) -> np.ndarray:
        """Who is online at time t (bool [N])."""
        local = self._local(t)
        flips = (self.toggles <= local[:, None]).sum(axis=1)
        return self.starts_online ^ (flips % 2 == 1)

    def online_until(self, client: int, t: float) -> float:
        """When ``client``, online at t, goes offline (inf: never)."""
        return self._next_change(client, t, want_online=False)

    def next_online(self, client: int, t: float) -> float:
        """The earliest time >= t at which ``client`` is online (inf: never)."""
        return self._next_change(client, t, want_online=True)

    def _next_change(self, client: int, t: float, want_online: bool) -> float:
        row, period = self.toggles[client], float(self.period[client])
        toggles = row[np.isfinite(row)]
        base = 0.0
        local = t
        if math.isfinite(period):
            base = math.floor(t / period) * period
            local = t - base
        for _ in range(3):  # this period, the next (wrapping), and give up
            flips = int(np.searchsorted(toggles, local, side="right"))
            state = bool(self.starts_online[client]) ^ (flips % 2 == 1)
            if state == want_online:
                return base + local
            if flips < len(toggles):
                return base + float(toggles[flips])
            if not math.isfinite(period):
                return INF
            base, local = base + period, 0.0
        return INF


def lognormal(rng: np.random.Generator, median: float, sigma: float, n: int) -> np.ndarray:
    """``median * exp(sigma * Z)``, Z ~ N(0, 1) (median exactly ``median``; sigma 0: constant)."""
    return median * np.exp(sigma * rng.standard_normal(n))


def drawn_profiles(dist: DeviceDistribution, seed: int, num_clients: int) -> Profiles:
    """Lognormal profiles, one independent stream per quantity (keyed by seed)."""

    def draw(kind: int, median: float, sigma: float) -> np.ndarray:
        return lognormal(seeding.rng(seed, CLOCK, kind), median, sigma, num_clients)

    return Profiles(
        draw(1, dist.compute_median, dist.compute_sigma),
        draw(2, dist.download_median, dist.download_sigma),
        draw(3, dist.upload_median, dist.upload_sigma),
        draw(4, dist.memory_median, dist.memory_sigma),
    )


def markov_trace(online_mean: float, offline_mean: float, seed: int, n: int) -> Trace:
    """Alternating exponential online / offline periods (means given), ``CYCLES`` cycles
    repeated; each client starts online with probability on / (on + off), part-way into its
    first period (the stationary start of an alternating renewal process, up to the
    exponential's memorylessness)."""
    rng = seeding.rng(seed, CLOCK, 5)
    starts_online = rng.random(n) < online_mean / (online_mean + offline_mean)
    means = np.empty((n, 2 * CYCLES))
    first = np.where(starts_online, online_mean, offline_mean)
    second = np.where(starts_online, offline_mean, online_mean)
    means[:, 0::2], means[:, 1::2] = first[:, None], second[:, None]
    lengths = rng.exponential(1.0, size=means.shape) * means
    toggles = np.cumsum(lengths, axis=1)
    return Trace(toggles[:, :-1], toggles[:, -1], starts_online)


def clock_inputs(settings: ClockConfig, seed: int, num_clients: int) -> tuple[Profiles, Trace]:
    """The run's profiles and trace: the trace file's (missing quantities drawn), or drawn."""
    drawn = drawn_profiles(settings.devices, seed, num_clients)
    online = settings.online
    if online.availability == "markov":
        trace = markov_trace(online.online_mean, online.offline_mean, seed, num_clients)
    else:
        trace = Trace.always(num_clients)
    if settings.trace is None:
        return drawn, trace
    return read_trace(Path(settings.trace), drawn, trace)


def read_trace(path: Path, drawn: Profiles, trace: Trace) -> tuple[Profiles, Trace]:
    """A trace file's profiles and availability over ``len(drawn)`` clients (entry k mod M);
    what the file does not give stays ``drawn`` / ``trace``'s."""
    where = f"clock.trace = {str(path)!r}"
    if not path.is_file():
        raise ConfigError(f"{where}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".csv":
            with open(path, newline="", encoding="utf-8") as handle:
                return _from_entries(list(csv.DictReader(handle)), drawn, trace, where)
        if suffix == ".json":
            record = json.loads(path.read_text(encoding="utf-8"))
        else:
            raise ConfigError(f"{where}: expected a .json or .csv file")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, csv.Error) as error:
        raise ConfigError(f"{where}: not readable ({error})") from None
    if isinstance(record, dict) and "clients" in record:
        return _from_entries(record["clients"], drawn, trace, where)
    if isinstance(record, dict) and ({"device_capacity", "behave_trace"} & set(record)):
        return _from_fedscale(record, drawn, trace, where)
    raise ConfigError(
        f'{where}: expected {{"clients": [...]}} (fedsub) or {{"device_capacity": ..., '
        '"behave_trace": ...}} (FedScale as JSON)'
    )


def _number(entry: dict, key: str, where: str, positive: bool = True) -> float:
    try:
        value = float(entry[key])
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {key} = {entry[key]!r} is not a number") from None
    if not math.isfinite(value) or (positive and value <= 0):
        raise ConfigError(f"{where}: {key} = {entry[key]!r}: expected a positive number")
    return value


def _spread(values: list[float], n: int) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)[np.arange(n) % len(values)]


def _from_entries(
    entries: list, drawn: Profiles, trace: Trace, where: str
) -> tuple[Profiles, Trace]:
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: expected a non-empty list of clients")
    n = len(drawn)
    columns = {}
    for key in ("compute", "download", "upload", "memory"):
        if not all(isinstance(e, dict) for e in entries):
            raise ConfigError(f"{where}: every client entry must be an object")
        given = [e.get(key) not in (None, "") for e in entries]
        if key == "compute" and not all(given):
            raise ConfigError(f"{where}: every client needs a compute speed (samples/s)")
        values = [
            _number(e, key, f"{where}, client {i}") if g else math.nan
            for i, (e, g) in enumerate(zip(entries, given, strict=True))
        ]
        columns[key] = _spread(values, n)  # missing (NaN): drawn, below
    profiles = Profiles(
        columns["compute"],
        np.where(np.isnan(columns["download"]), drawn.download, columns["download"]),
        np.where(np.isnan(columns["upload"]), drawn.upload, columns["upload"]),
        np.where(np.isnan(columns["memory"]), drawn.memory, columns["memory"]),
    )
    if not any(isinstance(e, dict) and "online" in e for e in entries):
        return profiles, trace
    rows, periods = [], []
    for i, entry in enumerate(entries):
        rows.append(_intervals(entry.get("online"), f"{where}, client {i}"))
        period = entry.get("period")
        periods.append(INF if period is None else _number(entry, "period", f"{where}, client {i}"))
    return profiles, _toggle_trace(rows, periods, [False] * len(rows), n)


def _intervals(online: object, where: str) -> list[float]:
    """[[start, end], ...] (sorted, disjoint) as toggle times; None: always online."""
    if online is None:
        return [0.0]  # online from time 0 on
    if not isinstance(online, list):
        raise ConfigError(f"{where}: online must be a list of [start, end] pairs")
    toggles: list[float] = []
    for pair in online:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ConfigError(f"{where}: online entry {pair!r} is not a [start, end] pair")
        start, end = float(pair[0]), float(pair[1])
        if start < (toggles[-1] if toggles else 0.0) or end <= start:
            raise ConfigError(
                f"{where}: online intervals must be sorted, disjoint and non-empty, got {pair!r}"
            )
        toggles += [start, end]
    return toggles


def _toggle_trace(
    rows: list[list[float]], periods: list[float], starts: list[bool], n: int
) -> Trace:
    width = max(1, *(len(r) for r in rows))
    table = np.full((len(rows), width), INF)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    pick = np.arange(n) % len(rows)
    return Trace(table[pick], np.asarray(periods, dtype=np.float64)[pick], np.asarray(starts)[pick])


def _from_fedscale(
    record: dict, drawn: Profiles, trace: Trace, where: str
) -> tuple[Profiles, Trace]:
    n = len(drawn)
    profiles = drawn
    capacity = record.get("device_capacity")
    if capacity is not None:
        ids = sorted(capacity, key=_numeric_id)
        speed = [1000.0 / (3.0 * _number(capacity[i], "computation", f"{where}, {i}")) for i in ids]
        band = [_number(capacity[i], "communication", f"{where}, {i}") * 1000 / 8 for i in ids]
        profiles = Profiles(_spread(speed, n), _spread(band, n), _spread(band, n), drawn.memory)
    behave = record.get("behave_trace")
    if behave is None:
        return profiles, trace
    rows, periods = [], []
    for i in sorted(behave, key=_numeric_id):
        entry = behave[i]
        active, inactive = list(entry.get("active", [])), list(entry.get("inactive", []))
        pairs = [[a, b] for a, b in zip(active, inactive, strict=False)]
        if len(active) > len(inactive):  # active to the end of the period
            pairs.append([active[-1], _number(entry, "finish_time", f"{where}, {i}")])
        rows.append(_intervals(pairs, f"{where}, {i}"))
        periods.append(_number(entry, "finish_time", f"{where}, {i}"))
    return profiles, _toggle_trace(rows, periods, [False] * len(rows), n)


def _numeric_id(key: str) -> tuple[int, int | str]:
    return (0, int(key)) if str(key).isdigit() else (1, str(key))
