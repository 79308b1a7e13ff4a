"""``privacy.level`` in the in-process engine, in one place: the cohort's requests and the
round's aggregation (its adapter, engine/features/private.py, runs the backend between them).

Its adapter's client stage (engine/features/private.py ``client_stage``) has each member's
download request drawn (``PrivateRounds.draw_requests``: ``privacy/private_download.py``,
seeded by (seed, round, client)), runs the configured backend and keeps only the updates of
requested rows (``PrivateRounds.received``). A held row that randomized response left out is
*skipped* that round: the member never received it, so it trains without it (the row reads as
zero in its local steps, as if the feature were absent from its samples: ``WithoutRows``) and
sends no update for it; a Flower node does the same (``privacy/download_protocol.py``), so both
agree with either payload and keep no state across rounds.
``PrivateRounds.combine`` aggregates: in the clear up to ``download`` (row sums divided by p
under randomized response), by secure sparse aggregation at ``full``
(``privacy/sparse_secagg.py``: each member's weighted deltas over the union of the cohort's
requests; the server decodes per-row sums and applies FedSubAvg's coefficients to them).
At ``full`` no member's sample count reaches the server either (``SecureWeighting``): a member
weights its deltas itself from public numbers and its own count, its weight units go into the
secure sum beside them, and the server normalizes the decoded sums by the survivors' total.

With [dp] at ``full`` the round is distributed differential privacy (``SecureRound``,
``dp/distributed.py``): each member clips its own update, encodes it and adds its share of
discrete Gaussian noise; the server decodes the noised sum over the union of the requests and
divides it by the public denominator K (and by p under randomized response).

It also counts what a level costs (bytes per client per round, the clients' and the server's
privacy work in seconds) and can keep a transcript of everything the server received.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from fedsub.algorithms.aggregation import Aggregation, RowUpdate, ServerUpdate, aggregate
from fedsub.algorithms.weighting import WEIGHTINGS, SecureWeighting
from fedsub.numerics.fixed_point import FixedPoint
from fedsub.privacy.levels import Privacy, describe
from fedsub.privacy.randomness import PrivacyStreams
from fedsub.privacy.requests import client_request
from fedsub.privacy.secagg import SecAggServer
from fedsub.privacy.sparse_secagg import (
    INTEGER_SLOTS,
    Decoded,
    RowSlots,
    RowSums,
    encode_client,
    majority_threshold,
    noised_input,
    secagg_bytes,
    secure_row_sum,
    union_of,
)
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import CohortUpdate

LOG = logging.getLogger("fedsub")


@dataclass(frozen=True)
class RoundRecord:
    """Everything the server received in one round: each client's request (client id ->
    table -> rows), and either the clients' plain updates or the secure aggregation's view."""

    round: int
    requests: dict[int, dict[str, np.ndarray]]
    plain_updates: CohortUpdate | None = None
    secagg: SecAggServer | None = None
    sums: RowSums | None = None


@dataclass
class Costs:
    """Totals over the rounds run: member-rounds, bytes each way, seconds of privacy work."""

    rounds: int = 0
    member_rounds: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    training_seconds: float = 0.0  # the backend's client work (the same at every level)
    client_seconds: float = 0.0  # requests, encoding and masking, summed over clients
    server_seconds: float = 0.0  # aggregation (secure: unmasking and decoding)
    clipped: int = 0  # fixed-point values clipped to the range (secure aggregation)

    def as_json(self) -> dict:
        per = max(self.member_rounds, 1)
        return {
            "rounds": self.rounds,
            "bytes_up_per_client_round": self.bytes_up / per,
            "bytes_down_per_client_round": self.bytes_down / per,
            "training_seconds_per_round": self.training_seconds / max(self.rounds, 1),
            "privacy_client_seconds_per_client_round": self.client_seconds / per,
            "server_seconds_per_round": self.server_seconds / max(self.rounds, 1),
            "clipped_values": self.clipped,
        }


@dataclass
class WithoutRows(Params):
    """One member's view of the global model under randomized-response download: the held rows
    its request left out (``skipped``, per table) read as zero, so its local steps run as if
    those features were absent from its samples, as on a node that never received them."""

    skipped: dict[str, torch.Tensor] = field(default_factory=dict)

    def gather_rows(self, table: str, rows: torch.Tensor) -> torch.Tensor:
        values = super().gather_rows(table, rows)
        skipped = self.skipped.get(table)
        if skipped is None or not len(skipped):
            return values
        return values.masked_fill(torch.isin(rows, skipped).unsqueeze(1), 0)


def skipped_rows(
    held: dict[str, np.ndarray], request: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Per table, the held rows (sorted) that ``request`` (sorted) leaves out."""
    return {t: np.setdiff1d(r, request[t], assume_unique=True) for t, r in held.items()}


def secure_weighting(aggregation: Aggregation, multiplicity: list[int]) -> SecureWeighting:
    """``aggregation_weights``'s a_k as a ``SecureWeighting`` over public numbers only: the
    members' draws, the cohort size and the population totals (N and the total sample count
    W, which at ``full`` come from the secure heat exchange), as the aggregation's weighting
    piece computes it (``algorithms/weighting.py``). Scheme II's model average rescales the
    old model by the weights' sum, which the server reads from the total units."""
    piece = WEIGHTINGS[aggregation.weighting]
    if piece.secure is None or aggregation.combine_step is not None:
        raise ValueError(
            f"weighting {aggregation.weighting!r} (or the rule's own combine step) cannot be "
            "computed by a secure sum"
        )
    secure = piece.secure(multiplicity, aggregation)
    if piece.sums_to_one:
        return secure
    return dataclasses.replace(secure, model_average=aggregation.model_average)


class RoundNoise(Protocol):
    """A round's public noise under distributed DP (dp/distributed.py's ``DiscreteNoise``):
    its clip C, the fixed point the sum is decoded with, and a member's noisy share of its
    real values."""

    @property
    def clip(self) -> float: ...

    @property
    def coding(self) -> FixedPoint: ...

    def share(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray: ...


class NoisySum(Protocol):
    """[dp] at "full": distributed DP's part in a round's secure row sum (dp/distributed.py's
    ``DistributedDp``, which the dp feature gives the private rounds): the round's noise, the
    threshold raised to K_min, the public denominator K, and (in process) each member's
    generator."""

    @property
    def noise_multiplier(self) -> float: ...

    @property
    def min_survivors(self) -> int: ...

    @property
    def denominator(self) -> int: ...

    def noise(self, members: int, length: int) -> RoundNoise: ...

    def threshold(self, majority: int) -> int: ...

    def generator(self, round_index: int, member: int) -> np.random.Generator: ...


@dataclass
class PrivateRounds:
    privacy: Privacy
    aggregation: Aggregation
    table_rows: dict[str, int]
    seed: int
    keep_transcript: bool = False
    # [dp] at "full": distributed DP (``_secure``; dp/distributed.py's ``DistributedDp``, with
    # the key of the members' noise shares: the run's secret, seeded: train.seed)
    dp: NoisySum | None = None
    # the key of the download requests: the clients' secret (privacy/randomness.py); None:
    # train.seed
    requests_key: PrivacyStreams | None = None
    # what the rounds accumulate, not what they are given: the transcript (kept when
    # keep_transcript), the costs, and the round and requests ``draw_requests`` drew for
    # ``combine``
    transcript: list[RoundRecord] = field(default_factory=list, init=False)
    costs: Costs = field(default_factory=Costs, init=False)
    _round: int = field(default=0, init=False)
    _requests: dict[int, dict[str, np.ndarray]] = field(default_factory=dict, init=False)

    @property
    def drawn_privacy(self) -> Privacy:
        """The level as its requests were drawn: seeded when a resumed run's checkpoint had no
        secret (``PrivacyStreams.load_absent``), for its privacy.json."""
        if self.requests_key is None:
            return self.privacy
        return dataclasses.replace(self.privacy, randomness=self.requests_key.randomness)

    def described(self) -> dict:
        """privacy.json's record of the level (``drawn_privacy``): its guarantees."""
        return describe(self.drawn_privacy)

    def request(
        self, rows: dict[str, np.ndarray], client: int, round_index: int
    ) -> dict[str, np.ndarray]:
        """Client ``client``'s download request in round ``round_index`` (table -> rows)."""
        key = self.seed if self.requests_key is None else self.requests_key.key
        return client_request(self.privacy, rows, self.table_rows, key, round_index, client)

    def draw_requests(
        self, held: dict[int, dict[str, np.ndarray]], round_index: int
    ) -> dict[int, dict[str, np.ndarray]]:
        """The cohort's download requests in round ``round_index`` (``held``: each member's
        rows, by client), kept for the round's ``received`` and ``combine``."""
        self._requests = {k: self.request(rows, k, round_index) for k, rows in held.items()}
        self._round = round_index
        return self._requests

    def received(self, update: CohortUpdate) -> CohortUpdate:
        """The cohort's update as the server receives it (the download counted): each
        member's of its requested rows only, under a private download."""
        self._count_download(update)
        if not self.privacy.private_download:
            return update
        return restrict(update, self._requests)

    def _count_download(self, update: CohortUpdate) -> None:
        """Request ids up (8 bytes each), the requested rows and the dense model down."""
        item = next(iter(update.table_deltas.values()), torch.empty(0)).element_size()
        for request in self._requests.values():
            ids = sum(len(r) for r in request.values())
            widths = sum(
                len(r) * update.table_deltas[t].shape[1] * item for t, r in request.items()
            )
            self.costs.bytes_up += 8 * ids
            self.costs.bytes_down += widths + _dense_bytes(update)
        self.costs.member_rounds += len(self._requests)
        self.costs.rounds += 1

    def combining(self, aggregation: Aggregation) -> Callable[[CohortUpdate], ServerUpdate]:
        """The round's combine over ``aggregation``: the algorithm's as the run's other features
        adjust it (host tables, at level none: the coefficients applied on the host), on the
        run's device; it replaces the one this was built with."""
        self.aggregation = aggregation
        return self.combine

    def combine(self, update: CohortUpdate) -> ServerUpdate:
        """The round's server update from its (restricted) cohort update."""
        if self.privacy.secure_aggregation:
            return self._secure(update)
        started = time.perf_counter()
        server_update = aggregate(update, self.aggregation)
        self.costs.server_seconds += time.perf_counter() - started
        rows = sum(len(r) for r in update.rows.values())
        item = next(iter(update.table_deltas.values()), torch.empty(0)).element_size()
        widths = sum(len(r) * update.table_deltas[t].shape[1] for t, r in update.rows.items())
        self.costs.bytes_up += 8 * rows + item * widths + len(update) * _dense_bytes(update)
        if self.keep_transcript:
            self.transcript.append(RoundRecord(self._round, self._requests, update))
        return unbias(server_update, self.privacy.keep)

    def _member_values(self, update: CohortUpdate, slots: RowSlots, j: int) -> np.ndarray:
        """Member j's real vector over ``slots`` (its unweighted deltas), on its side."""
        spans = {t: update.member_rows(t, j) for t in update.rows}
        deltas = update.table_deltas
        return slots.client_values(
            {t: update.rows[t][s].cpu().numpy() for t, s in spans.items()},
            {t: deltas[t][s].double().cpu().numpy() for t, s in spans.items()},
            {n: v[j].double().cpu().numpy() for n, v in update.dense_deltas.items()},
        )

    def _secure(self, update: CohortUpdate) -> ServerUpdate:
        """Secure sparse aggregation over the union of the cohort's requests (``SecureRound``):
        each member's weighted deltas and weight units, or with [dp] its noisy share of its
        clipped update (``RoundNoise.share``, keyed by (the run's secret, round, client)).
        Building the vectors is the clients' time; the protocol's steps are timed per side by
        ``secure_row_sum``. The server reads the public plan and the decoded sums only; each
        member's count (``weights``) is read on the member's side."""
        started = time.perf_counter()
        members = [int(k) for k in update.clients.tolist()]
        requests = [self._requests[k] for k in members]
        plan = SecureRound.plan(update, requests, self.aggregation, self.privacy, self.dp)
        counts = [round(float(w)) for w in update.weights.tolist()]  # each member's own n_k
        values = {j: self._member_values(update, plan.slots, j) for j in range(len(members))}

        def encode(j: int, vector: np.ndarray) -> np.ndarray:
            if plan.noise is not None:
                assert self.dp is not None  # the plan's noise is [dp]'s
                rng = self.dp.generator(self._round, members[j])
                return noised_input(vector, plan.noise.share, rng)
            return weighted_input(plan, j, counts[j], vector)

        built = time.perf_counter()
        sums = secure_row_sum(
            plan.slots,
            values,
            self.privacy.secagg_clip,
            plan.threshold,
            coding=plan.coding,
            encode=encode,
        )
        self.costs.client_seconds += built - started + sums.client_seconds
        self.costs.server_seconds += sums.server_seconds
        self.costs.clipped += sums.clipped
        sent = secagg_bytes(len(members), plan.slots.length)
        self.costs.bytes_up += sent["up"] * len(members)
        self.costs.bytes_down += sent["down"] * len(members)
        if self.keep_transcript:
            self.transcript.append(
                RoundRecord(self._round, self._requests, secagg=sums.server, sums=sums)
            )
        return plan.server_update(self.aggregation, update, sums)


@dataclass(frozen=True)
class SecureRound:
    """The public plan of one round's secure row sum at ``full``, in process and on Flower:
    the slots, the fixed point the sum is decoded with, its threshold (None: the majority),
    and either the members' weighting or, with [dp] (distributed DP), the round's noise and
    the public denominator K its sum is divided by."""

    slots: RowSlots
    coding: FixedPoint
    members: int
    keep: float  # p: row sums divided by it under randomized response
    weighting: SecureWeighting | None = None
    noise: RoundNoise | None = None
    threshold: int | None = None
    denominator: int = 0  # K, with [dp]

    @staticmethod
    def plan(
        update: CohortUpdate,
        requests: Iterable[Mapping[str, np.ndarray]],
        aggregation: Aggregation,
        privacy: Privacy,
        dp: NoisySum | None,
    ) -> SecureRound:
        """The round's plan from public numbers only: the members' ``requests``, their draws
        (``update.multiplicity``) and the deltas' shapes."""
        slots, n = round_slots(update, requests), len(update)
        if dp is None:
            coding = FixedPoint.for_clients(n, privacy.secagg_clip)
            weighting = secure_weighting(aggregation, [int(m) for m in update.multiplicity])
            return SecureRound(slots, coding, n, privacy.keep, weighting)
        # the integer slots carry nothing under distributed DP: no units, no clipped count
        real = slots.length - INTEGER_SLOTS
        noise = dp.noise(n, real)
        # the majority raised to K_min: no sum with less noise than accounted is ever decoded
        threshold = dp.threshold(majority_threshold(n))
        k = dp.denominator
        return SecureRound(slots, noise.coding, n, privacy.keep, None, noise, threshold, k)

    def server_update(
        self, aggregation: Aggregation, update: CohortUpdate, sums: RowSums | Decoded
    ) -> ServerUpdate:
        """The server's step from the decoded sums (``noised_update`` with [dp], else
        ``server_update_of_sums``), row sums divided by p."""
        if self.weighting is None:
            return noised_update(update, self.slots, sums, self.denominator, self.keep)
        step = server_update_of_sums(aggregation, update, self.slots, sums, self.weighting)
        return unbias(step, self.keep)


def weighted_input(plan: SecureRound, member: int, count: int, values: np.ndarray) -> np.ndarray:
    """A member's uint32 input to the secure sum without [dp], on its side: its vector over
    the slots (``RowSlots.client_values``, unweighted) times its coefficient, in fixed point,
    and its weight units from its own sample ``count`` (summed inside the sum only)."""
    assert plan.weighting is not None  # without [dp]
    units = plan.weighting.units(member, count)
    weighted = values * plan.weighting.coefficient(units)
    return encode_client(plan.slots, plan.coding, weighted, units, plan.members)


def round_slots(update: CohortUpdate, requests: Iterable[Mapping[str, np.ndarray]]) -> RowSlots:
    """A secure row sum's public layout, in process and on Flower: the union of the members'
    ``requests``, the tables' widths, the dense shapes."""
    union = union_of(requests)
    return RowSlots(
        {t: union.get(t, np.empty(0, np.int64)) for t in update.rows},
        {t: int(d.shape[1]) for t, d in update.table_deltas.items()},
        {n: tuple(v.shape[1:]) for n, v in update.dense_deltas.items()},
    )


def noised_update(
    update: CohortUpdate, slots: RowSlots, sums: RowSums | Decoded, k: int, keep: float
) -> ServerUpdate:
    """The server's step from the decoded noised sums: divided by the public denominator K
    (and by p under randomized response), on ``update``'s device and in its dtypes. Every
    value of the round's row union changes (the union is public: the requests)."""
    device = update.clients.device
    tables = {
        t: RowUpdate(
            torch.from_numpy(union).to(device),
            torch.from_numpy(sums.tables[t] / (k * keep)).to(device, update.table_deltas[t].dtype),
        )
        for t, union in slots.rows.items()
    }
    dense = {
        n: torch.from_numpy(np.ascontiguousarray(sums.dense[n] / k)).to(device, v.dtype)
        for n, v in update.dense_deltas.items()
    }
    return ServerUpdate(tables, dense)


def server_update_of_sums(
    aggregation: Aggregation,
    update: CohortUpdate,
    slots: RowSlots,
    sums: RowSums | Decoded,
    weighting: SecureWeighting,
) -> ServerUpdate:
    """The secure sums (per row and dense, over the survivors, in process or decoded from a
    network round) times the weighting's ``correction`` for the survivors' weight units, with
    FedSubAvg's coefficients applied (1 for FedAvg), on the device and in the dtypes of
    ``update``'s deltas (a network runtime passes deltas of no rows); Scheme II's f as the
    weighting's ``model_scale``."""
    correction = weighting.correction(sums.weight_units)
    model_scale = weighting.model_scale(sums.weight_units)
    tables_sums, dense_sums = sums.tables, sums.dense
    device = update.clients.device
    tables = {}
    for t, union in slots.rows.items():
        rows = torch.from_numpy(union).to(device)
        summed = torch.from_numpy(tables_sums[t] * correction).to(device)
        if aggregation.coefficients is not None:
            coef = aggregation.coefficients[t].index_select(0, rows)
            summed = summed * coef.to(summed.dtype).unsqueeze(1)
        tables[t] = RowUpdate(rows, summed.to(update.table_deltas[t].dtype))
    dense = {
        n: torch.from_numpy(np.ascontiguousarray(dense_sums[n] * correction)).to(device, v.dtype)
        for n, v in update.dense_deltas.items()
    }
    if model_scale is None:
        return ServerUpdate(tables, dense)
    return ServerUpdate(tables, dense, torch.tensor(model_scale, dtype=torch.float64))


def _dense_bytes(update: CohortUpdate) -> int:
    """One member's dense parameters in bytes."""
    return sum(v[0].numel() * v.element_size() for v in update.dense_deltas.values())


def restrict(update: CohortUpdate, requests: dict[int, dict[str, np.ndarray]]) -> CohortUpdate:
    """The cohort update with each member's rows cut to those it requested (sorted)."""
    members = [int(k) for k in update.clients.tolist()]
    rows, owner, deltas = {}, {}, {}
    for t, all_rows in update.rows.items():
        held = all_rows.cpu().numpy()
        keep = np.zeros(len(held), dtype=bool)
        for j, k in enumerate(members):
            span = update.member_rows(t, j)
            own, request = held[span], requests[k][t]
            at = np.minimum(np.searchsorted(request, own), max(len(request) - 1, 0))
            keep[span] = request[at] == own if len(request) else False
        keep_on_device = torch.from_numpy(keep).to(all_rows.device)
        rows[t] = all_rows[keep_on_device]
        owner[t] = update.row_owner[t][keep_on_device]
        deltas[t] = update.table_deltas[t][keep_on_device]
    return CohortUpdate(
        update.clients,
        update.weights,
        update.multiplicity,
        rows,
        owner,
        deltas,
        update.dense_deltas,
    )


def unbias(update: ServerUpdate, keep: float) -> ServerUpdate:
    """Row sums divided by p: a held row reaches the server with probability p under
    randomized response, so its expected update stays the plain one (p = 1: unchanged)."""
    if keep == 1.0:
        return update
    tables = {t: RowUpdate(u.rows, u.values / keep) for t, u in update.tables.items()}
    return dataclasses.replace(update, tables=tables)
