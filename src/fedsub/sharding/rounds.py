"""A round over row-sharded tables: fetch the members' rows, route their deltas to the owners.

Every process draws the same cohort and runs its contiguous share of the members, as under a
plain torchrun (engine/split_cohort.py). What changes is where the table rows live:

1. ``stage``: the union of this process's members' S(k) per table (sorted global ids) is asked
   of the rows' owners (all-to-all of ids, then of values); the backend pulls each member's
   rows from that slice (``FetchedRows.gather_rows``), so its numbers are one process's.
2. ``combine``: the members' sizes, weights and dense deltas are gathered by every process in
   member order (small: no table in them), so every process computes the cohort's weights and
   the dense aggregate exactly as one process does. Each table entry ``a_k delta_k[m]`` is
   formed by the process that trained member k and routed to row m's owner, blocks in rank
   order, so an owner receives each of its rows' terms in member order, the order one process
   sums them in: its segment sums, heat coefficients and server step are bit for bit one
   process's, on its rows only.

Bytes per round (``Traffic``) grow with the cohort's rows and dense size, never the table's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
import torch

from fedsub import distributed
from fedsub.algorithms.aggregation import (
    Aggregation,
    RowUnion,
    RowUpdate,
    ServerUpdate,
    aggregation_weights,
    weighted_sum,
    with_coefficients,
)
from fedsub.algorithms.sampling import Cohort
from fedsub.distributed import Processes
from fedsub.numerics import segment_sum
from fedsub.sharding.exchange import Route, Traffic, sent_bytes
from fedsub.sharding.partition import RowPartition
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import CohortUpdate, empty_update

RunCohort = Callable[..., CohortUpdate]
Member = TypeVar("Member")
LOG = logging.getLogger("fedsub.sharding")  # DEBUG: each round's bytes (benchmarks read them)


@dataclass
class ShardParams(Params):
    """This process's share of the global model: its rows of every table (``partitions``
    say which) and the dense parameters whole."""

    partitions: dict[str, RowPartition] = field(default_factory=dict)
    rank: int = 0


@dataclass
class FetchedRows(Params):
    """A round's rows ``rows[t]`` (sorted global ids) of table t, fetched from their owners,
    and the dense parameters: what the members pull from."""

    rows: dict[str, torch.Tensor] = field(default_factory=dict)

    def gather_rows(self, table: str, rows: torch.Tensor) -> torch.Tensor:
        positions = torch.searchsorted(self.rows[table], rows)
        return self.tables[table].index_select(0, positions)


def shard(params: Params, processes: Processes) -> ShardParams:
    """This process's rows of the whole model ``params`` (copies: the whole can be freed)."""
    partitions = {t: RowPartition(len(v), processes.world_size) for t, v in params.tables.items()}
    tables = {
        t: params.tables[t][p.range_of(processes.rank)].clone() for t, p in partitions.items()
    }
    return ShardParams(tables, dict(params.dense), partitions, processes.rank)


def own_rows(values: torch.Tensor, partition: RowPartition, rank: int) -> torch.Tensor:
    """A per-row tensor of process ``rank``'s rows: ``values`` when it holds just those, else
    its rows of ``values`` (the whole table's)."""
    mine = partition.range_of(rank)
    if len(values) == partition.rows:
        return values[mine.start : mine.stop].clone()
    if len(values) != len(mine):
        raise ValueError(
            f"{len(values)} per-row values: neither the table's {partition.rows} rows nor "
            f"process {rank}'s {len(mine)}"
        )
    return values


def union_of(index: SubmodelIndex, table: str, clients: np.ndarray) -> np.ndarray:
    """The sorted union of the clients' S(k) of ``table`` (global ids)."""
    taken = index.rows[table].take(np.asarray(clients, dtype=np.int64))
    return np.unique(taken.values)


def gathered_members(update: CohortUpdate) -> CohortUpdate:
    """A CPU copy of ``update`` without its table rows: what every process gathers."""
    return CohortUpdate(
        clients=update.clients.cpu(),
        weights=update.weights.cpu(),
        multiplicity=update.multiplicity.cpu(),
        rows={},
        row_owner={},
        table_deltas={},
        dense_deltas={n: v.to("cpu", copy=True) for n, v in update.dense_deltas.items()},
    )


def members_bytes(update: CohortUpdate) -> int:
    tensors = [update.clients, update.weights, update.multiplicity, *update.dense_deltas.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class ShardedTables:
    """The run's row-sharded tables: this process's place, each table's partition and its
    rows' heat coefficients; stages each round's rows and combines its update."""

    processes: Processes
    partitions: dict[str, RowPartition]
    coefficients: dict[str, torch.Tensor] | None = None
    traffic: Traffic = field(default_factory=Traffic)
    union: RowUnion = field(default_factory=RowUnion)

    @staticmethod
    def of(params: ShardParams, coefficients: dict[str, torch.Tensor] | None) -> ShardedTables:
        """The tables of ``params``, with the per-row ``coefficients`` (FedSubAvg's heat
        correction; None for FedAvg) of this process's rows: as given when they are its rows'
        (an algorithm built on ``AlgorithmContext.sharded``), else cut from the whole
        table's."""
        processes = Processes(params.rank, next(iter(params.partitions.values())).world_size)
        if coefficients is not None:
            coefficients = {
                t: own_rows(coefficients[t], p, params.rank) for t, p in params.partitions.items()
            }
        return ShardedTables(processes, dict(params.partitions), coefficients)

    def log_traffic(self, round_index: int) -> None:
        """Log (DEBUG) the bytes this process sent in round ``round_index``."""
        t = self.traffic
        LOG.debug(
            "round %d: %s sent %d bytes (fetch %d, route %d, gather %d) for %d rows",
            round_index, self.processes, t.total, t.fetch, t.route, t.gather, t.rows,
        )  # fmt: skip

    def fetch(self, params: Params, table: str, rows: torch.Tensor, what: str) -> torch.Tensor:
        """The values of ``rows`` (sorted global ids) of ``table``, from their owners. A
        collective: every process calls it, each with the rows it needs."""
        partition, rank = self.partitions[table], self.processes.rank
        owners = partition.owners(rows)
        counts = torch.bincount(owners, minlength=self.processes.world_size).tolist()
        route = Route.of(counts, what)
        asked = route.send(rows, what)
        values = params.tables[table].index_select(0, partition.local(asked, rank))
        self.traffic.fetch += sent_bytes(rows, counts, rank) + sent_bytes(values, route.back, rank)
        return route.reply(values, what)

    def stage(self, params: Params, index: SubmodelIndex, clients: np.ndarray, r: int) -> Params:
        """The rows the ``clients``' S(k) hold, fetched, and the dense parameters."""
        tables, rows = {}, {}
        for table, values in params.tables.items():
            union = torch.from_numpy(union_of(index, table, clients)).to(values.device)
            tables[table] = self.fetch(params, table, union, f"fetching round {r}'s rows")
            rows[table] = union
            self.traffic.rows += len(union)
        return FetchedRows(tables, dict(params.dense), rows)

    def run(self, run_cohort: RunCohort) -> RunCohort:
        """``run_cohort`` on this process's share of the members, pulling fetched rows; a
        process without members returns an empty update (it still fetches and routes)."""

        def run_share(job: Any) -> CohortUpdate:  # a CohortJob (engine/cohort_job.py)
            self.traffic.reset()
            members = list(self.processes.share(len(job.cohort)))
            mine = Cohort(job.cohort.clients[members], job.cohort.multiplicity[members])
            staged = self.stage(job.params, job.index, mine.clients, job.round)
            if not members:
                return empty_update(job.params)
            share = replace(job, params=staged, cohort=mine, work=job.work.select(members))
            return run_cohort(share)

        return run_share

    def combine(self, aggregation: Aggregation) -> Callable[[CohortUpdate], ServerUpdate]:
        """The server update of this process's rows (local positions) and the whole dense
        aggregate, from this process's members' ``part`` (a collective)."""
        rowless = Aggregation(
            aggregation.weighting,
            population_weight=aggregation.population_weight,
            num_clients=aggregation.num_clients,
        )

        def combined(part: CohortUpdate) -> ServerUpdate:
            mine = gathered_members(part)
            parts = distributed.all_gather(mine, "gathering the members' dense updates")
            self.traffic.gather += members_bytes(mine) * (self.processes.world_size - 1)
            before = sum(len(p) for p in parts[: self.processes.rank])
            device = part.clients.device
            whole = concatenated_members(parts, device)
            dense = weighted_sum(whole, rowless).dense
            weights = aggregation_weights(whole, rowless).to(device)
            tables = {t: self.owned_sum(part, t, weights, before) for t in self.partitions}
            if self.coefficients is not None:
                tables = with_coefficients(tables, self.coefficients)
            return ServerUpdate(tables, dense)

        return combined

    def owned_sum(
        self, part: CohortUpdate, table: str, weights: torch.Tensor, before: int
    ) -> RowUpdate:
        """Route ``a_k delta_k[m]`` of this process's members to row m's owner; return the
        sums of the rows this process owns (local positions, sorted)."""
        partition, rank, world = self.partitions[table], self.processes.rank, self.processes
        rows, deltas = part.rows[table], part.table_deltas[table]
        row_weight = weights.to(deltas.dtype).index_select(0, part.row_owner[table] + before)
        terms = deltas * row_weight.unsqueeze(1)
        owners = partition.owners(rows)
        order = torch.argsort(owners, stable=True)  # blocks by owner, member order inside
        counts = torch.bincount(owners, minlength=world.world_size).tolist()
        what = f"routing the row updates of table {table!r} to their owners"
        route = Route.of(counts, what)
        got_rows = route.send(rows.index_select(0, order), what)
        got_terms = route.send(terms.index_select(0, order), what)
        self.traffic.route += sent_bytes(rows, counts, rank) + sent_bytes(terms, counts, rank)
        unique, inverse = self.union(partition.local(got_rows, rank))
        unique, inverse = unique.to(got_terms.device), inverse.to(got_terms.device)
        summed = got_terms.new_zeros((len(unique), got_terms.shape[1]))
        segment_sum.index_add_(summed, inverse, got_terms)
        return RowUpdate(unique, summed)


def concatenated_members(parts: list[CohortUpdate], device: torch.device) -> CohortUpdate:
    """The members of every process's part, in rank order (member order), without rows, on
    ``device`` (where one process would combine them)."""

    def cat(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors).to(device)

    return CohortUpdate(
        clients=cat([p.clients for p in parts]),
        weights=cat([p.weights for p in parts]),
        multiplicity=cat([p.multiplicity for p in parts]),
        rows={},
        row_owner={},
        table_deltas={},
        dense_deltas={n: cat([p.dense_deltas[n] for p in parts]) for n in parts[0].dense_deltas},
    )


def agree(flags: list[bool]) -> list[bool]:
    """Each flag true when it holds in any process (one all-reduce): the checks of a round
    every process must decide alike."""
    import torch.distributed as dist

    from fedsub.sharding.exchange import group_device

    value = torch.tensor([int(f) for f in flags], device=group_device())
    with distributed.collective("agreeing on the round's checks"):
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return [bool(v) for v in value.tolist()]


def all_rejected(rejected: list[Member]) -> list[Member]:
    """Every process's rejected members (``engine/guards.py``'s rejections), in member order
    (one gather): the processes train contiguous shares of the cohort in rank order, each
    screening its own."""
    parts = distributed.all_gather(rejected, "gathering the rejected members")
    return [rejection for part in parts for rejection in part]
