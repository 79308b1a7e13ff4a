"""Features' own protocols carried as Flower Messages, without naming the feature: a protocol
is a ``Carried`` (fedsub/feature_messages.py: its action, the record its fields go under), its
node's side an ``Answer`` over the request's fields and the node's state, its server's side
asks through an ``Ask``. This module turns them into Messages: the server's requests as
``query.<action>`` Messages through the grid (``asker``), or riding with the round's other
messages (``ride``, ``riding``); a node's reply from its ``Answer``, its state in the
SuperNode's ``Context.state`` (``ContextState``, ``answer``); and everything the server
received, for a transcript (``Transcript``).

Privacy's protocols are carried so (privacy/heat_protocol.py: the private heat exchange;
privacy/secure_rows_protocol.py: the secure row sums); docs/develop/extending.md, "A
feature's Flower protocol".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fedsub.errors import FedsubError
from fedsub.feature_messages import Answer, Ask, Carried, Fields
from fedsub.flower.exchange import PushPullGrid, exchange
from fedsub.flower.records import packed, record_of, tensors_of

LOG = logging.getLogger("fedsub")

# (node id, stage, reply content): everything the server received, for a transcript
Recorder = Callable[[int, str, RecordDict], None]


def message_type(carried: Carried) -> str:
    """The Flower message type of ``carried``'s own messages: ``query.<action>``."""
    return f"{MessageType.QUERY}.{carried.action}"


def fields_of(content: RecordDict, record: str, who: str) -> ConfigRecord:
    """The protocol's fields in a message's ``content`` (its ConfigRecord ``record``); a
    ``FedsubError`` naming ``who`` when there are none."""
    if record not in content:
        raise FedsubError(f"{who}: not a {record} message (no {record!r} record)")
    try:
        return record_of(content, record, ConfigRecord)
    except FedsubError as error:
        raise FedsubError(f"{who}: {error}") from None


# ---- the node's side ---------------------------------------------------------------------


class ContextState:
    """A node's ``NodeState``: its SuperNode's ``Context.state`` (fields as a ConfigRecord,
    tensors as a packed ArrayRecord, each under its name)."""

    def __init__(self, context: Context) -> None:
        self.state = context.state

    def fields(self, name: str) -> Fields | None:
        if name not in self.state:
            return None
        return record_of(self.state, name, ConfigRecord)

    def keep_fields(self, name: str, fields: Mapping[str, object]) -> None:
        self.state[name] = ConfigRecord(dict(fields))  # type: ignore[arg-type]

    def tensors(self, name: str) -> dict[str, torch.Tensor] | None:
        if name not in self.state:
            return None
        return tensors_of(record_of(self.state, name, ArrayRecord))

    def keep_tensors(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        self.state[name] = packed(tensors)

    def forget(self, name: str) -> None:
        if name in self.state:
            del self.state[name]


def answer(message: Message, context: Context, carried: Carried, answer_of: Answer) -> Message:
    """The node's reply Message to ``message``: ``answer_of``'s fields for the request's
    (its ``carried.record``), its state the SuperNode's."""
    request = fields_of(message.content, carried.record, f"{carried.title} (this node)")
    reply = answer_of(request, ContextState(context))
    return Message(RecordDict({carried.record: ConfigRecord(reply)}), reply_to=message)


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


def stage_records(
    replies: Sequence[Message],
    asked: Collection[int],
    stage: str,
    carried: Carried,
    record: Recorder | None,
    alone: bool = True,
) -> dict[int, ConfigRecord]:
    """The valid fields of ``carried`` in ``replies`` from the nodes ``asked`` for ``stage``,
    by node; a reply that failed, came twice, from a node not asked, or without valid fields
    is left out, logged (a stage riding with other messages, ``alone`` False: failed and
    missing replies are their carrier's to log)."""
    name = carried.record
    replied: dict[int, ConfigRecord] = {}
    for reply in replies:
        node = reply.metadata.src_node_id
        if reply.has_error():
            if alone:
                LOG.warning(
                    "%s exchange, stage %s: node %d failed: %s", name, stage, node, reply.error
                )
            continue
        if record is not None:
            record(node, stage, reply.content)
        if node not in asked or node in replied:
            LOG.warning("%s exchange, stage %s: unexpected reply from node %d", name, stage, node)
            continue
        try:
            replied[node] = fields_of(reply.content, name, f"node {node}")
        except FedsubError as error:
            LOG.warning("%s exchange, stage %s: %s; left out", name, stage, error)
    for node in sorted(set(asked) - set(replied)) if alone else ():
        LOG.warning("%s exchange, stage %s: no reply from node %d; left out", name, stage, node)
    return replied


def asker(grid: PushPullGrid, timeout: float, record: Recorder | None, carried: Carried) -> Ask:
    """The stages of ``carried`` as its own Messages to the nodes through ``grid``, each wave
    waiting ``timeout`` seconds; ``record`` sees every reply the server receives."""

    def ask(requests: Mapping[int, dict], stage: str) -> dict[int, ConfigRecord]:
        kind = message_type(carried)
        messages = [
            Message(RecordDict({carried.record: ConfigRecord(fields)}), node, kind)
            for node, fields in requests.items()
        ]
        replies = exchange(grid, messages, timeout)
        return stage_records(replies, requests, stage, carried, record)

    return ask


def ride(messages: Sequence[Message], requests: Mapping[int, dict], carried: Carried) -> None:
    """A stage's requests riding with other messages (a round's request query, its train
    messages): each message to a node of ``requests`` also carries its fields."""
    for message in messages:
        fields = requests.get(message.metadata.dst_node_id)
        if fields is not None:
            message.content[carried.record] = ConfigRecord(fields)


def riding(
    replies: Sequence[Message],
    asked: Collection[int],
    stage: str,
    carried: Carried,
    record: Recorder | None,
) -> dict[int, ConfigRecord]:
    """The valid fields of ``carried`` riding with ``replies`` (to other messages) from the
    nodes ``asked``; what ``record`` keeps of them is that record alone (the carrier's reader
    keeps the rest)."""
    kept: Recorder | None = None
    name = carried.record
    if record is not None:
        kept = lambda node, stage, content: record(  # noqa: E731
            node, stage, RecordDict({name: content[name]}) if name in content else content
        )
    return stage_records(replies, asked, stage, carried, kept, alone=False)
