"""Private heat over Flower: fedsub's secure aggregation (and randomized response) carried as
``query.heat`` Messages between the ServerApp and the nodes, so the server never receives a
node's S(k).

The protocol runs without Flower (``privacy/secure_sum.py``'s stages, the messages checked in
``privacy/secagg_records.py``); this module only carries it. A node's protocol state (its
private keys, the shares it received) stays in its Flower ``Context.state``.
docs/tutorials/flower.md, "Private heat on Flower".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fedsub.engine.membership import Membership
from fedsub.errors import FedsubError
from fedsub.flower.exchange import PushPullGrid, exchange
from fedsub.flower.records import record_of, tensors_of
from fedsub.privacy import secure_sum
from fedsub.privacy.heat_report import HeatReport, PrivateHeatStage
from fedsub.privacy.heat_sources import HeatPrivacy
from fedsub.privacy.heat_vectors import MeasuredHeat
from fedsub.privacy.secagg_records import (  # noqa: F401  (flower/secure_rows.py's)
    HeatMessageError,
    int_list_field,
    number_field,
    text_field,
)
from fedsub.submodel.heat import HeatKind

LOG = logging.getLogger("fedsub")
MESSAGE_TYPE = f"{MessageType.QUERY}.heat"
RECORD = "heat"  # the ConfigRecord of every heat message, both ways
STATE = "fedsub.heat-exchange"  # the node's protocol state in Context.state

# (node id, stage, reply content): everything the server received, for a transcript
Recorder = Callable[[int, str, RecordDict], None]


def _heat_record(content: RecordDict, who: str) -> ConfigRecord:
    if RECORD not in content:
        raise HeatMessageError(f"{who}: not a heat message (no {RECORD!r} record)")
    try:
        return record_of(content, RECORD, ConfigRecord)
    except FedsubError as error:
        raise HeatMessageError(f"{who}: {error}") from None


# ---- the node's side ---------------------------------------------------------------------


def answer_heat(
    message: Message,
    context: Context,
    privacy: HeatPrivacy,
    kind: HeatKind,
    table_rows: Mapping[str, int],
    rows: Mapping[str, np.ndarray],
    num_samples: int,
) -> Message:
    """A node's reply to one stage of the heat exchange (its ClientApp's ``query.heat``)."""
    who = "heat exchange (this node)"
    facts = (privacy, kind, table_rows, rows, num_samples, who)
    return _answer(message, context, lambda r, s: secure_sum.heat_reply(r, s, *facts), who)


def answer_secagg(
    message: Message,
    context: Context,
    source: str,
    vector: Callable[[ConfigRecord], np.ndarray],
    who: str,
) -> Message:
    """A node's reply to one stage of a secure sum over Flower (the heat exchange's, or the
    secure row sums' of flower/secure_rows.py): ``source`` is what this node agrees to sum,
    ``vector`` gives its uint32 input from the "mask" request."""
    reply = lambda r, s: secure_sum.secure_sum_reply(r, s, source, vector, who)  # noqa: E731
    return _answer(message, context, reply, who)


def _answer(message: Message, context: Context, reply_of: Callable, who: str) -> Message:
    """The reply Message to ``reply_of(request, state)``; the node's protocol state kept
    (or, once done, forgotten; a randomized-response "report" keeps none)."""
    request = _heat_record(message.content, who)
    state = record_of(context.state, STATE, ConfigRecord) if STATE in context.state else None
    reply, after = reply_of(request, state)
    if text_field(request, "stage", who) != "report":
        if after is None:
            del context.state[STATE]  # done: forget the keys
        else:
            context.state[STATE] = ConfigRecord(dict(after))
    return Message(RecordDict({RECORD: ConfigRecord(reply)}), reply_to=message)


# ---- what the server received -------------------------------------------------------------


def _plain(value: object) -> object:
    """A record value as JSON: bytes as {"bytes": hex}, lists element-wise."""
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class Transcript:
    """A ``Recorder`` keeping, as JSON-able data, every reply the server received: its node,
    stage, and each record's values (arrays as lists with their dtype, bytes as hex)."""

    def __init__(self) -> None:
        self.entries: list[dict] = []

    def __call__(self, node: int, stage: str, content: RecordDict) -> None:
        records: dict[str, dict] = {}
        for name, record in content.items():
            if isinstance(record, ArrayRecord):
                try:  # a node's reply may hold any bytes: kept as what could not be read
                    tensors = tensors_of(record)
                except FedsubError as error:
                    records[name] = {"unreadable": str(error)}
                    continue
                records[name] = {
                    key: {"dtype": str(array.dtype), "array": array.numpy().tolist()}
                    for key, array in tensors.items()
                }
            else:
                records[name] = {key: _plain(v) for key, v in dict(record).items()}
        self.entries.append({"node": node, "stage": stage, "records": records})


# ---- the server's side -------------------------------------------------------------------


def _ask(
    grid: PushPullGrid,
    requests: Mapping[int, dict],
    stage: str,
    timeout: float,
    record: Recorder | None,
    message_type: str = MESSAGE_TYPE,
) -> dict[int, ConfigRecord]:
    """Send each node its request; the valid heat records of the replies by node."""
    messages = [
        Message(RecordDict({RECORD: ConfigRecord(fields)}), node, message_type)
        for node, fields in requests.items()
    ]
    return heat_records(exchange(grid, messages, timeout), requests, stage, record)


def ride(messages: Sequence[Message], requests: Mapping[int, dict]) -> None:
    """A stage's requests riding with other messages (a round's request query, its train
    messages): each message to a node of ``requests`` also carries its heat record."""
    for message in messages:
        fields = requests.get(message.metadata.dst_node_id)
        if fields is not None:
            message.content[RECORD] = ConfigRecord(fields)


def heat_records(
    replies: Sequence[Message],
    asked: Collection[int],
    stage: str,
    record: Recorder | None,
    alone: bool = True,
) -> dict[int, ConfigRecord]:
    """The valid heat records of ``replies`` from the nodes ``asked`` for ``stage``, by node;
    a reply that failed, came twice, from a node not asked, or without a valid record is left
    out, logged (a stage riding with other messages, ``alone`` False: failed and missing
    replies are their carrier's to log)."""
    replied: dict[int, ConfigRecord] = {}
    for reply in replies:
        node = reply.metadata.src_node_id
        if reply.has_error():
            if alone:
                LOG.warning("heat exchange, stage %s: node %d failed: %s", stage, node, reply.error)
            continue
        if record is not None:
            record(node, stage, reply.content)
        if node not in asked or node in replied:
            LOG.warning("heat exchange, stage %s: unexpected reply from node %d", stage, node)
            continue
        try:
            replied[node] = _heat_record(reply.content, f"node {node}")
        except HeatMessageError as error:
            LOG.warning("heat exchange, stage %s: %s; left out", stage, error)
    for node in sorted(set(asked) - set(replied)) if alone else ():
        LOG.warning("heat exchange, stage %s: no reply from node %d; left out", stage, node)
    return replied


def asker(
    grid: PushPullGrid, timeout: float, record: Recorder | None, message_type: str = MESSAGE_TYPE
) -> secure_sum.Ask:
    """The stages of a secure sum (``fedsub.privacy.secure_sum``) as ``message_type``
    Messages to the nodes through ``grid``: the heat exchange's, and the secure row sums'
    of flower/secure_rows.py."""
    return lambda requests, stage: _ask(grid, requests, stage, timeout, record, message_type)


def collect_heat(
    grid: PushPullGrid,
    nodes: Sequence[int],
    privacy: HeatPrivacy,
    kind: HeatKind,
    table_rows: Mapping[str, int],
    timeout: float,
    record: Recorder | None = None,
) -> HeatReport:
    """The heat of ``nodes``' rows by the private source ``privacy.source``, over Flower;
    ``record`` sees every reply the server receives (``secure_sum.measure_heat``)."""
    return secure_sum.measure_heat(asker(grid, timeout, record), nodes, privacy, kind, table_rows)


class HeatExchange(PrivateHeatStage):
    """Where a Flower run's heat comes from (``privacy.heat_source``): the registered S(k)
    (exact), or the private exchange with the counted nodes (``private``), measured once and
    kept as a checkpoint stage (the runtime's ``private_heat``: a resumed run's comes from its
    checkpoint)."""

    def __init__(self, privacy: HeatPrivacy | None = None) -> None:
        self.privacy = privacy or HeatPrivacy()
        super().__init__(self.privacy.source)

    @property
    def private(self) -> bool:
        """Whether a private source measures the heat (no S(k) registered)."""
        return self.privacy.source != "exact"

    def measured(
        self,
        grid: PushPullGrid,
        membership: Membership,
        kind: HeatKind,
        timeout: float,
        record: Recorder | None = None,
    ) -> MeasuredHeat:
        """The heat of the exchange with every counted node of ``membership``, each of which
        must contribute (once: then, or after a resume, the report kept)."""
        if self.report is None:
            nodes = {k: membership.node_of(k) for k in membership.counted}
            tables = dict(membership.tables)
            report = collect_heat(
                grid, list(nodes.values()), self.privacy, kind, tables, timeout, record
            )
            missing = sorted(k for k, n in nodes.items() if n not in report.contributors)
            if missing:
                raise FedsubError(
                    f"Flower: heat exchange ({self.privacy.source}): no contribution from "
                    f"partition(s) {missing[:10]}; every registered partition must be in the "
                    "heat"
                )
            self.report = report
        return self.report.measured
