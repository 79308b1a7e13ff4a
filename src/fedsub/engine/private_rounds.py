"""``train.privacy`` in the in-process engine, in one place: the cohort's requests and the
round's aggregation.

``PrivateRounds.wrap`` runs the configured backend unchanged, then draws each member's download
request (``privacy/private_download.py``, seeded by (seed, round, client)) and keeps only the
updates of requested rows: a held row that randomized response left out is skipped that round.
``PrivateRounds.combine`` aggregates: in the clear up to ``download`` (row sums divided by p
under randomized response), by secure sparse aggregation at ``full``
(``privacy/sparse_secagg.py``: each member's weighted deltas over the union of the cohort's
requests; the server decodes per-row sums and applies FedSubAvg's coefficients to them).

It also counts what a level costs (bytes per client per round, the clients' and the server's
privacy work in seconds) and can keep a transcript of everything the server received.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from fedsub.algorithms.aggregation import (
    Aggregation,
    RowUpdate,
    ServerUpdate,
    aggregate,
    aggregation_weights,
)
from fedsub.algorithms.sampling import Cohort
from fedsub.privacy.levels import Privacy
from fedsub.privacy.requests import client_request
from fedsub.privacy.secagg import SecAggServer
from fedsub.privacy.sparse_secagg import (
    RowSlots,
    RowSums,
    secagg_bytes,
    secure_row_sum,
    union_of,
)
from fedsub.submodel.transfer import CohortUpdate


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


RunCohort = Callable[..., CohortUpdate]


@dataclass
class PrivateRounds:
    privacy: Privacy
    aggregation: Aggregation
    table_rows: dict[str, int]
    seed: int
    keep_transcript: bool = False
    transcript: list[RoundRecord] = field(default_factory=list)
    costs: Costs = field(default_factory=Costs)
    _round: int = 0
    _requests: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)

    def request(
        self, rows: dict[str, np.ndarray], client: int, round_index: int
    ) -> dict[str, np.ndarray]:
        """Client ``client``'s download request in round ``round_index`` (table -> rows)."""
        return client_request(self.privacy, rows, self.table_rows, self.seed, round_index, client)

    def wrap(self, run_cohort: RunCohort) -> RunCohort:
        """The backend's ``run_cohort``, followed by the members' requests: each update keeps
        only its requested rows."""

        def run(model, global_params, dataset, index, cohort: Cohort, round_index, *rest):
            started = time.perf_counter()
            update = run_cohort(model, global_params, dataset, index, cohort, round_index, *rest)
            self.costs.training_seconds += time.perf_counter() - started
            started = time.perf_counter()
            held = {
                int(k): {t: index.client_rows(t, int(k)) for t in update.rows}
                for k in cohort.clients
            }
            self._requests = {k: self.request(rows, k, round_index) for k, rows in held.items()}
            self._round = round_index
            self.costs.client_seconds += time.perf_counter() - started
            self._count_download(update)
            if not self.privacy.private_download:
                return update
            return restrict(update, self._requests)

        return run

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

    def combine(self, update: CohortUpdate) -> ServerUpdate:
        """The round's server update from its (restricted) cohort update."""
        if self.privacy.secure_aggregation:
            return unbias(self._secure(update), self.privacy.keep)
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

    def _secure(self, update: CohortUpdate) -> ServerUpdate:
        """Secure sparse aggregation of the members' weighted deltas over the union of the
        cohort's requests (building the vectors is the clients' time; the protocol's steps
        are timed per side by ``secure_row_sum``)."""
        started = time.perf_counter()
        members = [int(k) for k in update.clients.tolist()]
        weights = aggregation_weights(update, self.aggregation).to(torch.float64).cpu()
        union = union_of(self._requests[k] for k in members)
        slots = RowSlots(
            {t: union.get(t, np.empty(0, np.int64)) for t in update.rows},
            {t: int(d.shape[1]) for t, d in update.table_deltas.items()},
            {n: tuple(v.shape[1:]) for n, v in update.dense_deltas.items()},
        )
        values = {}
        for j in range(len(members)):
            a = weights[j]
            spans = {t: update.member_rows(t, j) for t in update.rows}
            deltas = update.table_deltas
            values[j] = slots.client_values(
                {t: update.rows[t][s].cpu().numpy() for t, s in spans.items()},
                {t: (deltas[t][s].double() * a).cpu().numpy() for t, s in spans.items()},
                {n: (v[j].double() * a).cpu().numpy() for n, v in update.dense_deltas.items()},
            )
        built = time.perf_counter()
        sums = secure_row_sum(slots, values, self.privacy.secagg_clip)
        self.costs.client_seconds += built - started + sums.client_seconds
        self.costs.server_seconds += sums.server_seconds
        self.costs.clipped += sums.clipped
        sent = secagg_bytes(len(members), slots.length)
        self.costs.bytes_up += sent["up"] * len(members)
        self.costs.bytes_down += sent["down"] * len(members)
        if self.keep_transcript:
            self.transcript.append(
                RoundRecord(self._round, self._requests, secagg=sums.server, sums=sums)
            )
        return self._server_update(update, slots, sums)

    def _server_update(self, update: CohortUpdate, slots: RowSlots, sums: RowSums) -> ServerUpdate:
        return server_update_of_sums(self.aggregation, update, slots, sums.tables, sums.dense)


def server_update_of_sums(
    aggregation: Aggregation,
    update: CohortUpdate,
    slots: RowSlots,
    tables_sums: dict[str, np.ndarray],
    dense_sums: dict[str, np.ndarray],
) -> ServerUpdate:
    """Per-row sums with FedSubAvg's coefficients applied (1 for FedAvg), on the device and
    in the dtypes of ``update``'s deltas (a network runtime passes deltas of no rows)."""
    device = update.clients.device
    tables = {}
    for t, union in slots.rows.items():
        rows = torch.from_numpy(union).to(device)
        summed = torch.from_numpy(tables_sums[t]).to(device)
        if aggregation.coefficients is not None:
            coef = aggregation.coefficients[t].index_select(0, rows)
            summed = summed * coef.to(summed.dtype).unsqueeze(1)
        tables[t] = RowUpdate(rows, summed.to(update.table_deltas[t].dtype))
    dense = {
        n: torch.from_numpy(np.ascontiguousarray(dense_sums[n])).to(device, v.dtype)
        for n, v in update.dense_deltas.items()
    }
    return ServerUpdate(tables, dense)


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
    return ServerUpdate(tables, update.dense)
