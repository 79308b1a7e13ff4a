"""fedsub/feature_messages.py and its Flower carrier, flower/protocols.py: a protocol written
against the neutral types alone (here a toy one, a running sum of each node's numbers, which
no fedsub feature is) is carried as Flower Messages as privacy's are; a node's state lives
in its ``Context.state``, riding fields travel with other messages, and what the server
reads is checked. The privacy protocols' own tests: tests/test_flower_heat_exchange.py,
tests/test_flower_private_download.py, tests/test_flower_dp.py."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fedsub.errors import FedsubError
from fedsub.feature_messages import Carried, Fields, NodeState
from fedsub.flower import protocols as carrier

pytestmark = pytest.mark.usefixtures("flower_task_identity")

TALLY = Carried("tally", "tally", "tally", rides=True)


def tally(request: Fields, state: NodeState) -> dict:
    """The toy protocol's node: adds the request's ``add`` to its running total (kept as
    fields) and keeps the numbers seen (kept as tensors); replies its total."""
    kept = state.fields("total")
    total = 0 if kept is None else int(kept["value"])  # type: ignore[call-overload]
    add = request["add"]
    assert isinstance(add, int)
    seen = state.tensors("seen") or {"numbers": torch.zeros(0, dtype=torch.int64)}
    state.keep_tensors("seen", {"numbers": torch.cat([seen["numbers"], torch.tensor([add])])})
    if request.get("stage") == "forget":
        state.forget("total")
        return {"total": total + add}
    state.keep_fields("total", {"value": total + add})
    return {"total": total + add}


class Nodes:
    """A grid whose nodes answer the toy protocol at once, each with its own Context."""

    def __init__(self, nodes: Iterable[int]) -> None:
        self.contexts = {n: Context(1, n, {}, RecordDict(), {}) for n in nodes}
        self.replies: dict[str, Message] = {}
        self.types: list[str] = []

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for i, message in enumerate(messages):
            message.metadata.__dict__["_message_id"] = f"m{len(self.replies)}-{i}"
            node = message.metadata.dst_node_id
            self.types.append(message.metadata.message_type)
            reply = carrier.answer(message, self.contexts[node], TALLY, tally)
            self.replies[message.metadata.message_id] = reply
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(i) for i in message_ids if i in self.replies]


def test_a_protocol_no_feature_names_is_carried_with_its_node_state():
    nodes = Nodes([7, 9])
    transcript = carrier.Transcript()
    ask = carrier.asker(nodes, 1.0, transcript, TALLY)
    assert ask({7: {"add": 2}, 9: {"add": 5}}, "first") == {7: {"total": 2}, 9: {"total": 5}}
    assert ask({7: {"add": 3}}, "second") == {7: {"total": 5}}  # node 7's state persisted
    assert nodes.types == [f"{MessageType.QUERY}.tally"] * 3
    state = nodes.contexts[7].state
    assert isinstance(state["total"], ConfigRecord) and state["total"]["value"] == 5
    assert isinstance(state["seen"], ArrayRecord)  # tensors kept as a packed ArrayRecord
    seen = carrier.ContextState(nodes.contexts[7]).tensors("seen")
    assert seen is not None and seen["numbers"].tolist() == [2, 3]
    assert ask({7: {"add": 1, "stage": "forget"}}, "third") == {7: {"total": 6}}
    assert "total" not in nodes.contexts[7].state  # forgotten
    assert [(e["node"], e["stage"]) for e in transcript.entries] == [
        (7, "first"),
        (9, "first"),
        (7, "second"),
        (7, "third"),
    ]
    assert transcript.entries[0]["records"] == {"tally": {"total": 2}}


def test_fields_ride_with_other_messages_and_are_read_back_alone():
    sent = [Message(RecordDict({"query": ConfigRecord({"what": "x"})}), n, "query") for n in (1, 2)]
    carrier.ride(sent, {2: {"add": 4}}, TALLY)
    assert TALLY.record not in sent[0].content and dict(sent[1].content["tally"]) == {"add": 4}
    contexts = {n: Context(1, n, {}, RecordDict(), {}) for n in (1, 2)}
    replies = []
    for message in sent:  # the carrier's own reply, the riding answer added to it
        reply = Message(RecordDict({"metrics": ConfigRecord({"k": 1})}), reply_to=message)
        if TALLY.record in message.content:
            answered = carrier.answer(message, contexts[2], TALLY, tally)
            reply.content[TALLY.record] = answered.content[TALLY.record]
        reply.metadata.__dict__["_src_node_id"] = message.metadata.dst_node_id
        replies.append(reply)
    kept: list[tuple[int, str, list[str]]] = []
    read = carrier.riding(
        replies, {2}, "ride", TALLY, lambda n, s, c: kept.append((n, s, sorted(c.keys())))
    )
    assert read == {2: {"total": 4}}
    # the transcript keeps the riding record alone (node 1's reply holds none: kept as it is)
    assert kept == [(1, "ride", ["metrics"]), (2, "ride", ["tally"])]


def test_replies_without_the_protocols_fields_are_left_out_naming_the_node(caplog):
    request = Message(RecordDict(), 5, carrier.message_type(TALLY))
    request.metadata.__dict__["_message_id"] = "m"
    wrong = Message(RecordDict({"tally": ArrayRecord()}), reply_to=request)
    wrong.metadata.__dict__["_src_node_id"] = 5
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        assert carrier.stage_records([wrong], {5, 6}, "s", TALLY, None) == {}
    assert "tally exchange, stage s: node 5:" in caplog.text
    assert "no reply from node 6" in caplog.text
    with pytest.raises(FedsubError, match=r"tally \(this node\): not a tally message"):
        carrier.answer(request, Context(1, 5, {}, RecordDict(), {}), TALLY, tally)
