"""A Flower strategy for federated submodel training (FedSubAvg, FedAvg and the rest).

Membership is elastic (flower/membership.py). Each round, in ``configure_train`` (and while
``start`` waits for a round's replies), the nodes online (``grid.get_node_ids()``) that the
strategy does not know yet are asked for their partition id, sample count and index sets
S(k) (in the clear: the heat counts n_m follow from them; fedsub's secure aggregation
computes the same counts without revealing any S(k), see fedsub.privacy); the first round
waits up to ``node_wait`` seconds for ``min_nodes`` of them. A new node with a known
partition takes it over from this round on. The heat coefficients (and N, the sample counts,
the server optimizer's population) are rebuilt over every registered client when
registrations changed, at rounds 1, 1 + R, 1 + 2R, ... (R = ``heat_refresh_every``); a client
is sampled only once the coefficients count it. Then each round:

- ``configure_train``: the cohort is fedsub's sampler (same seed) over the clients whose node
  is online and has not failed: with every client online it is the in-process engine's
  cohort. Each sampled node gets one Message with its rows X[S(k)], the dense parameters, its
  learning rate and the round's chain of client transforms (names and options, rebuilt from
  fedsub.client.transforms' registry by the ClientApp);
- ``aggregate_train``: the replies' row deltas go through the in-process engine's server round
  (engine/server_round.py: screening, aggregator with heat coefficients over the registered
  clients, finiteness checks raising ``Diverged``, server optimizer). A node that fails or
  times out is left out, and left out of the next rounds until it answers a registration
  question sent right after (a dead node costs one round timeout): the round's mean is over
  the replies received, if there are at least ``min_replies``. After ``max_failed_rounds``
  consecutive rounds short of it the run stops with ``RoundsFailed`` (a federation that
  cannot train must not end as if it had).

With a private ``train.heat_source`` (secagg, sketch, randomized-response) a node registers
with its partition only, and the heat comes from the private exchange with the registered
nodes (``heat_exchange.collect_heat``) when the coefficients are first built; the population
is then the one of that exchange (a replacement node takes its partition over; a new partition
would need a new exchange with every counted node online, and is not counted). The server
learns a node's S(k) only when it samples it, as the download of X[S(k)] names those rows (a
"rows" query before the round). Evaluation is federated (``configure_evaluate`` /
``aggregate_evaluate``): each node gets the global rows its own samples read and replies sums
(loss, counts, AUC histograms), never a sample (flower/federated_eval.py).

``start`` is Flower's round loop, plus checkpoints every ``checkpoints.every`` rounds and a
resume from the newest (flower/checkpoints.py; a private heat source's heat is a stage of it,
flower/heat_state.py). Messages follow Flower's conventions (``arrays`` + ``config`` out,
``arrays`` + ``metrics`` with ``num-examples`` back; at ``train.privacy = "full"`` no
``num-examples``: the count weights the deltas inside the secure sum); Flower's DP wrappers are
refused (their whole-model clipping and noise do not apply to row deltas).

Bytes on the wire (the ``ArrayRecord`` payloads) are counted per round; with a ``meter``
(flower/costs.py) every message's bytes and the nodes' and server's seconds too.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from logging import INFO
from typing import Protocol

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.app.typing import ConfigRecordValues
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.dp_adaptive_clipping import DifferentialPrivacyAdaptiveBase
from flwr.serverapp.strategy.dp_fixed_clipping import DifferentialPrivacyFixedClippingBase

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.data.federated import ClientSizes
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine.guards import Rejection
from fedsub.engine.schedule import Schedule
from fedsub.engine.server_round import Diverged, RoundPlan, ServerRound
from fedsub.errors import FedsubError
from fedsub.flower.checkpoints import FlowerCheckpoints
from fedsub.flower.exchange import exchange
from fedsub.flower.federated_eval import FederatedEvaluation
from fedsub.flower.heat_exchange import HeatReport, Recorder, collect_heat
from fedsub.flower.heat_state import PrivateHeatStage
from fedsub.flower.membership import Membership, Registrar
from fedsub.flower.private_download import downloads_privately, reply_rows
from fedsub.flower.records import number_of, read_deltas, record_of, submodel_record
from fedsub.flower.secure_rows import round_combine
from fedsub.flower.settings import Payload
from fedsub.privacy.heat_sources import HeatPrivacy
from fedsub.stateful import Stateful
from fedsub.submodel.heat import HeatKind
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import ClientUpdate, CohortUpdate, pull

LOG = logging.getLogger("fedsub")
PRIVATE_HEAT = "private_heat"  # the checkpoint stage of a private heat source's measurement
NEWCOMERS_EVERY = 1.0  # seconds between two looks for new nodes while a round waits


class RoundsFailed(FedsubError):
    """Too many consecutive rounds got fewer than ``min_replies`` replies."""

    def __init__(self, round_index: int, reason: str) -> None:
        super().__init__(f"round {round_index}: {reason}")
        self.round = round_index
        self.reason = reason


# Flower's wrappers whose semantics are defined on whole-model arrays (they clip each reply
# against the global model and add noise to the aggregated arrays the strategy returns)
WHOLE_MODEL_WRAPPERS = (DifferentialPrivacyFixedClippingBase, DifferentialPrivacyAdaptiveBase)


def _refuse_whole_model_wrapper(caller: object) -> None:
    """Refuse to run under a wrapper that would silently not do what it says: a node's reply
    holds the row deltas of its own submodel, and the model is updated in place (no
    aggregated arrays are returned), so the DP wrappers' clipping would compare unrelated
    arrays and their noise would never be added."""
    if isinstance(caller, WHOLE_MODEL_WRAPPERS):
        raise FedsubError(
            f"Flower: {type(caller).__name__} cannot wrap SubmodelStrategy: its clipping and "
            "noise are defined on whole-model arrays, while each reply holds the row deltas "
            "of a node's own submodel and the strategy returns no aggregated arrays (the noise "
            "would never be added). Clip client updates with train.clip_norm and keep heat "
            "private with train.heat_source (fedsub.privacy) instead"
        )


def _row_ids(reply: Message, params: Params) -> dict[str, np.ndarray] | str:
    """A "rows" reply's S(k) per table, or why it is not one (row ids of every table)."""
    if "index" not in reply.content:
        return "its reply holds no rows"
    index = record_of(reply.content, "index", ArrayRecord).to_torch_state_dict()
    rows = {}
    for table, values in params.tables.items():
        size = values.shape[0]
        r = index.get(f"rows.{table}")
        if r is None or r.ndim != 1 or r.is_floating_point():
            return f"no row ids for table {table!r}"
        if len(r) and not 0 <= int(r.min()) <= int(r.max()) < size:
            return f"its rows of table {table!r} are not row ids below {size}"
        rows[table] = r.numpy().astype(np.int64)
    return rows


class RoundMeter(Protocol):
    """What a round cost since the last call, over its sampled nodes (flower/costs.py)."""

    def take(self, nodes: Iterable[int]) -> dict: ...


class _PositionNodes(Mapping[int, int]):
    """Node id of the client at each position of ``membership.counted`` (a cohort's ids)."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership

    def __getitem__(self, j: int) -> int:
        return self.membership.node_of(self.membership.counted[j])

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.membership.counted)))

    def __len__(self) -> int:
        return len(self.membership.counted)


def round_line(record: dict, rounds: int) -> str:
    """A round's record as one line of Flower's log (``flwr run --stream`` shows it)."""
    line = (
        f"fedsub round {record['round']}/{rounds}: {record['replies']} of {record['sampled']} "
        f"sampled nodes replied"
    )
    if record["left_out"]:
        line += f", partitions left out: {record['left_out'][:10]}"
    if "failed" in record:
        return f"{line}; model unchanged ({record['failed']})"
    if "diverged" in record:
        return f"{line}; diverged: {record['diverged']}"
    return line + ("; model updated" if record["updated"] else "; model unchanged")


class SubmodelStrategy(Strategy):
    """Sends nodes their submodels and aggregates row deltas with a fedsub algorithm."""

    def __init__(
        self,
        params: Params,
        algorithm: str,
        options: object,
        heat: HeatKind,
        schedule: Schedule,
        *,
        min_replies: int = 1,
        max_failed_rounds: int = 3,
        max_update_norm: float = 0.0,
        payload: Payload = "submodel",
        min_nodes: int = 1,
        node_wait: float = 600.0,
        heat_refresh_every: int = 1,
        checkpoints: FlowerCheckpoints | None = None,
        on_progress: Callable[[dict], None] | None = None,
        privacy: HeatPrivacy | None = None,
        on_heat_reply: Recorder | None = None,
        evaluation: FederatedEvaluation | None = None,
        on_train_reply: Recorder | None = None,
        meter: RoundMeter | None = None,
    ) -> None:
        self.params = params
        self.algorithm_name = algorithm
        self.options = options
        self.heat = heat
        self.schedule = schedule
        self.min_replies = min_replies
        self.max_failed_rounds = max_failed_rounds
        self._failed_in_a_row = 0
        self.max_update_norm = max_update_norm
        self.payload = payload
        self.min_nodes = min_nodes
        self.node_wait = node_wait
        self.heat_refresh_every = heat_refresh_every
        self.checkpoints = checkpoints
        self.on_progress = on_progress  # called when a round is sent out and when it is done
        self.rounds: list[dict] = []  # one record per round: replies, bytes, left out
        self.evaluations: dict[int, dict[str, float]] = {}  # kept in checkpoints
        self.privacy = privacy or HeatPrivacy()
        self.on_heat_reply = on_heat_reply  # sees every reply of the query and heat exchange
        self.on_train_reply = on_train_reply  # sees every train reply (a transcript)
        self.meter = meter  # what each round cost (flower/costs.py), in its record
        self.heat_report: HeatReport | None = None  # what a private heat source measured
        self.evaluation = evaluation or FederatedEvaluation(every=0, rounds=schedule.rounds)
        self.membership = Membership({t: v.shape[0] for t, v in params.tables.items()})
        private = self.privacy.source != "exact"
        self._registrar = Registrar(
            {"what": "partition" if private else "index", **self.evaluation.query},
            on_reply=self._heard,
        )
        # private heat: S(k) (or this round's request) of sampled clients, by position in counted
        self._sampled_rows: dict[int, dict[str, np.ndarray]] = {}
        self._timeout = 600.0
        self._joined = False  # min_nodes registered once
        # nodes that answered this ServerApp's query: a resumed run asks again, which also
        # waits (node-wait) for the nodes' ClientApps to start serving the new Flower run
        self._answered: set[int] = set()
        self._to_probe: set[int] = set()  # nodes that missed a round, to be asked again
        self._next_newcomers = 0.0  # when a waiting round next looks for new nodes
        self._index: SubmodelIndex | None = None
        self._round: ServerRound | None = None
        self._plan: RoundPlan | None = None
        self._sent_to: dict[int, int] = {}  # node id -> cohort position, this round
        self._sent = 0
        self._available = 0  # clients that could be sampled this round
        # privacy full: a node's sample count stays inside the secure row sum (secure_rows.py)
        self._counts_secret = bool(schedule.privacy and schedule.privacy.secure_aggregation)

    # --- membership ----------------------------------------------------------------------
    def _update_membership(self, grid: Grid, server_round: int) -> set[int]:
        """Ask the nodes that came online since the last round to register (new clients and
        replacements), take the answers that arrived (round 1 waits up to ``node_wait``
        seconds for ``min_nodes`` of them), rebuild the heat coefficients when due; the nodes
        online."""
        deadline = time.monotonic() + self.node_wait
        while True:
            online = set(grid.get_node_ids())
            self.membership.forget_offline(online)
            probe = sorted(self._to_probe - self._registrar.awaiting())
            if new := self._not_asked(online) + probe:
                self._registrar.ask(grid, new)
            self._to_probe.clear()
            answers, failed = self._registrar.collect(grid)
            for registration, content in answers:
                self.membership.register(registration)  # also readmits a dropped node
                self._answered.add(registration.node)
                if self.privacy.source != "exact":  # its evaluation gets the whole model
                    if registration.partition in self.membership.counted:  # a new node: ask
                        j = self.membership.counted.index(registration.partition)
                        self._sampled_rows.pop(j, None)
                    self.evaluation.learn_whole(registration.partition)
                else:
                    self.evaluation.learn(registration.partition, content)
            for node in failed:
                self.membership.drop(node)
            if self._joined or len(self._answered) >= self.min_nodes:
                break
            if time.monotonic() > deadline:
                raise FedsubError(
                    f"Flower: {len(self._answered)} node(s) registered (of "
                    f"{len(online)} online) within node-wait = {self.node_wait:g} s; "
                    f"min-nodes = {self.min_nodes}"
                )
            time.sleep(0.2)
        self._joined = True
        refresh_due = (server_round - 1) % self.heat_refresh_every == 0
        private = self.privacy.source != "exact"
        if self._round is None or (self.membership.stale() and refresh_due and not private):
            self.membership.refresh()
            self._build(grid)
        return online

    def _not_asked(self, online: set[int]) -> list[int]:
        """The nodes online that were never asked to register (nor are being asked)."""
        asked = self._answered | self.membership.dropped | self._registrar.awaiting()
        return sorted(online - asked)

    def _ask_newcomers(self, grid: Grid) -> set[int]:
        """While a round waits for its replies, ask the nodes that came online to register
        and pull the answers that arrived (at most every ``NEWCOMERS_EVERY`` seconds); they
        are taken at the next round, so a replacement started during a round is sampled from
        the next round on. The nodes whose partition a newcomer took over: the round waits
        no longer for them (a dead node's replacement ends the wait for it)."""
        now = time.monotonic()
        if now < self._next_newcomers:
            return set()
        self._next_newcomers = now + NEWCOMERS_EVERY
        if new := self._not_asked(set(grid.get_node_ids())):
            self._registrar.ask(grid, new)
        taken_over = set()
        for registration in self._registrar.pull(grid):
            before = self.membership.registered.get(registration.partition)
            if before is not None and before.node != registration.node:
                taken_over.add(before.node)
        return taken_over

    def _heard(self, node: int, content: RecordDict) -> None:
        if self.on_heat_reply is not None:
            self.on_heat_reply(node, "query", content)

    def _build(self, grid: Grid | None = None) -> None:
        """The algorithm over the counted population (heat n_m, N, sample counts); a server
        optimizer already running keeps its state. With a private heat source the heat comes
        from the private exchange with the counted nodes (``grid``), or from a checkpoint."""
        if self.privacy.source != "exact":
            context = self._private_context(grid)
            sizes = context.dataset
        else:
            sizes = self.membership.sizes()
            self._index = self.membership.index()
            context = AlgorithmContext(
                sizes, self._index, self.heat, self.schedule.clients_per_round
            )
        algorithm = build_algorithm(self.algorithm_name, context, self.options)
        server = algorithm.make_server(self.params)
        if self._round is not None:
            server.load_state_tensors(self._round.server.state_tensors())
        self._round = ServerRound(
            algorithm,
            self.schedule,
            sizes.sample_counts(),
            self.params,
            server,
            round_combine(
                grid,
                _PositionNodes(self.membership),
                algorithm.aggregation,
                self.schedule.privacy,
                lambda: self._sampled_rows,
                self._timeout,
                self.on_heat_reply,
            ),
            max_update_norm=self.max_update_norm,
            on_reject=self._log_rejection,
        )

    def _private_context(self, grid: Grid | None) -> AlgorithmContext:
        """The algorithm's context from the private heat exchange with every counted node:
        no S(k), no per-client sample count (their total comes with the heat)."""
        tables = dict(self.membership.tables)
        if grid is not None and self.heat_report is None:  # resumed: from the checkpoint
            nodes = {k: self.membership.node_of(k) for k in self.membership.counted}
            report = collect_heat(
                grid,
                list(nodes.values()),
                self.privacy,
                self.heat,
                tables,
                self._timeout,
                self.on_heat_reply,
            )
            missing = sorted(k for k, n in nodes.items() if n not in report.contributors)
            if missing:
                raise FedsubError(
                    f"Flower: heat exchange ({self.privacy.source}): no contribution from "
                    f"partition(s) {missing[:10]}; every registered partition must be in the "
                    "heat"
                )
            self.heat_report = report
        if self.heat_report is None:
            raise FedsubError("Flower: a private heat source needs its heat exchange first")
        # The server does not know the clients' sample counts: uniform sampling reads only
        # how many clients there are (settings.algorithm_name refuses schemes needing them).
        counts = np.ones(len(self.membership.counted), dtype=np.int64)
        return AlgorithmContext(
            ClientSizes(tables, counts),
            SubmodelIndex({}, {}),
            self.heat,
            self.schedule.clients_per_round,
            self.privacy,
            measured=self.heat_report.measured,
        )

    def _rows_of(self, client: int) -> dict[str, torch.Tensor]:
        """Client ``client``'s S(k) per table (its position in ``counted``; exact: from its
        registration; private: from the "rows" query of the round that sampled it)."""
        if self._index is not None:
            index = self._index
            return {t: torch.from_numpy(index.client_rows(t, client)) for t in self.params.tables}
        return {t: torch.from_numpy(r) for t, r in self._sampled_rows[client].items()}

    def _ask_rows(self, grid: Grid, clients: list[int], server_round: int) -> None:
        """Private heat source: the S(k) of the round's sampled clients (positions in
        ``counted``) not known yet; with private download (flower/private_download.py) their
        requests for this round instead."""
        asked: dict[str, ConfigRecordValues] = {"what": "rows", **self.evaluation.query}
        if downloads_privately(self.schedule.privacy):  # a new request every round
            self._sampled_rows = {}
            asked = {"what": "request", "round": server_round, **self.evaluation.query}
        unknown = [j for j in clients if j not in self._sampled_rows]
        if not unknown:
            return
        counted = self.membership.counted
        partition_of = {self.membership.node_of(counted[j]): j for j in unknown}  # node -> j
        query = [
            Message(
                RecordDict({"query": ConfigRecord(asked)}),
                node,
                MessageType.QUERY,
                group_id=str(server_round),
            )
            for node in partition_of
        ]
        for reply in exchange(grid, query, self._timeout):
            node = reply.metadata.src_node_id
            if reply.has_error() or node not in partition_of:
                LOG.warning("round %d: no rows from node %d", server_round, node)
                continue
            rows = _row_ids(reply, self.params)
            if isinstance(rows, str):  # left out of the round, like a node that failed
                LOG.warning("round %d: node %d: %s", server_round, node, rows)
                continue
            self._sampled_rows[partition_of[node]] = rows

    def stages(self) -> dict[str, Stateful]:
        """What a checkpoint saves: every stage of the server round and the population (and
        with a private heat source the heat it measured, flower/heat_state.py)."""
        assert self._round is not None
        stages: dict[str, Stateful] = {**self._round.stages(), "population": self.membership}
        if self.privacy.source != "exact":
            stages[PRIVATE_HEAT] = self._heat_stage()
        return stages

    def _heat_stage(self) -> PrivateHeatStage:
        def put(report: HeatReport) -> None:
            self.heat_report = report

        return PrivateHeatStage(self.privacy.source, lambda: self.heat_report, put)

    # --- the run -----------------------------------------------------------------------
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's round loop (Strategy.start), continuing a checkpoint when asked to and
        saving one every ``checkpoints.every`` rounds. Nodes register in ``configure_train``,
        so a strategy wrapper running Flower's own loop on this strategy needs nothing else."""
        self.summary()
        self._timeout = timeout
        train_config = train_config or ConfigRecord()
        evaluate_config = evaluate_config or ConfigRecord()
        result = Result()
        first = 1
        if self.checkpoints is not None and self.checkpoints.resume:
            first = self._resume(self.checkpoints, grid) + 1
        elif evaluate_fn is not None and (metrics := evaluate_fn(0, initial_arrays)):
            result.evaluate_metrics_serverapp[0] = metrics
        for r in range(first, num_rounds + 1):
            messages = self.configure_train(r, initial_arrays, train_config, grid)
            replies = exchange(grid, messages, timeout, lambda: self._ask_newcomers(grid))
            _, metrics = self.aggregate_train(r, replies)
            if metrics is not None:
                result.train_metrics_clientapp[r] = metrics
            messages = self.configure_evaluate(r, initial_arrays, evaluate_config, grid)
            replies = exchange(grid, messages, timeout)
            if (metrics := self.aggregate_evaluate(r, replies)) is not None:
                result.evaluate_metrics_clientapp[r] = metrics
            if evaluate_fn is not None and (metrics := evaluate_fn(r, initial_arrays)):
                result.evaluate_metrics_serverapp[r] = metrics
            if self.checkpoints is not None and self.checkpoints.due(r, num_rounds):
                path = self.checkpoints.save(r, self.stages(), self._history())
                LOG.info("round %d: checkpoint %s", r, path)
        result.arrays = ArrayRecord(self.params.state_dict())
        return result

    def _history(self) -> list[dict]:
        evaluations = [{"evaluation": r, "metrics": m} for r, m in sorted(self.evaluations.items())]
        return [*evaluations, *({"record": record} for record in self.rounds)]

    def _resume(self, checkpoints: FlowerCheckpoints, grid: Grid) -> int:
        """Restore the population, every stage and the records of the newest checkpoint;
        its round. A private heat source's heat comes from the checkpoint (no new exchange);
        the grid is for the round's protocol stages (secure row sums)."""
        saved = checkpoints.latest()
        self.membership.load_state_tensors(saved.stages["population"])
        if self.privacy.source != "exact":
            if PRIVATE_HEAT not in saved.stages:
                raise FedsubError(
                    f"{saved.path}: no private heat saved (written before private runs could "
                    "resume); start the run again"
                )
            self._heat_stage().load_state_tensors(saved.stages[PRIVATE_HEAT])
        self._build(grid)
        checkpoint_lib.restore(self.stages(), saved)
        self.rounds = [e["record"] for e in saved.history if "record" in e]
        self.evaluations = {
            int(e["evaluation"]): dict(e["metrics"]) for e in saved.history if "evaluation" in e
        }
        self._failed_in_a_row = 0
        for record in reversed(self.rounds):  # the failed rounds in a row at the end
            if "failed" not in record:
                break
            self._failed_in_a_row += 1
        LOG.info("resuming after round %d from %s", saved.round, saved.path)
        return saved.round

    def _log_rejection(self, rejection: Rejection) -> None:
        LOG.warning(
            "round %d: rejected partition %d: %s",
            rejection.round,
            self.membership.counted[rejection.client],
            rejection.reason,
        )

    # --- training ---------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        _refuse_whole_model_wrapper(sys._getframe(1).f_locals.get("self"))
        online = self._update_membership(grid, server_round)
        assert self._round is not None
        available = self.membership.available(online)
        self._plan = self._round.begin(server_round, among=available)
        cohort, work = self._plan.cohort, self._plan.work
        partitions = [self.membership.counted[j] for j in cohort.clients.tolist()]
        if self._index is None:  # private heat: the sampled nodes' rows, for their download
            self._ask_rows(grid, cohort.clients.tolist(), server_round)
        nodes = [self.membership.node_of(k) for k in partitions]
        self._sent_to = {
            node: j
            for j, node, k in zip(cohort.clients.tolist(), nodes, partitions, strict=True)
            if self._index is not None or j in self._sampled_rows  # no rows: left out
        }
        self._sent = 0
        if self.on_progress is not None:
            self.on_progress({"round": server_round, "sent_to": partitions, "nodes": nodes})
        messages, full = [], None
        chain = json.dumps(work.chain.describe())  # the ClientApp rebuilds it by name
        for member, client in enumerate(cohort.clients.tolist()):
            if nodes[member] not in self._sent_to:
                continue  # no rows from it: left out of the round
            rows = self._rows_of(client)
            if self.payload == "full":  # the same whole model for everyone, built once
                arrays = full = full or ArrayRecord(self.params.state_dict())
            else:
                arrays = submodel_record(rows, pull(self.params, rows))
            settings = ConfigRecord(
                {"round": server_round, "lr": float(work.lr[member]), "chain": chain}
            )
            self._sent += arrays.count_bytes()
            record = RecordDict({"arrays": arrays, "config": settings})
            messages.append(
                Message(record, nodes[member], MessageType.TRAIN, group_id=str(server_round))
            )
        self._available = len(available)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        assert self._plan is not None and self._round is not None
        cohort, counted = self._plan.cohort, self.membership.counted
        position = {int(j): m for m, j in enumerate(cohort.clients)}
        updates: dict[int, ClientUpdate] = {}
        received = 0
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                LOG.warning("round %d: node %d failed: %s", server_round, node, reply.error.reason)
                continue
            if self.on_train_reply is not None:
                self.on_train_reply(node, "train", reply.content)
            metrics = record_of(reply.content, "metrics", MetricRecord)
            client = self._sent_to.get(node)
            partition = int(number_of(metrics, "partition-id"))
            if client is None or counted[client] != partition:
                LOG.warning(
                    "round %d: unexpected reply from node %d (partition %d)",
                    server_round,
                    node,
                    partition,
                )
                continue
            deltas_in = record_of(reply.content, "arrays", ArrayRecord)
            received += deltas_in.count_bytes()
            deltas = read_deltas(deltas_in)
            rows = {t: r for t, r in self._rows_of(client).items() if t in deltas.tables}
            if downloads_privately(self.schedule.privacy):  # the held rows it requested
                try:
                    rows = reply_rows(reply, rows, client)
                except FedsubError as error:  # left out, like a node that failed
                    LOG.warning("round %d: %s", server_round, error)
                    continue
            elif self.payload == "full":  # full-size deltas: only S(k) can be non-zero
                deltas = Params(
                    {t: d.index_select(0, rows[t]) for t, d in deltas.tables.items()},
                    deltas.dense,
                )
            weight = 1.0  # at privacy full no count comes: the secure sum weights the deltas
            if not self._counts_secret:
                weight = float(number_of(metrics, "num-examples"))
            updates[client] = ClientUpdate(client, weight, rows, deltas.tables, deltas.dense)
        missing = sorted(set(position) - set(updates))
        left_out = [counted[j] for j in missing]
        for j in missing:  # name the node and its partition: the operator's next step
            node = self.membership.node_of(counted[j])
            LOG.warning(
                "round %d: no update from node %d (partition %d): left out until it answers",
                server_round,
                node,
                counted[j],
            )
            self.membership.drop(node)
            self._to_probe.add(node)  # asked to register again: a slow node comes back
        self.evaluation.note_replies(set(counted[j] for j in position), left_out)
        record: dict[str, object] = {
            "round": server_round,
            "available": self._available,
            "sampled": len(position),
            "clients": [counted[j] for j in cohort.clients.tolist()],
            "nodes": [self.membership.node_of(counted[j]) for j in cohort.clients.tolist()],
            "replies": len(updates),
            "left_out": left_out,
            # the model arrays of the round's train messages, summed over the cohort
            # (ArrayRecord.count_bytes): what a submodel saves over the whole model; every
            # byte of every message, per node, is in "costs" (flower/costs.py)
            "train_arrays_bytes_sent": self._sent,
            "train_arrays_bytes_received": received,
            "bytes_sent": self._sent,  # the old names of the two, kept for older readers
            "bytes_received": received,
            "updated": False,
        }
        metrics = MetricRecord(
            {
                "replies": len(updates),
                "train-arrays-bytes-sent": self._sent,
                "train-arrays-bytes-received": received,
            }
        )
        if len(updates) < self.min_replies:
            self._failed_in_a_row += 1
            reason = (
                f"{len(updates)} of {len(position)} sampled nodes replied, fewer than "
                f"min-replies = {self.min_replies} (missing partitions {left_out[:10]}; "
                f"{self._available} client(s) available); "
                f"{self._failed_in_a_row} such round(s) in a row, "
                f"max-failed-rounds = {self.max_failed_rounds}"
            )
            LOG.warning("round %d: %s: model unchanged", server_round, reason)
            record["failed"] = reason
            self._done(record)
            if self._failed_in_a_row >= self.max_failed_rounds:
                raise RoundsFailed(server_round, reason)
            return None, metrics
        self._failed_in_a_row = 0
        ordered = [updates[k] for k in sorted(updates, key=position.__getitem__)]
        multiplicity = torch.from_numpy(cohort.multiplicity[[position[u.client] for u in ordered]])
        update = CohortUpdate.from_clients(ordered, multiplicity)
        try:
            record["updated"] = self._round.finish(self._plan, update)
        except Diverged as error:  # recorded, then raised: the run ends with the error
            record["diverged"] = error.reason
            self._done(record)
            raise
        self._done(record)
        return None, metrics

    def _done(self, record: dict) -> None:
        if self.meter is not None:
            record["costs"] = self.meter.take(record["nodes"])
        self.rounds.append(record)
        if self.on_progress is not None:
            self.on_progress(record)
        flwr_log(INFO, "%s", round_line(record, self.schedule.rounds))

    # --- federated evaluation (flower/federated_eval.py) ------------------------------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if not self.evaluation.due(server_round):  # no call to the SuperLink for nothing
            return []
        if self._counts_secret:  # a node's sums name its sample counts: not at privacy full
            return []
        online = set(grid.get_node_ids()) - self.membership.dropped
        node_of = {k: r.node for k, r in self.membership.registered.items() if r.node in online}
        return self.evaluation.messages(server_round, self.params, node_of)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        if self._counts_secret:  # no federated evaluation at privacy full (configure_evaluate)
            return None
        return self.evaluation.aggregate(server_round, replies)

    def summary(self) -> None:
        LOG.info(
            "SubmodelStrategy: %s, %s payloads, %d clients per round, min %d replies",
            self.algorithm_name,
            self.payload,
            self.schedule.clients_per_round,
            self.min_replies,
        )
