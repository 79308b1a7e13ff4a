"""A Flower strategy for federated submodel training (FedSubAvg, FedAvg and the rest).

Before round 1 a query round asks every node for its partition id, its sample count and its
index sets S(k), in the clear: the heat counts n_m follow from them. With a private
``train.heat_source`` (secagg, sketch, randomized-response) the query asks for the partition
only and the heat comes from the private exchange (``heat_exchange.collect_heat``); the server
then learns a node's S(k) only when it samples it, as the download of X[S(k)] names those rows
(a "rows" query before the round). Then each round:

- ``configure_train``: the cohort is fedsub's (same seed, same clients as the in-process
  engine); each sampled node gets one Message with its rows X[S(k)], the dense parameters,
  its learning rate and the round's chain of client transforms (names and options, rebuilt
  from fedsub.client.transforms' registry by the ClientApp);
- ``aggregate_train``: the replies' row deltas go through the in-process engine's server round
  (engine/server_round.py: screening, aggregator with heat coefficients over all clients,
  finiteness checks raising ``Diverged``, server optimizer). A node that fails or times out is
  left out: the round's mean is over the replies received, if there are at least
  ``min_replies``. After ``max_failed_rounds`` consecutive rounds short of it the run stops
  with ``RoundsFailed`` (a federation that cannot train must not end as if it had);
- ``configure_evaluate`` / ``aggregate_evaluate``: when an evaluation is due, each node gets
  the global rows its own samples read and replies sums (loss, counts, AUC histograms), never
  a sample (``FederatedEvaluation`` in flower/federated_eval.py).

Bytes on the wire (the ``ArrayRecord`` payloads) are counted per round.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.app.typing import ConfigRecordValues
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.data.federated import ClientSizes
from fedsub.data.ragged import Ragged
from fedsub.engine.guards import Rejection
from fedsub.engine.schedule import Schedule
from fedsub.engine.server_round import Diverged, RoundPlan, ServerRound
from fedsub.errors import FedsubError
from fedsub.flower.federated_eval import FederatedEvaluation
from fedsub.flower.heat_exchange import HeatReport, Recorder, collect_heat
from fedsub.flower.private_download import downloads_privately, reply_rows
from fedsub.flower.records import number_of, read_deltas, record_of, submodel_record
from fedsub.flower.secure_rows import round_combine
from fedsub.flower.settings import Payload
from fedsub.privacy.heat_sources import HeatPrivacy
from fedsub.submodel.heat import HeatKind
from fedsub.submodel.index import SubmodelIndex
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import ClientUpdate, CohortUpdate, pull

LOG = logging.getLogger("fedsub")


class RoundsFailed(FedsubError):
    """Too many consecutive rounds got fewer than ``min_replies`` replies."""

    def __init__(self, round_index: int, reason: str) -> None:
        super().__init__(f"round {round_index}: {reason}")
        self.round = round_index
        self.reason = reason


def _ragged(parts: list[np.ndarray]) -> Ragged:
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    return Ragged(np.concatenate(parts).astype(np.int64), offsets)


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
        on_progress: Callable[[dict], None] | None = None,
        privacy: HeatPrivacy | None = None,
        on_heat_reply: Recorder | None = None,
        evaluation: FederatedEvaluation | None = None,
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
        self.on_progress = on_progress  # called when a round is sent out and when it is done
        self.rounds: list[dict] = []  # one record per round: replies, bytes, left out
        self.privacy = privacy or HeatPrivacy()
        self.on_heat_reply = on_heat_reply  # sees every reply of the query and heat exchange
        self.heat_report: HeatReport | None = None  # what a private heat source measured
        self.evaluation = evaluation or FederatedEvaluation(every=0, rounds=schedule.rounds)
        self._node_of: dict[int, int] = {}
        self._index: SubmodelIndex | None = None  # every S(k): with exact heat only
        self._sampled_rows: dict[int, dict[str, np.ndarray]] = {}  # private: sampled nodes'
        self._timeout = 600.0
        self._counts = np.zeros(0, dtype=np.int64)
        self._round: ServerRound | None = None
        self._plan: RoundPlan | None = None
        self._sent = 0

    # --- the query round -------------------------------------------------------------------
    def discover(self, grid: Grid, num_clients: int, timeout: float) -> None:
        """Learn every node's partition, and its sample count and S(k) or (private heat
        source) the heat by the private exchange; build the algorithm."""
        self._timeout = timeout
        private = self.privacy.source != "exact"
        deadline = time.monotonic() + timeout
        while len(nodes := sorted(grid.get_node_ids())) < num_clients:
            if time.monotonic() > deadline:
                raise FedsubError(
                    f"Flower: {len(nodes)} of {num_clients} nodes connected after {timeout:g} s"
                )
            time.sleep(0.5)
        what = "partition" if private else "index"
        query = [
            Message(
                RecordDict({"query": ConfigRecord({"what": what, **self.evaluation.query})}),
                n,
                MessageType.QUERY,
            )
            for n in nodes
        ]
        reports: dict[int, tuple[int, int, dict[str, np.ndarray]]] = {}
        for reply in grid.send_and_receive(query, timeout=timeout):
            if reply.has_error():
                LOG.warning("query: node %d failed: %s", reply.metadata.src_node_id, reply.error)
                continue
            if self.on_heat_reply is not None:
                self.on_heat_reply(reply.metadata.src_node_id, "query", reply.content)
            metrics = record_of(reply.content, "metrics", MetricRecord)
            client = int(number_of(metrics, "partition-id"))
            if private:  # the partition only; its evaluation gets the whole model
                reports[client] = (reply.metadata.src_node_id, 0, {})
                self.evaluation.learn_whole(client)
                continue
            index = record_of(reply.content, "index", ArrayRecord)
            rows = {k[len("rows.") :]: v.numpy() for k, v in index.to_torch_state_dict().items()}
            examples = int(number_of(metrics, "num-examples"))
            reports[client] = (reply.metadata.src_node_id, examples, rows)
            self.evaluation.learn(client, reply.content)
        missing = sorted(set(range(num_clients)) - set(reports))
        if missing:
            raise FedsubError(
                f"Flower: no index report from partition(s) {missing[:10]} of {num_clients}; "
                "every partition must answer the query round"
            )
        self._node_of = {k: reports[k][0] for k in range(num_clients)}
        tables = {t: self.params.tables[t].shape[0] for t in self.params.tables}
        if private:
            context = self._private_heat(grid, tables, timeout)
        else:
            self._counts = np.array([reports[k][1] for k in range(num_clients)], dtype=np.int64)
            self._index = SubmodelIndex(
                {t: _ragged([reports[k][2][t] for k in range(num_clients)]) for t in tables}, {}
            )
            context = AlgorithmContext(
                ClientSizes(tables, self._counts),
                self._index,
                self.heat,
                self.schedule.clients_per_round,
            )
        self.algorithm = build_algorithm(self.algorithm_name, context, self.options)
        self.server = self.algorithm.make_server(self.params)
        self._round = ServerRound(
            self.algorithm,
            self.schedule,
            self._counts,
            self.params,
            self.server,
            round_combine(
                grid,
                self._node_of,
                self.algorithm.aggregation,
                self.schedule.privacy,
                lambda: self._sampled_rows,
                timeout,
                self.on_heat_reply,
            ),
            max_update_norm=self.max_update_norm,
            on_reject=self._log_rejection,
        )

    def _private_heat(self, grid: Grid, tables: dict[str, int], timeout: float) -> AlgorithmContext:
        """The algorithm's context from the private heat exchange with every node: no S(k),
        no per-client sample count (their total comes with the heat)."""
        report = collect_heat(
            grid,
            list(self._node_of.values()),
            self.privacy,
            self.heat,
            tables,
            timeout,
            self.on_heat_reply,
        )
        missing = sorted(k for k, n in self._node_of.items() if n not in report.contributors)
        if missing:
            raise FedsubError(
                f"Flower: heat exchange ({self.privacy.source}): no contribution from "
                f"partition(s) {missing[:10]}; every partition must be in the heat"
            )
        self.heat_report = report
        # The server does not know the clients' sample counts: uniform sampling reads only
        # how many clients there are (settings.algorithm_name refuses schemes needing them).
        self._counts = np.ones(len(self._node_of), dtype=np.int64)
        return AlgorithmContext(
            ClientSizes(tables, self._counts),
            SubmodelIndex({}, {}),
            self.heat,
            self.schedule.clients_per_round,
            self.privacy,
            measured=report.measured,
        )

    def _rows_of(self, client: int) -> dict[str, torch.Tensor]:
        """Client ``client``'s S(k) per table (exact: from the query round; private: from
        the "rows" query of the round that sampled it)."""
        if self._index is not None:
            index = self._index
            return {t: torch.from_numpy(index.client_rows(t, client)) for t in self.params.tables}
        return {t: torch.from_numpy(r) for t, r in self._sampled_rows[client].items()}

    def _ask_rows(self, grid: Grid, clients: list[int], server_round: int) -> None:
        """Private heat source: the S(k) of the round's sampled clients not known yet; with
        private download (flower/private_download.py) their requests for this round instead."""
        asked: dict[str, ConfigRecordValues] = {"what": "rows"}
        if downloads_privately(self.schedule.privacy):  # a new request every round
            self._sampled_rows = {}
            asked = {"what": "request", "round": server_round}
        unknown = [k for k in clients if k not in self._sampled_rows]
        if not unknown:
            return
        client_of = {self._node_of[k]: k for k in unknown}
        query = [
            Message(
                RecordDict({"query": ConfigRecord(asked)}),
                self._node_of[k],
                MessageType.QUERY,
                group_id=str(server_round),
            )
            for k in unknown
        ]
        for reply in grid.send_and_receive(query, timeout=self._timeout):
            node = reply.metadata.src_node_id
            if reply.has_error() or node not in client_of:
                LOG.warning("round %d: no rows from node %d", server_round, node)
                continue
            rows = _row_ids(reply, self.params)
            if isinstance(rows, str):  # left out of the round, like a node that failed
                LOG.warning("round %d: node %d: %s", server_round, node, rows)
                continue
            self._sampled_rows[client_of[node]] = rows

    @staticmethod
    def _log_rejection(rejection: Rejection) -> None:
        LOG.warning(
            "round %d: rejected client %d: %s", rejection.round, rejection.client, rejection.reason
        )

    # --- training ---------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self._round is None:
            raise FedsubError("SubmodelStrategy: call discover() before training")
        self._plan = self._round.begin(server_round)
        cohort, work = self._plan.cohort, self._plan.work
        if self._index is None:  # private heat: the sampled nodes' rows, for their download
            self._ask_rows(grid, cohort.clients.tolist(), server_round)
        self._sent = 0
        if self.on_progress is not None:
            self.on_progress({"round": server_round, "sent_to": cohort.clients.tolist()})
        messages, full = [], None
        chain = json.dumps(work.chain.describe())  # the ClientApp rebuilds it by name
        for member, client in enumerate(cohort.clients.tolist()):
            if self._index is None and client not in self._sampled_rows:
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
            record = RecordDict({"submodel": arrays, "config": settings})
            messages.append(
                Message(
                    record, self._node_of[client], MessageType.TRAIN, group_id=str(server_round)
                )
            )
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        assert self._plan is not None and self._round is not None
        cohort = self._plan.cohort
        position = {int(k): j for j, k in enumerate(cohort.clients)}
        updates: dict[int, ClientUpdate] = {}
        received = 0
        for reply in replies:
            if reply.has_error():
                LOG.warning(
                    "round %d: node %d failed: %s",
                    server_round,
                    reply.metadata.src_node_id,
                    reply.error.reason,
                )
                continue
            metrics = record_of(reply.content, "metrics", MetricRecord)
            client = int(number_of(metrics, "partition-id"))
            if client not in position or self._node_of.get(client) != reply.metadata.src_node_id:
                LOG.warning("round %d: unexpected reply for partition %d", server_round, client)
                continue
            deltas_in = record_of(reply.content, "deltas", ArrayRecord)
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
            weight = float(number_of(metrics, "num-examples"))
            updates[client] = ClientUpdate(client, weight, rows, deltas.tables, deltas.dense)
        left_out = sorted(set(position) - set(updates))
        self.evaluation.note_replies(set(position), left_out)
        for client in left_out:  # name the node and its partition: the operator's next step
            LOG.warning(
                "round %d: no update from node %d (partition %d)",
                server_round,
                self._node_of[client],
                client,
            )
        record: dict[str, object] = {
            "round": server_round,
            "sampled": len(position),
            "replies": len(updates),
            "left_out": left_out,
            "bytes_sent": self._sent,
            "bytes_received": received,
            "updated": False,
        }
        metrics = MetricRecord(
            {"replies": len(updates), "bytes-sent": self._sent, "bytes-received": received}
        )
        if len(updates) < self.min_replies:
            self._failed_in_a_row += 1
            reason = (
                f"{len(updates)} of {len(position)} sampled nodes replied, fewer than "
                f"min-replies = {self.min_replies} (missing partitions {left_out[:10]}); "
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
        self.rounds.append(record)
        if self.on_progress is not None:
            self.on_progress(record)

    # --- federated evaluation (flower/federated_eval.py) ------------------------------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.evaluation.messages(server_round, self.params, self._node_of)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.evaluation.aggregate(server_round, replies)

    def summary(self) -> None:
        LOG.info(
            "SubmodelStrategy: %s, %s payloads, %d clients per round, min %d replies",
            self.algorithm_name,
            self.payload,
            self.schedule.clients_per_round,
            self.min_replies,
        )
