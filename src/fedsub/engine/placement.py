"""``execution.table_placement``: where the global embedding tables live during a run.

``"device"`` (the default): every parameter and every piece of server state on
``execution.device``. ``"host"``: the tables, their per-row server state (a row-local server
optimizer's moments) and FedSubAvg's per-row heat coefficients stay in host memory; the dense
parameters and their state stay on the device. A round touches only the rows of its cohort,
so only those travel:

1. ``stage``: the union U of the cohort's S(k) per table (sorted, from the host index),
   ``X[U]`` gathered on the host and copied to the device (``non_blocking``), with U; the
   backends pull a client's rows from that slice (``StagedParams.gather_rows``: positions
   by ``searchsorted`` in U), so their kernels and numbers are those of device placement.
2. ``receive``: the aggregate (computed on the device, without coefficients) comes back to
   the host, rows and values; the heat coefficients multiply it there, and the server step
   runs on the host rows only.

A table of 1e9 rows then needs device memory for a cohort's O(sum |S(k)|) rows, not the
table. The server step must be row-local (``RowLocal``): an optimizer that moves every row
every round (full-model FedAdam / FedYogi / FedAdagrad, server momentum) or control variates
as large as the tables (SCAFFOLD) are refused, naming ``execution.table_placement``.
``TableTraffic`` counts the bytes each way, per round.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from fedsub.algorithms.aggregation import RowUpdate, ServerUpdate, with_coefficients
from fedsub.algorithms.registry import Algorithm
from fedsub.algorithms.sampling import Cohort
from fedsub.algorithms.server_optimizer import RowLocal, ServerOptimizer
from fedsub.engine.cohort_job import CohortJob, RunCohort
from fedsub.errors import ConfigError
from fedsub.profiling import timed
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params

HOST = torch.device("cpu")


@dataclass
class StagedParams(Params):
    """A round's slice of the global model on the device: ``tables[t]`` holds the rows
    ``rows[t]`` (sorted global ids, on the device) of table t; dense parameters whole."""

    rows: dict[str, torch.Tensor] = field(default_factory=dict)

    def gather_rows(self, table: str, rows: torch.Tensor) -> torch.Tensor:
        positions = torch.searchsorted(self.rows[table], rows)
        return self.tables[table].index_select(0, positions)


def place(params: Params, device: torch.device) -> Params:
    """The initial model (drawn on the host) with its tables left there, and its dense
    parameters on ``device``. The tables are not pinned: the rows that travel are gathered into
    fresh pinned buffers each round (``stage``), and pinning a whole table would copy it, twice
    its size in host memory at once (a 1e9 x 16 table: 128 GB)."""
    tables = {t: v.to(HOST) for t, v in params.tables.items()}
    return Params(tables, {n: v.to(device) for n, v in params.dense.items()})


def check_row_local(
    algorithm: Algorithm,
    server: ServerOptimizer,
    key: str = "execution.table_placement",
    values: tuple[str, str] = ("host", "device"),
) -> None:
    """Refuse (ConfigError naming ``key`` and its ``values``: the one set, the default) a
    server step that is not row-local, or control variates, which live beside every row of the
    tables: host placement and row sharding step only the rows of the round."""
    reasons = []
    if not (isinstance(server, RowLocal) and server.row_local):
        reasons.append(
            f"its server optimizer ({type(server).__name__}) updates every row every round "
            '(use its -lazy variant, or server = "sgd")'
        )
    if algorithm.control_variates:
        reasons.append("its control variates (SCAFFOLD) are as large as the tables")
    if reasons:
        chosen, default = values
        raise ConfigError(
            f'{key} = "{chosen}" cannot run algorithm {algorithm.name!r}: {"; ".join(reasons)}. '
            f'The server step must touch only the rows of the round; use {key} = "{default}"'
        )


def cohort_union(index: SubmodelIndex, table: str, clients: np.ndarray) -> np.ndarray:
    """The sorted union of the clients' S(k) of ``table`` (host ids)."""
    taken = index.rows[table].take(np.asarray(clients, dtype=np.int64))
    return np.unique(taken.values)


@dataclass
class TableTraffic:
    """Bytes of table rows moved in the last round: to the device (the union's rows) and
    back (the aggregate's rows and values)."""

    to_device: int = 0
    to_host: int = 0
    rows: dict[str, int] = field(default_factory=dict)  # union sizes, per table


@dataclass
class HostTables:
    """A run's host-placed tables: stages each round's rows and receives its aggregate."""

    device: torch.device
    coefficients: dict[str, torch.Tensor] | None = None  # per-row, on the host
    traffic: TableTraffic = field(default_factory=TableTraffic)

    @staticmethod
    def of(algorithm: Algorithm, device: torch.device) -> HostTables:
        coefficients = algorithm.aggregation.coefficients
        if coefficients is not None:
            coefficients = {t: c.to(HOST) for t, c in coefficients.items()}
        return HostTables(device, coefficients)

    def stage(self, params: Params, index: SubmodelIndex, cohort: Cohort) -> StagedParams:
        """The cohort's rows of every table and the dense parameters, on the device."""
        pinned = self.device.type == "cuda"
        tables, rows, sizes, moved = {}, {}, {}, 0
        for table, values in params.tables.items():
            union = torch.from_numpy(cohort_union(index, table, cohort.clients))
            gathered = values.index_select(0, union)
            if pinned:
                union, gathered = union.pin_memory(), gathered.pin_memory()
            tables[table] = gathered.to(self.device, non_blocking=True)
            rows[table] = union.to(self.device, non_blocking=True)
            sizes[table] = len(union)
            moved += gathered.numel() * gathered.element_size()
        self.traffic = TableTraffic(to_device=moved, rows=sizes)
        return StagedParams(tables, dict(params.dense), rows)

    def wrap(self, run_cohort: RunCohort) -> RunCohort:
        """``run_cohort`` on the cohort's rows staged on the device (``stage``)."""

        def run(job: CohortJob):
            with timed("pull"):
                staged = self.stage(job.params, job.index, job.cohort)
            return run_cohort(dataclasses.replace(job, params=staged))

        return run

    def receive(self, update: ServerUpdate) -> ServerUpdate:
        """The aggregate's table rows on the host, times the heat coefficients there."""
        tables = {
            t: RowUpdate(u.rows.to(HOST), u.values.to(HOST)) for t, u in update.tables.items()
        }
        values = [u.values for u in tables.values()]
        self.traffic.to_host = sum(v.numel() * v.element_size() for v in values)
        if self.coefficients is not None:
            tables = with_coefficients(tables, self.coefficients)
        return dataclasses.replace(update, tables=tables)
