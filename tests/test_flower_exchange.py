"""fedsub.flower.exchange: a wave of messages pushed, its replies pulled with a short poll
until all arrived or the timeout (on a fake clock: no test waits)."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fedsub.flower import exchange as exchange_lib
from fedsub.flower.exchange import FIRST_POLL, MAX_POLL, exchange

pytestmark = pytest.mark.usefixtures("flower_task_identity")


class Clock:
    """``time.monotonic`` and ``time.sleep`` of the module under test: sleeping moves it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pauses: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


class TimedGrid:
    """Each node replies ``delay[node]`` seconds after the push (never if absent); node 0's
    message is refused by the SuperLink (its id is None, as Flower's grids return it)."""

    def __init__(self, clock: Clock, delay: dict[int, float]) -> None:
        self.clock, self.delay = clock, delay
        self.due: dict[str, tuple[float, Message]] = {}
        self.pulls: list[list[str]] = []

    def push_messages(self, messages) -> list[str | None]:
        ids: list[str | None] = []
        for m in messages:
            node = m.metadata.dst_node_id
            if node == 0:
                ids.append(None)
                continue
            m.metadata.__dict__["_message_id"] = f"to-{node}"
            ids.append(m.metadata.message_id)
            if node in self.delay:
                reply = Message(RecordDict({"r": ConfigRecord({"node": node})}), reply_to=m)
                self.due[m.metadata.message_id] = (self.clock.now + self.delay[node], reply)
        return ids

    def pull_messages(self, message_ids) -> list[Message]:
        ids = list(message_ids)
        self.pulls.append(ids)
        ready = [i for i in ids if i in self.due and self.due[i][0] <= self.clock.now]
        return [self.due.pop(i)[1] for i in ready]


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(exchange_lib.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(exchange_lib.time, "sleep", fake.sleep)
    return fake


def messages(*nodes: int) -> list[Message]:
    return [Message(RecordDict(), n, MessageType.TRAIN) for n in nodes]


def senders(replies: list[Message]) -> list[int]:
    return [int(r.content["r"]["node"]) for r in replies]  # type: ignore[call-overload]


def test_returns_once_every_reply_arrived_pulling_at_growing_short_intervals(clock):
    grid = TimedGrid(clock, {1: 0.01, 2: 1.0, 3: 0.3})
    replies = exchange(grid, messages(1, 2, 3), timeout=600.0)
    assert senders(replies) == [1, 3, 2]  # in the order they arrived
    assert clock.pauses[0] == FIRST_POLL and max(clock.pauses) == MAX_POLL
    assert clock.pauses == sorted(clock.pauses)  # growing, then capped
    assert 1.0 <= clock.now < 1.0 + MAX_POLL  # seen within one pause of the last reply
    assert grid.pulls[-1] == ["to-2"]  # only the messages still waiting are pulled


def test_stops_at_the_timeout_with_the_replies_received(clock):
    grid = TimedGrid(clock, {1: 0.1, 2: 5.0})  # node 3 never replies
    replies = exchange(grid, messages(1, 2, 3), timeout=1.0)
    assert senders(replies) == [1]
    assert clock.now == pytest.approx(1.0)  # the last pause is cut to the deadline
    assert grid.pulls[-1] == ["to-2", "to-3"]  # pulled once more at the deadline


def test_a_message_the_superlink_refused_is_not_waited_for(clock):
    grid = TimedGrid(clock, {1: 0.0})
    assert senders(exchange(grid, messages(0, 1), timeout=600.0)) == [1]
    assert clock.now == 0.0  # a reply already there is taken at once
    assert exchange(grid, [], timeout=600.0) == [] and grid.pulls == [["to-1"]]  # no wave


def test_meanwhile_runs_while_replies_are_missing_and_may_give_up_on_nodes(clock):
    grid = TimedGrid(clock, {1: 0.1})  # nodes 2 and 3 never reply
    calls: list[float] = []

    def meanwhile() -> set[int]:
        calls.append(clock.now)
        return {2} if clock.now > 0.5 else set()  # node 2 is no longer awaited

    replies = exchange(grid, messages(1, 2, 3), timeout=2.0, meanwhile=meanwhile)
    assert senders(replies) == [1] and clock.now == pytest.approx(2.0)
    assert grid.pulls[-1] == ["to-3"] and len(calls) == len(grid.pulls)
    grid = TimedGrid(clock, {1: 0.1})
    start = clock.now
    exchange(grid, messages(1, 2), timeout=600.0, meanwhile=lambda: {2})
    assert clock.now - start < 1.0  # nobody left to wait for


def test_an_error_flower_wrote_for_a_node_is_named_as_that_nodes_and_flowers():
    """The SuperLink answers for a node that cannot (sender id 1): the reply is given the
    node the message went to, its reason says the SuperLink wrote it; an error the ServerApp's
    grid wrote (another sender) says Flower; the node's own error and replies stay as sent."""
    from flwr.app import Error
    from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

    from fedsub.flower.exchange import attributed

    from .flower_rounds import wide

    node = wide(100)
    asked = Message(RecordDict(), node, MessageType.QUERY)

    def reply(error: Error | None, sender: int) -> Message:
        answer = Message(error, reply_to=asked) if error else Message(RecordDict(), reply_to=asked)
        answer.metadata.__dict__["_src_node_id"] = sender
        return answer

    gone = attributed(reply(Error(ErrorCode.MESSAGE_UNAVAILABLE, "Error: ..."), 1), node)
    assert gone.metadata.src_node_id == node and SUPERLINK_NODE_ID == 1
    assert gone.error.reason == "the SuperLink: message unavailable (the node left, or it expired)"
    pulled = attributed(reply(Error(ErrorCode.MESSAGE_UNAVAILABLE, "objects missing"), 0), node)
    assert (pulled.metadata.src_node_id, pulled.error.reason) == (node, "Flower: objects missing")
    own = attributed(reply(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "mine"), node), node)
    assert own.error.reason == "mine"
    fine = attributed(reply(None, node), node)
    assert not fine.has_error() and fine.metadata.src_node_id == node
