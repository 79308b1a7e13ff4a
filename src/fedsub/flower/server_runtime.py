"""Flower as a runtime of the engine's round loop (engine/round_runtime.py): the ServerApp runs
``engine.loop.drive``, the loop the in-process engine runs, and this runtime does each round's
work over Flower Messages through the ``Grid`` (registration, training, private heat and sums,
federated evaluation), so a Flower run checkpoints, resumes, screens updates and evaluates as
an in-process run does. Its pieces: docs/develop/architecture.md, "The Flower runtime".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from logging import INFO
from typing import Any

import numpy as np
import torch
from flwr.app import Message, RecordDict
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid

from fedsub.algorithms.aggregation import ServerUpdate
from fedsub.algorithms.registry import Algorithm, AlgorithmContext, MeasuredHeat, build_algorithm
from fedsub.data.federated import ClientSizes, Population
from fedsub.engine.features.assembly import Assembly, build_server_round
from fedsub.engine.features.dp import DpRound, dp_round_of, dp_settings, flower_result
from fedsub.engine.features.private import (
    SecureSum,
    ServerHeat,
    download_combine,
    downloads_privately,
    privacy_described,
    secure_rows_of,
    server_heat,
    sums_securely,
)
from fedsub.engine.guards import Rejection
from fedsub.engine.loop import RunControl
from fedsub.engine.membership import Membership, PositionNodes, Registration
from fedsub.engine.round_records import RoundRecords, round_line
from fedsub.engine.round_runtime import RoundFailed
from fedsub.engine.schedule import Schedule
from fedsub.engine.server_round import RoundPlan, ServerRound
from fedsub.errors import FedsubError
from fedsub.feature_messages import Fields
from fedsub.flower.costs import MeteredGrid
from fedsub.flower.exchange import exchange
from fedsub.flower.federated_eval import FederatedEvaluation
from fedsub.flower.joining import Joining
from fedsub.flower.protocols import Transcript, asker, ride, riding
from fedsub.flower.row_queries import SampledRows
from fedsub.flower.settings import FlowerSettings
from fedsub.flower.train_round import ReplyReader, train_messages
from fedsub.stateful import Stateful
from fedsub.submodel.heat import HeatKind
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import ClientUpdate, CohortUpdate

LOG = logging.getLogger("fedsub")
PRIVATE_HEAT = "private_heat"  # the checkpoint stage of a private heat source's measurement
POPULATION = "population"  # the checkpoint stage of the registered clients


@dataclass(frozen=True)
class Served:
    """The algorithm the run serves: its name, the config's options, the heat definition."""

    name: str
    options: object
    heat: HeatKind


@dataclass(frozen=True)
class Observers:
    """Who sees what the run does: progress lines (``progress.jsonl``), every reply of the
    queries, the heat exchange, the secure row sums and the training (the transcript), the
    costs."""

    on_progress: Callable[[dict], None] | None = None
    transcript: Transcript | None = None
    meter: MeteredGrid | None = None


class FlowerRuntime:
    """The Flower federation as a ``RoundRuntime``: membership, train and evaluation
    Messages, the private heat and row protocols, one record per round."""

    def __init__(
        self,
        grid: Grid,
        params: Params,
        served: Served,
        schedule: Schedule,
        settings: FlowerSettings,
        heat: ServerHeat | None = None,
        query: dict[str, int | str] | None = None,
        observers: Observers | None = None,
        server_test: Callable[[Params], dict[str, float]] | None = None,
        partitions: int = 0,
    ) -> None:
        self.grid, self.params, self.served = grid, params, served
        # the loop evaluates every eval-every rounds (0: none, the last round asks, gets none)
        self.schedule = replace(schedule, eval_every=settings.eval_every or schedule.rounds)
        self.settings = settings
        # where the heat comes from: the registrations, or a private exchange (then no S(k))
        self.heat = heat or server_heat()
        self.privacy, self.private = self.heat.privacy, self.heat.private
        self.query = dict(query or {})  # every message carries it: the run's feature spec
        self.evaluation = FederatedEvaluation()
        self.observers = observers or Observers()
        self.server_test = server_test
        replies = settings.replies
        self.timeout = replies.round_timeout  # every wave of Messages waits as long
        self.records = RoundRecords(replies.min_replies, replies.max_failed_rounds)
        self.membership = Membership({t: v.shape[0] for t, v in params.tables.items()})
        query = {"what": "partition" if self.private else "index", **self.query}
        self.joining = Joining(
            self.membership,
            query,
            settings.nodes.min_nodes,
            settings.nodes.node_wait,
            self._registered,
            self.observers.transcript,
        )
        # the partitions the run expects (0: min-nodes of them): a registration naming
        # another is refused, and round 1's wait names those missing
        self.joining.partitions = partitions
        downloading = downloads_privately(schedule)
        # a round asks its sampled nodes for their rows: a private heat source (no S(k)
        # registered), or a private download (their requests; exact heat under [dp] at levels
        # download and full registers S(k) all the same, run_setup.heat_privacy_of)
        self.asks_rows = self.private or downloading
        self.sampled = SampledRows(self.membership, downloading, self.query, self.timeout)
        # exact heat: the counted clients' S(k), from their registrations (private: none)
        self.index = SubmodelIndex({}, {})
        # privacy full: a node's sample count stays inside the secure row sum
        self.counts_secret = sums_securely(schedule)
        self.reader = ReplyReader(self._rows_of, downloading, settings.payload, self.counts_secret)
        self._available = 0  # clients that could be sampled this round
        self.dp: DpRound | None = None  # [dp]'s pieces (its ledger), once the round is open
        self.central_dp = False  # [dp]'s central mechanism combines the rounds
        self._online: set[int] | None = None  # [dp]: this round's reachable clients
        self.secure: SecureSum | None = None  # privacy full: the round's secure row sum

    # --- the population ----------------------------------------------------------------
    def open(self, control: RunControl) -> ServerRound:
        """The run's server round over the registered population (a resumed run's from its
        checkpoint: no node is asked before round 1's registration)."""
        saved = control.resume
        if saved is None:
            self.joining.update(self.grid)
            self.membership.refresh()
        else:
            self.membership.load_state_tensors(saved.stages[POPULATION])
            if self.private:
                if PRIVATE_HEAT not in saved.stages:
                    raise FedsubError(
                        f"{saved.path}: no private heat saved (written before private runs "
                        "could resume); start the run again"
                    )
                self.heat.load_state_tensors(saved.stages[PRIVATE_HEAT])
        algorithm, sizes = self._algorithm()
        combine = self._combine(algorithm)
        stages: dict[str, Stateful] = {POPULATION: self.membership}
        if self.private:
            stages[PRIVATE_HEAT] = self.heat
        screening = Assembly(control.max_update_norm, self._log_rejection)
        rounds = build_server_round(
            algorithm, sizes, self.index, self.schedule, self.params, combine, screening,
            stages=stages,
        )  # fmt: skip
        self.dp = dp = dp_round_of(rounds.features)
        self.central_dp = dp is not None and dp.mechanism is not None
        self._check_accounted_population()
        return rounds

    def available(self, round_index: int, rounds: ServerRound) -> np.ndarray:
        """The clients whose node is online and answering, after this round's registrations
        (and a refresh of the coefficients when due: exact heat, no [dp])."""
        self.joining.round = round_index
        online = self.joining.update(self.grid)
        due = (round_index - 1) % self.settings.nodes.heat_refresh_every == 0
        # under [dp] the population counted at round 1 stays (the accountant's sampling rate
        # and the mechanism's fixed denominator are over it): a later client is not sampled
        fixed = self.central_dp or self.private
        if self.membership.stale() and due and not fixed:
            self.membership.refresh()
            algorithm, sizes = self._algorithm()
            rounds.repopulate(algorithm, sizes.sample_counts(), self._combine(algorithm))
        available = self.membership.available(online)
        self._available = len(available)
        if self.dp is None:
            return available
        # [dp]: the cohort is drawn from the whole counted population, the N the accountant's
        # rate q = K / N is over; a sampled client whose node is offline is a dropout (sent
        # nothing, its update missing from the sum, the noise and the denominator unchanged),
        # so epsilon is that of the sampling that happened (docs: Differential privacy)
        self._online = set(available.tolist())
        return np.arange(len(self.membership.counted), dtype=np.int64)

    def privacy_described(self) -> dict:
        """The run's privacy level and its guarantees (``describe``; level none without
        [privacy]), for its result's costs."""
        return privacy_described(self.schedule)

    def dp_result(self) -> dict[str, object]:
        """[dp]'s part of the run's result (none without [dp]): the model's epsilon after the
        rounds run, and where the noise and the cohorts came from."""
        return flower_result(self.dp, self.schedule)

    def _check_accounted_population(self) -> None:
        """Under [dp] the counted population is the N epsilon is accounted over: a run that
        counted another number of clients at round 1 (min-nodes below num-nodes) would sample
        at another rate than the one reported, so it is refused."""
        if self.dp is None:
            return
        accounted = self.dp.ledger.settings.accounting.num_clients
        if len(self.membership.counted) != accounted:
            raise FedsubError(
                f"Flower [dp]: {len(self.membership.counted)} clients registered before round "
                f"1, but epsilon is accounted over N = {accounted} (the run's population): the "
                "cohort would be drawn at another rate than the one reported; leave min-nodes "
                "unset (every node) or equal to the population"
            )

    def _registered(
        self, registration: Registration, content: RecordDict, before: Registration | None
    ) -> None:
        if self.private:  # a new node: ask its rows; its evaluation gets the whole model
            self.sampled.forget(registration.partition)
        self.evaluation.learn(registration.partition, None if self.private else content)
        # Flower's logger, as the round lines: what `flwr run --stream` and `flwr log` show
        flwr_log(INFO, "fedsub: %s", self._membership_line(registration, before))

    def _membership_line(self, registration: Registration, before: Registration | None) -> str:
        """One line for a registration: who registered or took over which partition, and
        from which round it counts (the heat coefficients' policy: docs/tutorials/flower.md,
        "Elastic membership")."""
        node, k, r = registration.node, registration.partition, self.joining.round
        dp = dp_settings(self.schedule) is not None
        fixed = self.private or dp  # the population of round 1 stays
        every, last = self.settings.nodes.heat_refresh_every, self.schedule.rounds
        refresh = r + (-(r - 1)) % every  # the first refresh at or after round r
        if not self.joining.joined:  # before round 1: everyone counts from round 1 (or resumed)
            return f"node {node} registered partition {k}"
        if before is None or (k not in self.membership.counted and before.node == node):
            if fixed:
                why = "[dp]" if dp else "a private heat source"
                return (
                    f"node {node} registered partition {k}, a new client: not sampled in this "
                    f"run (under {why} the population counted at round 1 stays)"
                )
            if refresh > last:
                return (
                    f"node {node} registered partition {k}, a new client: not sampled in this "
                    f"run (the heat is next rebuilt at round {refresh}, after the last)"
                )
            return (
                f"node {node} registered partition {k}, a new client: counted and sampled "
                f"from round {refresh} (heat-refresh-every = {every})"
            )
        if k in self.membership.counted:  # same data: it trains in this very round
            when = f"from round {r}"
        elif fixed:  # its data changed since round 1 counted them
            when = "not again in this run: its data differ from those counted at round 1"
        elif refresh <= last:
            when = f"from round {refresh}, with its new data"
        else:
            when = "not again in this run"
        if before.node != node:
            return f"partition {k}: node {node} takes over from node {before.node}, sampled {when}"
        return f"node {node} (partition {k}) answered again: sampled {when}"

    def _algorithm(self) -> tuple[Algorithm, Population]:
        """The algorithm over the counted population (heat n_m, N, sample counts). With a
        private heat source the heat comes from the private exchange with the counted nodes
        (or from a checkpoint), and no S(k) and no per-client sample count is known: uniform
        sampling reads only how many clients there are (settings.algorithm_name refuses
        schemes needing them)."""
        counted, measured = self.membership.counted, None
        if self.private:
            measured = self._measured_heat()
            sizes = ClientSizes(dict(self.membership.tables), np.ones(len(counted), np.int64))
        else:
            self.index, sizes = self.membership.index(), self.membership.sizes()
        context = AlgorithmContext(
            sizes,
            self.index,
            self.served.heat,
            self.schedule.clients_per_round,
            self.privacy,
            measured=measured,
        )
        algorithm = build_algorithm(self.served.name, context, self.served.options)
        return algorithm, context.dataset

    def _measured_heat(self) -> MeasuredHeat:
        """The heat of the private exchange with every counted node (once: a resumed run's
        comes from its checkpoint)."""
        heat, membership = self.heat, self.membership
        ask = asker(self.grid, self.timeout, self.observers.transcript, heat.carried)
        nodes = {k: membership.node_of(k) for k in membership.counted}
        return heat.measured(ask, nodes, dict(membership.tables), self.served.heat)

    def _combine(self, algorithm: Algorithm) -> Callable[[Any], ServerUpdate]:
        """The round's aggregation: secure row sums at ``full`` (noised by the nodes under
        [dp]: distributed DP), else the algorithm's (divided by p under randomized response;
        [dp]'s central mechanism is the loop's)."""
        aggregation = algorithm.aggregation
        if not sums_securely(self.schedule):
            return download_combine(aggregation, self.schedule)
        nodes, on_reply = PositionNodes(self.membership), self.observers.transcript
        requests = lambda: self.sampled.rows  # noqa: E731  (this round's, when it combines)
        self.secure = secure = secure_rows_of(
            self.schedule,
            lambda carried: asker(self.grid, self.timeout, on_reply, carried),
            nodes,
            aggregation,
            requests,
        )
        return secure.combine

    def _rows_of(self, client: int) -> dict[str, torch.Tensor]:
        """Client ``client``'s S(k) per table (its position in ``counted``; exact: from its
        registration; private: from the "rows" query of the round that sampled it; with
        private download its request for the round)."""
        if self.asks_rows:
            return {t: torch.from_numpy(r) for t, r in self.sampled.rows[client].items()}
        return {t: torch.from_numpy(self.index.client_rows(t, client)) for t in self.params.tables}

    def _log_rejection(self, rejection: Rejection) -> None:
        LOG.warning(
            "round %d: rejected partition %d: %s",
            rejection.round,
            self.membership.counted[rejection.client],
            rejection.reason,
        )

    # --- a round's training --------------------------------------------------------------
    def run_cohort(self, plan: RoundPlan, params: Params) -> CohortUpdate | RoundFailed:
        """Send the cohort its submodels, read the replies that came within the round
        timeout; the cohort's update over them, or ``RoundFailed`` (fewer than min-replies)."""
        r, clients = plan.round, plan.cohort.clients.tolist()
        online = self._online
        reachable = [j for j in clients if online is None or j in online]  # [dp]: dropouts
        partitions = [self.membership.counted[j] for j in clients]
        nodes = [self.membership.node_of(k) for k in partitions]
        # privacy full (which always asks requests): the secure sum's keys ride with the
        # request query, its shares with the train messages (two waves fewer; who is in the
        # sum and its threshold: privacy/secure_rows_protocol.py's SecureRows.open)
        secure, cohort = self.secure, zip(clients, nodes, strict=True)
        advertise = {} if secure is None else secure.open([n for j, n in cohort if j in reachable])
        queried: list[Message] = []
        if self.asks_rows:  # the sampled nodes' rows (or download requests), for their download
            riders = None if secure is None else (secure.carried, advertise)
            queried = self.sampled.ask(self.grid, reachable, r, riders)
        sent_to = {
            node: j
            for j, node in zip(clients, nodes, strict=True)
            if (not self.asks_rows or j in self.sampled.rows)  # no rows: left out
            and (online is None or j in online)  # [dp]: an offline sampled node drops out
        }
        if self.observers.on_progress is not None:
            self.observers.on_progress({"round": r, "sent_to": partitions, "nodes": nodes})
        messages, sent = train_messages(plan, params, sent_to, self._rows_of, self.settings.payload)
        if secure is not None:
            keys = self._riding(secure, queried, "advertise")
            sharing = secure.take_keys({n: f for n, f in keys.items() if n in sent_to})
            ride(messages, sharing, secure.carried)
        replies = exchange(
            self.grid,
            messages,
            self.timeout,
            lambda: self.joining.ask_newcomers(self.grid),
        )
        if secure is not None:
            secure.take_shares(self._riding(secure, replies, "share"))
        updates, received = self._read(r, replies, sent_to, params)
        return self._cohort_update(plan, updates, nodes, sent, received)

    def _riding(
        self, secure: SecureSum, replies: list[Message], stage: str
    ) -> Mapping[int, Fields]:
        """The secure sum's ``stage`` riding with ``replies`` (to the round's other
        messages), by node: none when no sum rides (not opened, or restarted)."""
        group = secure.riding_with
        if group is None:
            return {}
        return riding(replies, group, stage, secure.carried, self.observers.transcript)

    def _read(
        self, r: int, replies: Iterable[Message], sent_to: dict[int, int], params: Params
    ) -> tuple[dict[int, ClientUpdate], int]:
        """The updates of the replies that can be read and fit ``params`` (the model the
        round sent), by cohort position, and their bytes; any other is left out, logged."""
        updates: dict[int, ClientUpdate] = {}
        received = 0
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                LOG.warning("round %d: node %d failed: %s", r, node, reply.error.reason)
                continue
            if self.observers.transcript is not None:
                self.observers.transcript(node, "train", reply.content)
            client = sent_to.get(node)
            if client is None:
                LOG.warning("round %d: unexpected reply from node %d", r, node)
                continue
            partition = self.membership.counted[client]
            if client in updates:
                LOG.warning("round %d: node %d: a second reply; left out", r, node)
                continue
            try:
                examples = self.membership.registered[partition].examples
                updates[client], size = self.reader.update(
                    reply, client, partition, params, examples, r
                )
            except FedsubError as error:  # left out, like a node that failed
                LOG.warning(
                    "round %d: node %d (partition %d): %s; left out", r, node, partition, error
                )
                continue
            received += size
        return updates, received

    def _cohort_update(
        self,
        plan: RoundPlan,
        updates: dict[int, ClientUpdate],
        nodes: list[int],
        sent: int,
        received: int,
    ) -> CohortUpdate | RoundFailed:
        """The round's record (``nodes``: the cohort's; ``sent``, ``received``: the bytes of its
        train arrays), and its update (the replies in cohort order) or failure."""
        clients, counted, r = plan.cohort.clients.tolist(), self.membership.counted, plan.round
        left_out = [counted[j] for j in sorted(set(clients) - set(updates))]
        for k in left_out:  # name the node and its partition: the operator's next step
            node = self.membership.node_of(k)
            LOG.warning(
                "round %d: no update from node %d (partition %d): left out until it answers",
                r,
                node,
                k,
            )
            self.joining.leave_out(node)
        self.evaluation.note_replies({counted[j] for j in clients}, left_out)
        record = {
            "round": r,
            "available": self._available,
            "sampled": len(clients),
            "clients": [counted[j] for j in clients],
            "nodes": nodes,
            "replies": len(updates),
            "left_out": left_out,
            # the model arrays of the round's train messages, summed over the cohort
            # (ArrayRecord.count_bytes): what a submodel saves over the whole model; every
            # byte of every message, per node, is in "costs" (flower/costs.py)
            "train_arrays_bytes_sent": sent,
            "train_arrays_bytes_received": received,
            "bytes_sent": sent,  # the old names of the two, kept for older readers
            "bytes_received": received,
            "updated": False,
        }
        failed = self.records.judge(record)
        if failed is not None:
            return failed
        kept = [m for m, j in enumerate(clients) if j in updates]
        multiplicity = torch.from_numpy(plan.cohort.multiplicity[kept])
        return CohortUpdate.from_clients([updates[clients[m]] for m in kept], multiplicity)

    def close_round(self, round_index: int, updated: bool, diverged: str | None) -> None:
        """Keep the round's record (with its costs), report it; stop the run after
        ``max-failed-rounds`` failed rounds in a row (``RoundsFailed``)."""
        meter = self.observers.meter
        costs = meter.take(self.records.current["nodes"]) if meter is not None else None
        record = self.records.close(updated, diverged, costs)
        if self.dp is not None:  # [dp]: epsilon after every round, evaluated or not
            record["epsilon"] = self.dp.ledger.epsilon()
        if self.observers.on_progress is not None:
            self.observers.on_progress(record)
        flwr_log(INFO, "%s", round_line(record, self.schedule.rounds))
        self.records.stop_if_failing(round_index)

    # --- evaluation and records ----------------------------------------------------------
    def evaluate(self, round_index: int, params: Params) -> dict[str, float] | None:
        """The federated metrics after the round (not at privacy full: a node's sums name
        its sample counts) and the server's own test file's; round 0 (no node has registered
        yet) and a run with eval-every = 0 have none."""
        if round_index == 0 or not self.settings.eval_every:
            return None
        metrics: dict[str, float] = {}
        if not self.counts_secret:
            online = set(self.grid.get_node_ids()) - self.membership.dropped
            registered = self.membership.registered.items()
            node_of = {k: r.node for k, r in registered if r.node in online}
            messages = self.evaluation.messages(round_index, params, node_of, self.query)
            replies = exchange(self.grid, messages, self.timeout)
            metrics = self.evaluation.aggregate(round_index, replies)
        if self.server_test is not None:
            metrics.update(self.server_test(params))
        shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        flwr_log(INFO, "fedsub round %d: evaluation: %s", round_index, shown or "nothing")
        return metrics

    @property
    def rounds(self) -> list[dict]:
        return self.records.rounds

    def history(self) -> list[dict]:
        return self.records.history()

    def restore_history(self, history: list[dict]) -> None:
        self.records.restore_history(history)
