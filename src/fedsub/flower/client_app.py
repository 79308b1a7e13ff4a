"""Flower ``ClientApp``: a node's side of fedsub's algorithms. It answers the ServerApp's
queries, trains the rows it receives on its own data (flower/node_data.py) and evaluates them
on its held-out samples: no sample leaves the node. ``make_client_app(FlowerSettings(...))``
fixes the settings in code; without them they are read from the run config."""

from __future__ import annotations

import json
import time
from logging import ERROR

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log as flwr_log

from fedsub.client.transforms import Chain
from fedsub.engine.features.private import node_requests
from fedsub.engine.sequential import train_submodel
from fedsub.errors import FedsubError
from fedsub.feature_messages import Answer, NodeFacts
from fedsub.flower.costs import with_seconds
from fedsub.flower.federated_eval import EVAL_INDEX, node_report
from fedsub.flower.node_data import NodeData, node_config_items, node_data
from fedsub.flower.protocols import ContextState, answer
from fedsub.flower.records import deltas_record, number_of, read_submodel, record_of, rows_record
from fedsub.flower.settings import FlowerSettings
from fedsub.numerics.float32 import ieee_float32
from fedsub.runs.run_setup import NODE_PROTOCOLS, NodeProtocol, heat_privacy_of
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import pull, push


def settings_of(fixed: FlowerSettings | None, context: Context) -> FlowerSettings:
    """The settings fixed in code (``fixed``), or else the run config's (both apps')."""
    return fixed if fixed is not None else FlowerSettings.from_run_config(dict(context.run_config))


class NodeDataError(FedsubError):
    """This node's data could not be read: what the server is told (the partition id and the
    kind of error, never the node's paths or values; the node's own log has the whole error)."""


def _own_data(fixed: FlowerSettings | None, context: Context) -> NodeData:
    """This node's data (for protocol stages: its spec was checked when it registered). An
    error reading it is logged here in full and reaches the server as a ``NodeDataError``
    (Flower sends the text of a ClientApp's exception to the ServerApp's log)."""
    settings = settings_of(fixed, context)  # the run's config: the server's, not the node's
    try:
        return node_data(settings, node_config_items(dict(context.node_config)))
    except (FedsubError, OSError, ValueError) as error:
        partition = str(context.node_config.get("partition-id", "?"))[:20]
        flwr_log(ERROR, "fedsub: this node's data cannot be read: %s", error)
        raise NodeDataError(
            f"partition-id={partition}: its data cannot be read ({type(error).__name__}); "
            "the node's log says why"
        ) from None


def _node(fixed: FlowerSettings | None, context: Context, message: Message) -> NodeData:
    """This node's data, checked against the run's feature spec named in the message."""
    node = _own_data(fixed, context)
    config = message.content.get("query", message.content.get("config"))
    run_version, run_hash = 0, ""
    if isinstance(config, ConfigRecord) and "spec-hash" in config:
        run_version, run_hash = int(number_of(config, "spec-version")), str(config["spec-hash"])
    node.check_spec(run_version, run_hash)
    return node


def answer_query(fixed: FlowerSettings | None, message: Message, context: Context) -> Message:
    """The node's partition, and (query "index") its sample count, index sets S(k) and
    evaluation rows, or (query "rows") its S(k) only: what the download of X[S(k)] reveals
    anyway; at privacy.level download (query "request") its download request for the
    round instead, never S(k) (privacy/download_protocol.py). A node whose
    privacy.heat_source is private refuses "index": its heat goes by query.heat."""
    node = _node(fixed, context, message)
    k = node.client
    query = record_of(message.content, "query", ConfigRecord)
    what = str(query.get("what", "index"))
    private = heat_privacy_of(node.config).source != "exact"
    if what not in ("index", "rows", "partition", "request"):
        raise FedsubError(f"partition {k}: unknown query {what!r}")
    requests = node_requests(node.schedule, k, node.rows, node.table_rows)
    downloading = requests is not None
    if what == "rows" and downloading:
        raise FedsubError(
            f"partition {k}: privacy.level = {node.config.privacy.level!r}, so this node "
            "sends a download request (query 'request'), never its rows S(k)"
        )
    if what == "request" and not downloading:
        raise FedsubError(
            f"partition {k}: privacy.level = {node.config.privacy.level!r} draws no "
            "private download request; ask for its rows"
        )
    if what == "index" and private:
        raise FedsubError(
            f"partition {k}: privacy.heat_source = {node.config.privacy.heat_source!r}, so "
            "this node does not send its index sets and sample count in the clear"
        )
    metrics = MetricRecord({"partition-id": k})
    content = RecordDict({"metrics": metrics})
    if what in ("index", "rows"):
        content["index"] = rows_record(node.rows)
    if requests is not None and what == "request":  # its request for the round, never S(k)
        round_index = int(number_of(query, "round"))
        content["index"] = rows_record(requests.request(round_index, ContextState(context)))
    if what == "index":
        metrics["num-examples"] = len(node.train)
        content[EVAL_INDEX] = rows_record(node.eval_rows())
    return Message(content, reply_to=message)


def answer_train(fixed: FlowerSettings | None, message: Message, context: Context) -> Message:
    """Local steps of fedsub's client work on the submodel received; reply row deltas."""
    settings = settings_of(fixed, context)
    node = _own_data(fixed, context)
    k = node.client
    rows, received = read_submodel(record_of(message.content, "arrays", ArrayRecord))
    own = {t: torch.from_numpy(r) for t, r in node.rows.items()}
    c = record_of(message.content, "config", ConfigRecord)
    round_index = int(number_of(c, "round"))
    requests = node_requests(node.schedule, k, node.rows, node.table_rows)
    state = ContextState(context)
    full = not rows
    request = requests.request(round_index, state) if requests is not None else {}
    if requests is not None:  # requested rows received, the other held rows skipped (zero)
        pulled = requests.submodel(rows, received, request)
    elif full:  # the whole model came: take S(k) locally
        pulled = pull(received, own)
    elif any(not torch.equal(rows[t], own[t]) for t in own):
        raise FedsubError(f"partition {k}: the rows received are not this node's S(k)")
    else:
        pulled = received
    chain = Chain.from_description(json.loads(str(c["chain"])))
    samples, lr = node.samples, float(number_of(c, "lr"))
    with ieee_float32():  # float32 means float32 on a node's GPU too, as in loop.train
        trained = train_submodel(
            node.model, pulled, samples, k, round_index, node.schedule, chain, lr
        )
    update = push(k, float(len(samples)), own, pulled, trained)
    table_deltas, dense_deltas, index = update.table_deltas, update.dense_deltas, None
    metrics = MetricRecord({"partition-id": k, "num-examples": len(samples)})
    if requests is not None:  # the held rows it requested, with their ids (the others skipped)
        deltas = Params(table_deltas, dense_deltas)
        kept, table_deltas, dense_deltas = requests.reply(request, deltas, round_index, state)
        if requests.counts_hidden:  # its count weights its deltas inside the secure sum
            del metrics["num-examples"]
        index = rows_record(kept)
    elif full:  # reply as stock FedAvg would: the whole table
        table_deltas = {
            t: torch.zeros_like(received.tables[t]).index_copy_(0, own[t], d)
            for t, d in table_deltas.items()
        }
    if settings.replies.train_delay:
        time.sleep(settings.replies.train_delay)
    content = RecordDict({"arrays": deltas_record(table_deltas, dense_deltas), "metrics": metrics})
    if index is not None:
        content["index"] = index
    return Message(content, reply_to=message)


def _answer_of(fixed: FlowerSettings | None, context: Context, protocol: NodeProtocol) -> Answer:
    """This node's answer to the stages of ``protocol`` (one of runs/run_setup.py's
    ``NODE_PROTOCOLS``), from its data and its copy of the run config."""
    node = _own_data(fixed, context)
    seeded = settings_of(fixed, context).dp_seeded_noise
    facts = NodeFacts(node.client, node.rows, node.table_rows, len(node.train))
    return protocol.answer(node.config, facts, seeded)


def with_riders(
    fixed: FlowerSettings | None, message: Message, context: Context, reply: Message
) -> Message:
    """``reply`` with the answer to a protocol's stage riding with ``message`` (at privacy
    full, the secure row sum's "advertise" rides with a round's request query and "share"
    with its train message: privacy/secure_rows_protocol.py), answered after the message
    itself: a node whose training fails sends no shares."""
    for protocol in NODE_PROTOCOLS:
        carried = protocol.carried
        if carried.rides and carried.record in message.content:
            answered = answer(message, context, carried, _answer_of(fixed, context, protocol))
            reply.content[carried.record] = answered.content[carried.record]
    return reply


def carry(app: ClientApp, fixed: FlowerSettings | None, protocol: NodeProtocol) -> None:
    """Answer ``protocol``'s own messages (``query.<action>``) on ``app``: each a stage of a
    feature's protocol (fedsub/feature_messages.py), answered by ``_answer_of``; a timed
    protocol's replies say how long the node worked."""
    carried = protocol.carried

    def stage(message: Message, context: Context) -> Message:
        return answer(message, context, carried, _answer_of(fixed, context, protocol))

    stage.__name__ = stage.__qualname__ = carried.action
    stage.__doc__ = f"One stage of the {carried.title} ({carried.action} messages)."
    app.query(carried.action)(with_seconds(stage) if carried.timed else stage)


def make_client_app(fixed: FlowerSettings | None = None) -> ClientApp:
    app = ClientApp()

    @app.query()
    @with_seconds
    def report_index(message: Message, context: Context) -> Message:
        """The node's registration or row query answer (``answer_query``)."""
        return with_riders(fixed, message, context, answer_query(fixed, message, context))

    for protocol in NODE_PROTOCOLS:  # the features' own (privacy's heat, secure row sums)
        carry(app, fixed, protocol)

    @app.train()
    @with_seconds
    def train(message: Message, context: Context) -> Message:
        """Local steps on the submodel received (``answer_train``)."""
        return with_riders(fixed, message, context, answer_train(fixed, message, context))

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        """Sums of the loss (and AUC histograms) of the rows received on this node's own
        held-out and training samples: no sample leaves the node."""
        node = _node(fixed, context, message)
        rows, received = read_submodel(record_of(message.content, "arrays", ArrayRecord))
        if not rows:  # the whole model came (a node that keeps its rows to itself)
            rows = {t: torch.arange(v.shape[0]) for t, v in received.tables.items()}
        report = node_report(node, rows, received)
        return Message(RecordDict({"metrics": report}), reply_to=message)

    return app
