"""Secure aggregation of sparse row updates: the server learns per-row sums, nothing per client.

A round's clients each hold deltas for a few rows of a large table. Their vectors are laid out
over the *union* of the rows the cohort requested (``RowSlots``: public, the server built it
from the download requests), never over the whole table: a client places its (weighted) deltas
in its rows' slots and zeros elsewhere, appends its dense deltas, encodes them in fixed point
(``fixed_point.FixedPoint``), appends two plain integers (its aggregation weight in units, e.g.
its sample count times its draws, and its count of clipped values) and submits the vector to
fedsub's secure aggregation (``secagg``: Bonawitz et al., pairwise and self masks mod 2^32,
t-of-n recovery of dropped clients' masks). The server decodes one vector: the per-row sums
over the surviving clients, within ``FixedPoint.error_bound(n)`` of the exact sum of their
clipped values, the survivors' total weight (exact: integers; no client's own weight, so no
client's sample count reaches the server) and the total number of clipped values.

Every step is a function of plain data (row ids, float and uint32 arrays, secagg's messages),
so the same code serves the simulator (``secure_row_sum``) and a network runtime.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from fedsub.numerics.fixed_point import FixedPoint
from fedsub.privacy import shamir
from fedsub.privacy.secagg import EncryptedShares, MaskedInput, SecAggClient, SecAggServer

T = TypeVar("T")

INTEGER_SLOTS = 2  # a client's weight units and its clipped count, after its real values
WEIGHT_LIMIT = 2**32  # the survivors' weight units must sum below this (uint32, no wrap)


def majority_threshold(clients: int) -> int:
    """secagg's t for a cohort of n: floor(n / 2) + 1 (as the private heat sources use)."""
    return clients // 2 + 1


def union_of(requests: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per table, the sorted distinct rows that any of the requests names."""
    collected: dict[str, list[np.ndarray]] = {}
    for request in requests:
        for table, rows in request.items():
            collected.setdefault(table, []).append(np.asarray(rows, dtype=np.int64))
    return {t: np.unique(np.concatenate(parts)) for t, parts in collected.items()}


@dataclass(frozen=True)
class RowSlots:
    """The layout of every client's vector in one round: per table the union's rows (sorted)
    times the row width, then each dense parameter, then two integer slots: the client's
    weight units and its clipped count (``INTEGER_SLOTS``)."""

    rows: dict[str, np.ndarray]
    widths: dict[str, int]
    dense: dict[str, tuple[int, ...]]

    def table_length(self, table: str) -> int:
        return len(self.rows[table]) * self.widths[table]

    @property
    def length(self) -> int:
        """Values per client vector (the integer slots included)."""
        tables = sum(self.table_length(t) for t in self.rows)
        return tables + sum(int(np.prod(s)) for s in self.dense.values()) + INTEGER_SLOTS

    def client_values(
        self,
        rows: Mapping[str, np.ndarray],
        deltas: Mapping[str, np.ndarray],
        dense: Mapping[str, np.ndarray],
    ) -> np.ndarray:
        """One client's real values (float64, integer slots 0): its row deltas in its rows'
        slots, zeros in every other slot. A row outside the union is refused (the client only
        updates rows it requested)."""
        parts = []
        for table, union in self.rows.items():
            own = np.asarray(rows.get(table, np.empty(0, np.int64)), dtype=np.int64)
            block = np.zeros((len(union), self.widths[table]))
            if len(own):
                slots = np.searchsorted(union, own)
                inside = slots < len(union)
                if not inside.all() or not (union[slots] == own).all():
                    raise ValueError(f"table {table!r}: a client row is not in the round's union")
                np.add.at(block, slots, np.asarray(deltas[table], dtype=np.float64))
            parts.append(block.reshape(-1))
        for name, shape in self.dense.items():
            parts.append(np.asarray(dense[name], dtype=np.float64).reshape(-1))
            if parts[-1].size != int(np.prod(shape)):
                raise ValueError(f"dense parameter {name!r} must have shape {shape}")
        parts.append(np.zeros(INTEGER_SLOTS))
        return np.concatenate(parts)

    def split(self, values: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """A decoded vector back into per-table [rows, width] sums and dense sums (the
        integer slots are left out)."""
        tables, dense, start = {}, {}, 0
        for table, union in self.rows.items():
            stop = start + self.table_length(table)
            tables[table] = values[start:stop].reshape(len(union), self.widths[table])
            start = stop
        for name, shape in self.dense.items():
            stop = start + int(np.prod(shape))
            dense[name] = values[start:stop].reshape(shape)
            start = stop
        return tables, dense


def encode_client(
    slots: RowSlots, coding: FixedPoint, values: np.ndarray, weight_units: int = 0, clients: int = 1
) -> np.ndarray:
    """A client's uint32 input to secure aggregation: its values in fixed point, then two
    plain integers: its weight units (e.g. draws times sample count; summed exactly, so the
    server learns the survivors' total, never this client's) and how many values it clipped
    (the server learns only the cohort's total). The units of ``clients`` clients must not
    wrap around mod 2^32: each must be below 2^32 / clients."""
    if not 0 <= weight_units < WEIGHT_LIMIT // clients:
        raise ValueError(
            f"weight units {weight_units} out of the secure sum's range [0, 2^32 / {clients})"
        )
    encoded, clipped = coding.encode(values[:-INTEGER_SLOTS])
    return np.concatenate([encoded, np.array([weight_units, clipped], dtype=np.uint32)])


def noised_input(
    values: np.ndarray,
    share: Callable[[np.ndarray, np.random.Generator], np.ndarray],
    rng: np.random.Generator,
) -> np.ndarray:
    """A client's uint32 input to secure aggregation under distributed DP, from its vector
    over the round's slots (``RowSlots.client_values``, unweighted): ``share`` of its real
    values with ``rng`` (dp/distributed.py's ``DiscreteNoise.share``: its own noise share in
    it), zeros in the integer slots (no units, no clipped count)."""
    noised = share(values[:-INTEGER_SLOTS], rng)
    return np.concatenate([noised, np.zeros(INTEGER_SLOTS, dtype=np.uint32)])


@dataclass(frozen=True)
class RowSums:
    """What the server learns: per-row and dense sums over the survivors, their total weight
    units, how many values were clipped in all, the bound on the fixed-point error of each
    sum, its protocol view, and the seconds spent by all clients together and by the server."""

    tables: dict[str, np.ndarray]
    dense: dict[str, np.ndarray]
    weight_units: int
    clipped: int
    error_bound: float
    survivors: tuple[int, ...]
    server: SecAggServer
    client_seconds: float = 0.0
    server_seconds: float = 0.0


@dataclass(frozen=True)
class Decoded:
    """The server's reading of one secure sum (``decode_sums``)."""

    tables: dict[str, np.ndarray]
    dense: dict[str, np.ndarray]
    weight_units: int
    clipped: int
    error_bound: float


def decode_sums(slots: RowSlots, coding: FixedPoint, total: np.ndarray, clients: int) -> Decoded:
    """The server's decoding of the secure sum of ``clients`` encoded vectors."""
    real = coding.decode_sum(total[:-INTEGER_SLOTS])
    tables, dense = slots.split(real)
    weight, clipped = (int(v) for v in np.asarray(total[-INTEGER_SLOTS:], dtype=np.uint32))
    return Decoded(tables, dense, weight, clipped, coding.error_bound(clients))


class _Stopwatch:
    """Seconds spent on each side of the protocol."""

    def __init__(self) -> None:
        self.spent = {"client": 0.0, "server": 0.0}

    def run(self, side: str, work: Callable[[], T]) -> T:
        started = time.perf_counter()
        result = work()
        self.spent[side] += time.perf_counter() - started
        return result


def secure_row_sum(
    slots: RowSlots,
    values: Mapping[int, np.ndarray],
    clip: float,
    threshold: int | None = None,
    drop_before_masking: Iterable[int] = (),
    drop_after_masking: Iterable[int] = (),
    weight_units: Mapping[int, int] | None = None,
    coding: FixedPoint | None = None,
    encode: Callable[[int, np.ndarray], np.ndarray] | None = None,
) -> RowSums:
    """Run the sparse secure sum in process over ``values`` (client id 0..n-1 -> its
    ``RowSlots.client_values``) and ``weight_units`` (client id -> its integer weight, 0 if
    not given), step by step as secagg's messages go over a network: clients
    in ``drop_before_masking`` vanish after sharing keys, those in ``drop_after_masking`` after
    sending their masked vector (it still counts). The fixed-point scale is chosen for the n
    clients that start, so no sum of survivors can wrap around; ``threshold`` defaults to the
    majority. Fewer than t clients left raise ``SecAggError`` (secagg's clear refusal).
    ``encode`` (client id, its values -> its uint32 input of ``slots.length`` values) replaces
    ``encode_client``, and ``coding`` the decoding's fixed point (distributed differential
    privacy: dp/distributed.py's noisy shares)."""
    n = len(values)
    coding = FixedPoint.for_clients(n, clip) if coding is None else coding
    t = majority_threshold(n) if threshold is None else threshold
    session = secrets.token_bytes(16)
    watch = _Stopwatch()
    clients = {u: SecAggClient(u, t, session) for u in values}
    server = SecAggServer(t, slots.length, session)
    inboxes = _share_keys(clients, server, watch)
    before, after = set(drop_before_masking), set(drop_after_masking)
    encoded = _encoder(slots, coding, values, weight_units or {}, encode)

    def mask_inputs() -> list[MaskedInput]:
        return [clients[u].masked_input(inboxes[u], encoded(u)) for u in inboxes if u not in before]

    masked = watch.run("client", mask_inputs)
    request = watch.run("server", lambda: server.collect_masked(masked))
    responses = watch.run(
        "client", lambda: [clients[v].unmask(request) for v in request.survivors if v not in after]
    )
    total = watch.run("server", lambda: server.finish(request, responses))
    survivors = tuple(request.survivors)
    decoded = watch.run("server", lambda: decode_sums(slots, coding, total, len(survivors)))
    return RowSums(
        decoded.tables,
        decoded.dense,
        decoded.weight_units,
        decoded.clipped,
        decoded.error_bound,
        survivors,
        server,
        watch.spent["client"],
        watch.spent["server"],
    )


def _share_keys(
    clients: Mapping[int, SecAggClient], server: SecAggServer, watch: _Stopwatch
) -> dict[int, list[EncryptedShares]]:
    """Secagg's first two steps: every client advertises its keys and shares its secrets; the
    server routes each client its inbox of shares (timed as client and server work)."""
    adverts = watch.run("client", lambda: [c.advertise() for c in clients.values()])
    keys = watch.run("server", lambda: server.collect_keys(adverts))
    shared = watch.run("client", lambda: [c.share_keys(keys) for c in clients.values()])
    return watch.run("server", lambda: server.route_shares(shared))


def _encoder(
    slots: RowSlots,
    coding: FixedPoint,
    values: Mapping[int, np.ndarray],
    units: Mapping[int, int],
    encode: Callable[[int, np.ndarray], np.ndarray] | None,
) -> Callable[[int], np.ndarray]:
    """Client u's uint32 input: ``encode``'s when given (distributed DP's noisy shares), else
    its values and integer weight in fixed point scaled for the n clients that start."""
    n = len(values)

    def encoded(u: int) -> np.ndarray:
        if encode is not None:
            return encode(u, values[u])
        return encode_client(slots, coding, values[u], units.get(u, 0), n)

    return encoded


# ---- message sizes (bytes), from secagg's message layouts --------------------------------

_KEYS = 16 + 4 + 32 + 32  # AdvertiseKeys: session, sender, two X25519 public keys
_SHARE = 16 + 8 + 12 + (16 + 2 * shamir.SHARE_BYTES) + 16  # session, ids, nonce, box, tag
_UNMASK_SHARE = 4 + 4 + shamir.SHARE_BYTES  # owner, x, y


def secagg_bytes(clients: int, length: int) -> dict[str, int]:
    """Bytes one client sends and receives in one secure sum of ``length`` uint32 values among
    ``clients`` (no dropouts): keys, encrypted shares (one per client, itself included, as
    ``SecAggClient.share_keys`` sends), the masked vector, the unmasking shares."""
    up = _KEYS + (16 + 4 + 32 + clients * _SHARE) + (20 + 4 * length) + 20
    up += (clients - 1) * _UNMASK_SHARE
    down = clients * _KEYS + clients * _SHARE + (16 + 4 * clients)
    return {"up": up, "down": down}
