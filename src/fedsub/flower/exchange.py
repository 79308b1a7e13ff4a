"""One wave of Messages: push them, then pull their replies with a short poll.

Flower's ``Grid.send_and_receive`` sleeps 3 s between pulls (``flwr.superlink.grid.HttpGrid``,
the Grid a ServerApp on a SuperLink gets), so every wave of messages (a round's training, an
evaluation, a rows query, a stage of the heat exchange) waited up to 3 s (1.5 s on average)
more than its slowest node. ``exchange`` pulls at once, after 0.05 s, then at intervals
growing to ``MAX_POLL``: a reply is seen within 0.2 s, and an idle wait costs the SuperLink
five small requests a second. (A SuperNode's own 3-s idle poll, fixed in Flower, still
delays the next wave's pickup on the nodes.)
Every place fedsub waits for replies (flower/server_runtime.py, flower/protocols.py and
what calls it) goes through it; flower/joining.py's registrations are pushed and pulled
separately, as they must not hold a round up.

When a node cannot answer (it stopped sending heartbeats, or left and its messages were
deleted), the SuperLink answers in its place: an error reply whose sender is the SuperLink's
own id (1) and whose ``reply_to_message_id`` names the message. ``attributed`` gives such a
reply the node it stands for, with a short reason saying the SuperLink wrote it, so that
every reader names the node (not "node 1") and counts its message as answered.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol

from flwr.app import Message
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

FIRST_POLL = 0.05  # seconds before the first pull: a fast node may already have replied
MAX_POLL = 0.2  # the longest pause between two pulls
GROWTH = 1.5  # each pause is this much longer than the last, up to MAX_POLL


# the SuperLink's own errors, said shortly (Flower's reasons run to three lines)
SUPERLINK_ERRORS = {
    ErrorCode.NODE_UNAVAILABLE: "node unavailable (no heartbeat)",
    ErrorCode.MESSAGE_UNAVAILABLE: "message unavailable (the node left, or it expired)",
    ErrorCode.REPLY_MESSAGE_UNAVAILABLE: "its reply expired",
}


def from_superlink(reply: Message) -> bool:
    """Whether ``reply`` is an error the SuperLink wrote (not the node's)."""
    return reply.has_error() and reply.metadata.src_node_id == SUPERLINK_NODE_ID


def attributed(reply: Message, node: int) -> Message:
    """``reply`` to a message sent to ``node``: an error Flower wrote in the node's place (its
    sender the SuperLink, ``from_superlink``, or the ServerApp's own grid, e.g. a reply whose
    objects could not be pulled) is given ``node`` as its sender and the reason "the
    SuperLink: <what>" (or "Flower: <reason>"); any other reply is returned as it is."""
    sender = reply.metadata.src_node_id
    if reply.has_error() and sender != node:
        error = reply.error
        if sender == SUPERLINK_NODE_ID:
            what = SUPERLINK_ERRORS.get(error.code, f"error {error.code}: {error.reason}")
            reason = f"the SuperLink: {what}"
        else:
            reason = f"Flower: {error.reason}"
        reply.metadata.__dict__["_src_node_id"] = node
        error.__dict__["_reason"] = reason
    return reply


class PushPullGrid(Protocol):
    """What ``exchange`` uses of a Flower ``Grid`` (a test may pass its own)."""

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str | None]: ...

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]: ...


def exchange(
    grid: PushPullGrid,
    messages: Iterable[Message],
    timeout: float | None,
    meanwhile: Callable[[], Iterable[int]] | None = None,
) -> list[Message]:
    """Push ``messages`` and return the replies received within ``timeout`` seconds (``None``:
    wait for all), in the order they arrived. Replies are matched to the messages by
    ``reply_to_message_id``, as Flower's ``send_and_receive`` does; a message the SuperLink
    did not accept (its id ``None``) gets no reply. ``meanwhile`` is called after each pull
    that leaves replies missing (other work while the wave waits); it returns the nodes
    whose replies are no longer awaited."""
    messages = list(messages)
    # Flower's grids return one id per message (None if refused), or none at all when the
    # SuperLink refused the whole push (too large): nothing to wait for then
    pushed = zip(grid.push_messages(messages), messages, strict=False)
    node_of = {i: m.metadata.dst_node_id for i, m in pushed if i is not None}
    waiting = set(node_of)
    deadline = None if timeout is None else time.monotonic() + timeout
    replies: list[Message] = []
    pause = FIRST_POLL
    while waiting:  # a first pull at once: a grid in process (a test's) has answered already
        for reply in grid.pull_messages(sorted(waiting)):
            asked = reply.metadata.reply_to_message_id
            if asked not in waiting:  # not one of ours, or answered already
                continue
            replies.append(attributed(reply, node_of[asked]))
            waiting.discard(asked)
        if waiting and meanwhile is not None:
            given_up = set(meanwhile())
            waiting = {i for i in waiting if node_of[i] not in given_up}
        left = None if deadline is None else deadline - time.monotonic()
        if not waiting or (left is not None and left <= 0):
            break
        time.sleep(pause if left is None else min(pause, left))
        pause = min(pause * GROWTH, MAX_POLL)
    return replies
