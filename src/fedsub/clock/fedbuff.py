"""FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
AISTATS 2022) on the virtual clock, for FedAvg and FedSubAvg.

**Clients.** C clients train at any time (``clock.concurrency``). When one finishes (or drops
out: its trace takes it offline before it finishes) its slot is given to a client drawn
uniformly among those online, idle, and not yet started on the current model version (keyed
by train.seed and the draw's number: no state to keep). A client trains on the model version
it pulled; its time follows clock/timing.py.

**Server (the paper's Algorithm 1).** Every B finished updates (``clock.buffer_size``, the
paper's K) the server steps: with staleness tau_i = (the version now) - (the version client i
pulled) and s(tau) = (1 + tau)^-a (the paper's 1 / sqrt(1 + tau): a = 1/2),

    Delta = sum_i u_i s(tau_i) Delta_i,        x <- server_step(x, Delta)

with u_i = 1 / B under the uniform weighting: the paper's ``Delta_bar / K``. fedsub's sample
weighting (``samples``) replaces 1 / B by n_i / sum_buffer n (the substitution fedsub's
FedAvg makes in a synchronous round). The server step is the algorithm's server optimizer
(server SGD with lr 1 for FedAvg: x + Delta, the paper's eta_g = 1).

**FedSubAvg under FedBuff: the staleness-aware heat (fedsub's own rule).** Synchronous
FedSubAvg scales row m's aggregate by coef_m (N / n_m, or sum w / sum_{k: m in S(k)} w), so
that in expectation the row moves by the mean update of the clients holding it. Under FedBuff
the factor s(tau_i) discounts stale updates; applied row by row, a row whose holders are slow
(stale) would move systematically less than a row of fast clients. fedsub keeps s's overall
discount but spreads it evenly over the rows: with H_m the buffer's updates holding row m,

    Delta[m] = c_m sum_{i in H_m} u_i s_i Delta_i[m],
    c_m = coef_m * s_bar * (sum_{i in H_m} u_i) / (sum_{i in H_m} u_i s_i),
    s_bar = (sum_i u_i s_i) / (sum_i u_i)            (over the whole buffer),

i.e. coef_m * s_bar * U_m * (the s-weighted mean of the holders' Delta_i[m]), U_m the holders'
weight. Derivation: with every tau equal (s_i = s), c_m = coef_m and Delta[m] = coef_m s
sum u_i Delta_i[m], FedBuff's step on FedSubAvg's aggregate; with tau = 0, synchronous
FedSubAvg over the buffer; within a row, fresher holders weigh more (s_i / sum s); across rows,
each row's discount is the buffer's mean s_bar, not its holders' own. Dense parameters:
sum_i u_i s_i Delta_i (coefficient 1).

**Batching.** Every client that pulled version v is known when the server makes version v + 1
(later starts pull v + 1), so at each step the clients that pulled the current version run as
one batched cohort on it (their updates kept until they finish): the batched engine groups the
clients that start from the same version, and no model copy is kept. A client's shuffle is
keyed by (version + 1, client), like a synchronous round's.

**Resume.** The clock's state (time, clients in flight, their kept updates, the draw counter)
is the ``clock`` checkpoint stage; a resumed run continues bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedsub.algorithms.aggregation import (
    Aggregation,
    RowUpdate,
    ServerUpdate,
    aggregation_weights,
)
from fedsub.algorithms.sampling import Cohort
from fedsub.client.work import round_work
from fedsub.clock.profiles import CLOCK, INF, Profiles, Trace
from fedsub.clock.settings import Buffered
from fedsub.clock.synchronous import VIRTUAL_TIME, first_online
from fedsub.clock.timing import work_seconds
from fedsub.engine.round_runtime import RoundRuntime
from fedsub.engine.server_round import RoundPlan, ServerRound
from fedsub.numerics import seeding, segment_sum
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import CohortUpdate

CLIENT_DRAW = 7  # the clock's stream of FedBuff's client draws (seeding purpose CLOCK)
TASK_COLUMNS = 6  # id, client, version, start, event time, finished (1) or dropped (0)


@dataclass
class BufferedUpdate(CohortUpdate):
    """A buffer's updates with each one's staleness (``staleness``, int64 per member)."""

    staleness: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    def select(self, members: list[int]) -> BufferedUpdate:
        chosen = super().select(members)
        index = torch.tensor(members, dtype=torch.int64)
        return BufferedUpdate(**vars(chosen), staleness=self.staleness[index])


def staleness_weight(tau: torch.Tensor, exponent: float) -> torch.Tensor:
    """s(tau) = (1 + tau)^-exponent (float64)."""
    return (1.0 + tau.to(torch.float64)) ** (-exponent)


def draw_client(seed: int, draw: int, candidates: np.ndarray) -> int:
    """FedBuff's client draw number ``draw`` (0-based): one of ``candidates`` (the clients
    online, idle and not yet started on the current version), uniformly, keyed by ``seed``
    and the draw's number (no state to keep). The virtual clock's and Flower's asynchronous
    server (flower/fedbuff_server.py) draw by it."""
    rng = seeding.rng(seed, CLOCK, CLIENT_DRAW, draw)
    return int(candidates[rng.integers(len(candidates))])


def with_staleness(update: CohortUpdate, staleness: list[int]) -> BufferedUpdate:
    """A buffer's updates (``update``, in buffer order) with each one's staleness tau_i."""
    tau = torch.tensor(staleness, dtype=torch.int64)
    return BufferedUpdate(**vars(update), staleness=tau)


def fedbuff_combine(
    update: BufferedUpdate, aggregation: Aggregation, exponent: float
) -> ServerUpdate:
    """The server's step Delta of the module docstring (FedBuff; with heat coefficients,
    fedsub's staleness-aware heat)."""
    u = aggregation_weights(update, aggregation).to(torch.float64)
    u = u / u.sum()
    s = staleness_weight(update.staleness, exponent).to(u.device)
    a = u * s
    s_bar = a.sum() / u.sum()
    tables = {}
    for table, rows in update.rows.items():
        deltas = update.table_deltas[table]
        owner = update.row_owner[table]
        unique_rows, inverse = aggregation.union(rows)
        summed = deltas.new_zeros((len(unique_rows), deltas.shape[1]))
        entry_a = a.index_select(0, owner)
        segment_sum.index_add_(summed, inverse, deltas * entry_a.to(deltas.dtype).unsqueeze(1))
        if aggregation.coefficients is not None:
            held = torch.zeros(len(unique_rows), dtype=torch.float64, device=u.device)
            held_s = torch.zeros_like(held)
            held.index_add_(0, inverse, u.index_select(0, owner))
            held_s.index_add_(0, inverse, entry_a)
            coef = aggregation.coefficients[table].index_select(0, unique_rows.to(held.device))
            coef = coef.to(torch.float64)
            c = coef * s_bar * held / held_s
            summed = summed * c.to(summed.dtype).unsqueeze(1)
        tables[table] = RowUpdate(unique_rows, summed)
    dense = {}
    for name, stacked in update.dense_deltas.items():
        weights = a.to(stacked.dtype).reshape(-1, *([1] * (stacked.dim() - 1)))
        dense[name] = (weights * stacked).sum(0)
    return ServerUpdate(tables, dense)


def concatenated(parts: list[CohortUpdate]) -> CohortUpdate:
    """Several cohort updates as one (members in order)."""
    first = parts[0]
    owners: dict[str, list[torch.Tensor]] = {t: [] for t in first.rows}
    offset = 0
    for part in parts:
        for t in first.rows:
            owners[t].append(part.row_owner[t] + offset)
        offset += len(part)
    return CohortUpdate(
        clients=torch.cat([p.clients for p in parts]),
        weights=torch.cat([p.weights for p in parts]),
        multiplicity=torch.cat([p.multiplicity for p in parts]),
        rows={t: torch.cat([p.rows[t] for p in parts]) for t in first.rows},
        row_owner={t: torch.cat(owners[t]) for t in first.rows},
        table_deltas={t: torch.cat([p.table_deltas[t] for p in parts]) for t in first.rows},
        dense_deltas={n: torch.cat([p.dense_deltas[n] for p in parts]) for n in first.dense_deltas},
    )


@dataclass
class Task:
    """A client's work in flight or done: who, on which version, from when, and its event
    (finishing, or dropping out when its trace takes it offline first)."""

    id: int
    client: int
    version: int
    start: float
    event: float
    finishes: bool

    def row(self) -> list[float]:
        return [self.id, self.client, self.version, self.start, self.event, float(self.finishes)]

    @staticmethod
    def of_row(row: list[float]) -> Task:
        return Task(int(row[0]), int(row[1]), int(row[2]), row[3], row[4], bool(row[5]))


@dataclass
class BufferState:
    """What FedBuff's clock carries from one server step to the next (the ``clock`` stage)."""

    now: float = 0.0
    draws: int = 0  # client draws so far (each keyed by its number)
    flying: list[Task] = field(default_factory=list)
    pulled: set[int] = field(default_factory=set)  # clients started on the current version
    # per version, the batched cohort update of its clients, and its members' task ids
    kept: dict[int, tuple[CohortUpdate, list[int]]] = field(default_factory=dict)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {
            "now": torch.tensor([self.now], dtype=torch.float64),
            "draws": torch.tensor([self.draws], dtype=torch.int64),
            "flying": torch.tensor([t.row() for t in self.flying], dtype=torch.float64).reshape(
                -1, TASK_COLUMNS
            ),
            "pulled": torch.tensor(sorted(self.pulled), dtype=torch.int64),
        }
        for version, (update, ids) in self.kept.items():
            tensors[f"kept.{version}.ids"] = torch.tensor(ids, dtype=torch.int64)
            for name, value in _update_tensors(update).items():
                tensors[f"kept.{version}.{name}"] = value.cpu()
        return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if "now" not in tensors or "flying" not in tensors:
            raise ValueError("not a FedBuff clock stage: 'now' and 'flying' are missing")
        self.now = float(tensors["now"][0])
        self.draws = int(tensors["draws"][0])
        self.flying = [Task.of_row(r) for r in tensors["flying"].tolist()]
        self.pulled = set(tensors["pulled"].tolist())
        versions = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("kept.")})
        self.kept = {}
        for v in versions:
            prefix = f"kept.{v}."
            mine = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
            ids = mine.pop("ids").tolist()
            self.kept[v] = (_update_of(mine), ids)


def _update_tensors(update: CohortUpdate) -> dict[str, torch.Tensor]:
    out = {
        "clients": update.clients,
        "weights": update.weights,
        "multiplicity": update.multiplicity,
    }
    for t in update.rows:
        out[f"rows.{t}"] = update.rows[t]
        out[f"owner.{t}"] = update.row_owner[t]
        out[f"deltas.{t}"] = update.table_deltas[t]
    for n, v in update.dense_deltas.items():
        out[f"dense.{n}"] = v
    return out


def _update_of(tensors: dict[str, torch.Tensor]) -> CohortUpdate:
    def part(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}

    return CohortUpdate(
        clients=tensors["clients"],
        weights=tensors["weights"],
        multiplicity=tensors["multiplicity"],
        rows=part("rows."),
        row_owner=part("owner."),
        table_deltas=part("deltas."),
        dense_deltas=part("dense."),
    )


@dataclass
class FedBuffClock:
    """FedBuff as a ``RoundRuntime``: round r is the server's r-th step; ``run_cohort``
    advances the clock until B updates are in the buffer and returns them (a
    ``BufferedUpdate``), which ``fedbuff_combine`` (the ServerRound's combine) aggregates."""

    inner: RoundRuntime
    rounds: ServerRound
    profiles: Profiles
    trace: Trace
    exchanged: np.ndarray
    samples: float
    rules: Buffered
    state: BufferState = field(default_factory=BufferState)

    def available(self, round_index: int, rounds: ServerRound) -> np.ndarray | None:
        return None  # the plan's cohort is not used: the clock picks the clients

    def _draw(self, version: int) -> bool:
        """Start one client on ``version`` now; False when nobody can start."""
        state = self.state
        busy = {t.client for t in state.flying} | state.pulled
        free = self.trace.online(state.now)
        free[list(busy)] = False
        candidates = np.flatnonzero(free)
        if len(candidates) == 0:
            return False
        client = draw_client(self.rounds.schedule.seed, state.draws, candidates)
        state.draws += 1
        seconds = float(
            work_seconds(self.profiles, self.exchanged, self.samples, np.array([client]))[0]
        )
        finish = state.now + seconds
        offline = self.trace.online_until(client, state.now)
        task = Task(
            state.draws, client, version, state.now, min(finish, offline), finish <= offline
        )
        state.flying.append(task)
        state.pulled.add(client)
        return True

    def _fill(self, version: int) -> None:
        while len(self.state.flying) < self.rules.concurrency and self._draw(version):
            pass
        if not self.state.flying:  # nobody could start: wait for someone to come online
            self.state.now = first_online(self.trace, self.state.now)
            if not math.isfinite(self.state.now):
                raise RuntimeError("the availability trace has no client online ever again")
            self._fill(version)

    def run_cohort(self, plan: RoundPlan, params: Params) -> Any:
        version = plan.round - 1  # the model now is the server's version r - 1
        state = self.state
        buffer: list[Task] = []
        while len(buffer) < self.rules.buffer_size:
            self._fill(version)
            task = min(state.flying, key=lambda t: (t.event, t.id))
            state.flying.remove(task)
            state.now = task.event
            if task.finishes:
                buffer.append(task)
            else:
                self._forget(task)
        self._train_version(version, params, buffer)
        update = self._buffered(buffer, version)
        state.pulled = set()  # the next draws pull version r
        return update

    def _train_version(self, version: int, params: Params, buffer: list[Task]) -> None:
        """The clients that pulled ``version`` (still flying or in the buffer), trained as one
        batched cohort on it."""
        tasks = sorted(
            (t for t in [*self.state.flying, *buffer] if t.version == version),
            key=lambda t: t.client,
        )
        if not tasks:
            return
        clients = np.array([t.client for t in tasks], dtype=np.int64)
        cohort = Cohort(clients, np.ones(len(clients), dtype=np.int64))
        a, counts = self.rounds.algorithm, self.rounds.counts
        step = self.rounds.schedule.client_step
        work = round_work(
            a.client, step, a.lr, counts, clients, version + 1, a.scheme.scale_lr_by_pn
        )
        update = self.inner.run_cohort(RoundPlan(version + 1, cohort, work), params)
        if not isinstance(update, CohortUpdate):
            raise RuntimeError(f"FedBuff needs the cohort's row updates, got {type(update)}")
        self.state.kept[version] = (update, [t.id for t in tasks])

    def _forget(self, task: Task) -> None:
        """A dropped client's kept update, if trained already, is discarded."""
        entry = self.state.kept.get(task.version)
        if entry is not None and task.id in entry[1]:
            self._take(task)

    def _take(self, task: Task) -> CohortUpdate:
        update, ids = self.state.kept[task.version]
        position = ids.index(task.id)
        member = update.select([position])
        ids[position] = -1
        if all(i == -1 for i in ids):
            del self.state.kept[task.version]
        return member

    def _buffered(self, buffer: list[Task], version: int) -> BufferedUpdate:
        parts = [self._take(t) for t in buffer]
        return with_staleness(concatenated(parts), [version - t.version for t in buffer])

    def close_round(self, round_index: int, updated: bool, diverged: str | None) -> None:
        self.inner.close_round(round_index, updated, diverged)

    def evaluate(self, round_index: int, params: Params) -> dict[str, float] | None:
        metrics = self.inner.evaluate(round_index, params)
        if metrics is not None:
            metrics[VIRTUAL_TIME] = self.state.now
        return metrics

    def history(self) -> list[dict]:
        return self.inner.history()

    def restore_history(self, history: list[dict]) -> None:
        self.inner.restore_history(history)


__all__ = [
    "INF",
    "BufferedUpdate",
    "FedBuffClock",
    "draw_client",
    "fedbuff_combine",
    "staleness_weight",
    "with_staleness",
]
