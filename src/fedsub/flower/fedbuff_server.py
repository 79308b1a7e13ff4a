"""FedBuff over real Flower nodes (issue 51): ``[clock] mode = "fedbuff"`` on Flower.

The same asynchronous server as the virtual clock's (clock/fedbuff.py), with time and
availability the nodes' own: Flower's Message API lets the ServerApp push a node its train
message and pull the replies as they come, so the server never waits for a round.

- **Round r is the server's r-th step** (``train.rounds`` counts steps; the engine's loop,
  engine/loop.py, drives them, with its checkpoints, evaluation and stops); the model after
  r - 1 steps is version r - 1.
- **Clients.** The server keeps ``clock.concurrency`` (C) nodes training. A free slot goes to
  a client drawn by ``clock/fedbuff.draw_client`` (the clock's rule and key) among those whose
  node is online and answering (the registered membership, flower/joining.py), not training,
  and not yet sent the current version; it is sent the current model (its submodel, or the
  whole model with ``payload = "full"``) as round ``version + 1``'s train message (its
  learning rate and shuffle those of round ``version + 1``, as in process).
- **Replies** are read one at a time, in the order they are pulled. Each is checked as a
  synchronous round's (flower/train_round.py's ``ReplyReader``); a failed node is left out
  until it answers again (``Joining.leave_out``). While the buffer is short of
  ``clock.buffer_size`` (B) updates, each reply's slot is refilled at once on the current
  version.
- **The step.** With B updates buffered, each with its staleness tau = (the version now) -
  (the version it was sent), the server applies ``clock/fedbuff.fedbuff_combine`` (FedBuff's
  s(tau) = (1 + tau)^-a, and fedsub's staleness-aware heat for heat-corrected algorithms)
  through the algorithm's server optimizer: the combine ``clock/hooks.buffered_rounds``
  installs for the virtual clock too, with its refusals. No formula is repeated here.
- **Timeouts.** A step that gets no reply for ``round-timeout`` seconds fails (the model
  unchanged; the updates buffered so far wait for the next step); ``max-failed-rounds`` such
  steps in a row stop the run, as failed rounds do.
- **Resume.** A checkpoint (written after a step, as any round's) keeps the model, the
  server optimizer and the number of client draws; the updates in flight then were sent by
  the ServerApp that stopped and are not waited for: a resumed run sends the checkpoint's
  model to C nodes afresh (real time cannot be replayed; what it continues exactly is the
  model and the draws' sequence).

What combines with it: ``clock/settings.config_refusals`` and ``buffered_rounds`` (no [dp],
privacy levels, masking, SCAFFOLD, Scheme II, ``train.max_update_norm``); on Flower also no
private heat source or private download (a node's rows would be asked per step), and none of
the virtual clock's time model (``clock/settings.real_time_refusals``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import Message

from fedsub.algorithms.sampling import Cohort
from fedsub.client.work import round_work
from fedsub.clock.fedbuff import BufferedUpdate, draw_client, with_staleness
from fedsub.clock.hooks import buffered_rounds
from fedsub.clock.settings import Buffered, ClockConfig
from fedsub.engine.loop import RunControl
from fedsub.engine.round_runtime import RoundFailed
from fedsub.engine.server_round import RoundPlan, ServerRound
from fedsub.errors import FedsubError
from fedsub.flower.exchange import FIRST_POLL, GROWTH, MAX_POLL, attributed
from fedsub.flower.server_runtime import FlowerRuntime
from fedsub.flower.train_round import train_messages
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import ClientUpdate, CohortUpdate

LOG = logging.getLogger("fedsub")


@dataclass(frozen=True)
class Flight:
    """A train message in flight: to whom (cohort position, node), of which version."""

    client: int
    node: int
    version: int


@dataclass(frozen=True)
class InBuffer:
    """An update in the buffer, the version its client was sent, and its node."""

    update: ClientUpdate
    version: int
    node: int


@dataclass
class Draws:
    """The number of client draws so far (the ``clock`` checkpoint stage on Flower)."""

    count: int = 0

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"draws": torch.tensor([self.count], dtype=torch.int64)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if set(tensors) != {"draws"}:
            raise ValueError(f"the Flower FedBuff stage holds 'draws', got {sorted(tensors)}")
        self.count = int(tensors["draws"][0])


@dataclass
class StepLog:
    """What one step did, for its record: messages sent (partitions) and their bytes, replies
    read and their bytes, partitions left out."""

    sent: list[int] = field(default_factory=list)
    sent_bytes: int = 0
    received_bytes: int = 0
    left_out: list[int] = field(default_factory=list)


class FlowerFedBuff:
    """FedBuff's asynchronous server as a ``RoundRuntime`` over a ``FlowerRuntime`` (its
    membership, reply reading, evaluation and records), module docstring."""

    def __init__(self, inner: FlowerRuntime, rules: Buffered) -> None:
        self.inner, self.rules = inner, rules
        self.draws = Draws()
        self.flying: dict[str, Flight] = {}  # by message id
        self.pulled: set[int] = set()  # clients sent the current version
        self.buffer: list[InBuffer] = []
        self.arrived: list[tuple[Message, Flight]] = []  # pulled, not read yet (in order)
        self.available_now = np.zeros(0, dtype=np.int64)
        self.log = StepLog()
        self.server: ServerRound | None = None

    # --- the run ---------------------------------------------------------------------------
    def open(self, control: RunControl) -> ServerRound:
        """The FlowerRuntime's server round, made FedBuff's (refused with the reason where
        FedBuff's step does not apply)."""
        rounds = self.inner.open(control)
        name = f'clock.mode = "fedbuff" on Flower with algorithm {self.inner.served.name!r}'
        if self.inner.asks_rows:
            raise FedsubError(
                f"{name}: a private heat source or private download asks each round's nodes "
                "for their rows; FedBuff sends nodes work one by one (use exact heat)"
            )
        buffered_rounds(rounds, self.rules, name, self.draws)
        self.server = rounds
        return rounds

    def available(self, round_index: int, rounds: ServerRound) -> np.ndarray | None:
        """The nodes online and answering (registrations read); the loop's cohort is not
        used: the server draws each client as a slot frees."""
        self.available_now = self.inner.available(round_index, rounds)
        return None

    def run_cohort(self, plan: RoundPlan, params: Params) -> BufferedUpdate | RoundFailed:
        """Step ``plan.round``: fill the slots, read replies until B updates are buffered
        (a failure after ``round-timeout`` seconds without a reply), the buffer with each
        update's staleness."""
        version = plan.round - 1
        self.log = StepLog()
        while len(self.buffer) < self.rules.buffer_size:
            self._fill(version, params)
            reply = self._next_reply()
            if reply is None:
                return self._short(plan.round)
            self._read(*reply, params)
        taken = self.buffer[: self.rules.buffer_size]
        self.buffer = self.buffer[self.rules.buffer_size :]
        self.pulled = set()  # the next sends are of version r
        self._record(plan.round, taken, version)
        update = CohortUpdate.from_clients([b.update for b in taken])
        return with_staleness(update, [version - b.version for b in taken])

    # --- sending ----------------------------------------------------------------------------
    def _candidates(self) -> np.ndarray:
        """Clients that can be sent work now (sorted positions): online and answering at the
        step's start, not left out since, not training, not sent this version."""
        membership = self.inner.membership
        busy = {f.client for f in self.flying.values()} | self.pulled
        return np.array(
            [
                j
                for j in self.available_now.tolist()
                if j not in busy
                and membership.node_of(membership.counted[j]) not in membership.dropped
            ],
            dtype=np.int64,
        )

    def _fill(self, version: int, params: Params) -> None:
        """Send the current model to drawn clients until C are training (or nobody is left)."""
        candidates = self._candidates().tolist()
        chosen: list[int] = []
        assert self.server is not None
        seed = self.server.schedule.seed
        while len(self.flying) + len(chosen) < self.rules.concurrency and candidates:
            client = draw_client(seed, self.draws.count, np.array(candidates, dtype=np.int64))
            self.draws.count += 1
            candidates.remove(client)
            chosen.append(client)
            self.pulled.add(client)
        if chosen:
            self._send(version, params, chosen)

    def _send(self, version: int, params: Params, clients: list[int]) -> None:
        """Round ``version + 1``'s train messages to ``clients`` (in draw order), pushed."""
        rounds, inner = self.server, self.inner
        assert rounds is not None
        membership = inner.membership
        cohort = Cohort(np.array(clients, dtype=np.int64), np.ones(len(clients), dtype=np.int64))
        a, step = rounds.algorithm, rounds.schedule.client_step
        scale = a.scheme.scale_lr_by_pn
        work = round_work(a.client, step, a.lr, rounds.counts, cohort.clients, version + 1, scale)
        node_of = {j: membership.node_of(membership.counted[j]) for j in clients}
        sent_to = {node_of[j]: j for j in clients}
        plan = RoundPlan(version + 1, cohort, work)
        messages, sent = train_messages(
            plan, params, sent_to, inner._rows_of, inner.settings.payload
        )
        self.log.sent_bytes += sent
        ids = list(inner.grid.push_messages(messages))
        for message, message_id in zip(messages, ids, strict=False):
            node = message.metadata.dst_node_id
            client = sent_to[node]
            self.log.sent.append(membership.counted[client])
            if message_id is None:  # the SuperLink refused it: the node is left out
                self._leave_out(node, client, "its train message was refused")
                continue
            self.flying[message_id] = Flight(client, node, version)

    # --- receiving --------------------------------------------------------------------------
    def _next_reply(self) -> tuple[Message, Flight] | None:
        """The next reply (pulled earlier, or now), waiting up to round-timeout; None when
        nothing is in flight or nothing came in time."""
        if self.arrived:
            return self.arrived.pop(0)
        if not self.flying:
            return None
        timeout, grid = self.inner.timeout, self.inner.grid
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = FIRST_POLL
        while self.flying:
            for reply in grid.pull_messages(sorted(self.flying)):
                asked = reply.metadata.reply_to_message_id
                flight = self.flying.pop(asked, None)
                if flight is not None:
                    self.arrived.append((attributed(reply, flight.node), flight))
            if self.arrived:
                return self.arrived.pop(0)
            given_up = set(self.inner.joining.ask_newcomers(grid))
            for message_id, flight in list(self.flying.items()):
                if flight.node in given_up:  # a newcomer took its partition over
                    del self.flying[message_id]
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * GROWTH, MAX_POLL)
        return None

    def _read(self, reply: Message, flight: Flight, params: Params) -> None:
        """Buffer ``reply``'s update, or leave its node out (an error, an unreadable reply)."""
        inner, node, client = self.inner, flight.node, flight.client
        membership = inner.membership
        if reply.has_error():
            self._leave_out(node, client, f"failed: {reply.error.reason}")
            return
        if inner.observers.transcript is not None:
            inner.observers.transcript(node, "train", reply.content)
        partition = membership.counted[client]
        examples = membership.registered[partition].examples
        try:
            update, size = inner.reader.update(
                reply, client, partition, params, examples, flight.version + 1
            )
        except FedsubError as error:  # left out, like a node that failed
            self._leave_out(node, client, str(error))
            return
        self.log.received_bytes += size
        self.buffer.append(InBuffer(update, flight.version, node))

    def _leave_out(self, node: int, client: int, why: str) -> None:
        partition = self.inner.membership.counted[client]
        LOG.warning("fedbuff: node %d (partition %d): %s; left out", node, partition, why)
        self.log.left_out.append(partition)
        self.inner.joining.leave_out(node)

    # --- records ----------------------------------------------------------------------------
    def _base_record(self, r: int, clients: list[int], nodes: list[int]) -> dict:
        return {
            "round": r,
            "available": len(self.available_now),
            "sampled": len(self.log.sent),
            "sent_to": self.log.sent,
            "clients": clients,
            "nodes": nodes,
            "replies": len(clients),
            "left_out": self.log.left_out,
            "in_flight": len(self.flying),
            "train_arrays_bytes_sent": self.log.sent_bytes,
            "train_arrays_bytes_received": self.log.received_bytes,
            "updated": False,
        }

    def _record(self, r: int, taken: list[InBuffer], version: int) -> None:
        counted = self.inner.membership.counted
        record = self._base_record(
            r, [counted[b.update.client] for b in taken], [b.node for b in taken]
        )
        record["staleness"] = [version - b.version for b in taken]
        self.inner.records.judge(record)

    def _short(self, r: int) -> RoundFailed:
        """No reply within round-timeout (or nothing could be sent): the step fails."""
        counted = self.inner.membership.counted
        record = self._base_record(r, [], [])
        record["buffered"] = [counted[b.update.client] for b in self.buffer]
        records = self.inner.records
        records.current = record
        records.failed_in_a_row += 1
        waited = "nothing in flight" if not self.flying else "no reply within round-timeout"
        reason = (
            f"{len(self.buffer)} of B = {self.rules.buffer_size} updates buffered, {waited} "
            f"({len(self.available_now)} client(s) available); {records.failed_in_a_row} "
            f"such step(s) in a row, max-failed-rounds = {records.max_failed_rounds}"
        )
        LOG.warning("round %d: %s: model unchanged", r, reason)
        record["failed"] = reason
        return RoundFailed(reason)

    # --- the rest is the FlowerRuntime's ---------------------------------------------------
    def close_round(self, round_index: int, updated: bool, diverged: str | None) -> None:
        self.inner.close_round(round_index, updated, diverged)

    def evaluate(self, round_index: int, params: Params) -> dict[str, float] | None:
        return self.inner.evaluate(round_index, params)

    def history(self) -> list[dict]:
        return self.inner.history()

    def restore_history(self, history: list[dict]) -> None:
        self.inner.restore_history(history)


def asynchronous(runtime: FlowerRuntime, clock: ClockConfig) -> FlowerRuntime | FlowerFedBuff:
    """``runtime`` as the ServerApp drives it: FedBuff's asynchronous server with
    ``clock.mode = "fedbuff"``, else ``runtime`` itself."""
    return FlowerFedBuff(runtime, clock.buffered) if clock.mode == "fedbuff" else runtime


__all__ = ["FlowerFedBuff", "asynchronous"]
