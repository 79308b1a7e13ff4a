"""What a Flower run costs, per round and node: bytes each way, the nodes' and the server's time.

The in-process engine models a privacy level's messages (``privacy/private_rounds.Costs``); on
Flower they are real, so the ServerApp's ``MeteredGrid`` measures them as they pass, and each
ClientApp handler reports its own seconds (``with_seconds``). What is counted and where it lands
in ``flower-result.json``: docs/tutorials/flower.md, "Costs on Flower".
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord

COST = "cost"  # the reply record carrying a node's seconds
SETUP_TYPES = ("query.heat", "evaluate")  # not a training round's cost


def _value_bytes(value: object) -> int:
    """A config value's bytes as Flower counts them: 1 per bool, 8 per number, the length of a
    text or bytes; a list is the sum of its items (an empty list: 0)."""
    if isinstance(value, list):
        return sum(_value_bytes(v) for v in value)
    if isinstance(value, bool):
        return 1
    if isinstance(value, (str, bytes)):
        return len(value)
    return 8


def record_bytes(record: object) -> int:
    """Bytes of one record: ``count_bytes`` for arrays and metrics; for a ConfigRecord the same
    count, item by item (Flower 1.41's own fails on an empty list, e.g. an empty row union)."""
    if isinstance(record, ConfigRecord):
        return sum(len(k) + _value_bytes(v) for k, v in record.items())
    if isinstance(record, (ArrayRecord, MetricRecord)):
        return record.count_bytes()
    return 0


def message_bytes(message: Message) -> int:
    """Bytes of a message's records (arrays, configs, metrics), as Flower counts them."""
    if message.has_error():
        return 0
    return sum(record_bytes(record) for record in message.content.values())


def with_seconds(handler: Callable[[Message, Context], Message]) -> Callable:
    """A ClientApp handler whose reply also says how long the node worked on it."""

    @functools.wraps(handler)
    def timed(message: Message, context: Context) -> Message:
        started = time.perf_counter()
        reply = handler(message, context)
        reply.content[COST] = MetricRecord({"seconds": time.perf_counter() - started})
        return reply

    return timed


def wave_kind(message: Message) -> str:
    """A message's type, and the secure sum's stage it asks for (``type:stage``)."""
    kind = message.metadata.message_type
    heat = message.content.get("heat") if not message.has_error() else None
    stage = heat.get("stage") if isinstance(heat, ConfigRecord) else None
    return f"{kind}:{stage}" if isinstance(stage, str) else kind


class MeteredGrid:
    """A Flower ``Grid`` (or a test's stand-in) that measures every message it carries."""

    def __init__(self, grid: Any) -> None:
        self.grid = grid
        self._types: dict[str, str] = {}  # message id -> its type, until its reply comes
        self._round = self._fresh()
        self.totals: dict[str, dict[str, int]] = defaultdict(lambda: {"down": 0, "up": 0})

    @staticmethod
    def _fresh() -> dict[str, Any]:
        return {
            "down": defaultdict(int),
            "up": defaultdict(int),
            "seconds": defaultdict(float),
            "cpu": time.process_time(),
            "wall": time.monotonic(),
            "waves": [],  # each push: what it sent, when, its message ids, its last reply
        }

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def _sent(self, messages: Iterable[Message]) -> list[Message]:
        messages = list(messages)
        for m in messages:
            kind, size = m.metadata.message_type, message_bytes(m)
            self.totals[kind]["down"] += size
            if kind not in SETUP_TYPES:
                self._round["down"][m.metadata.dst_node_id] += size
        return messages

    def _received(self, replies: Iterable[Message]) -> list[Message]:
        replies = list(replies)
        for r in replies:
            kind, size = r.metadata.message_type, message_bytes(r)
            self.totals[kind]["up"] += size
            if kind in SETUP_TYPES:
                continue
            node = r.metadata.src_node_id
            self._round["up"][node] += size
            cost = None if r.has_error() else r.content.get(COST)
            seconds = cost.get("seconds") if isinstance(cost, MetricRecord) else None
            if isinstance(seconds, float):
                self._round["seconds"][node] += seconds
        return replies

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages, started = self._sent(messages), time.monotonic()
        ids = list(self.grid.push_messages(messages))
        kinds = sorted({wave_kind(m) for m in messages})
        wave = {"what": "+".join(kinds), "messages": len(messages), "started": started}
        self._round["waves"].append({**wave, "ids": set(ids), "replied": started})
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = self._received(self.grid.pull_messages(message_ids))
        now = time.monotonic()
        for reply in replies:
            asked = reply.metadata.reply_to_message_id
            for wave in self._round["waves"]:
                if asked in wave["ids"]:
                    wave["replied"] = now
        return replies

    def _waves(self, measured: dict[str, Any]) -> list[dict[str, Any]]:
        """Each wave of the round: what it sent (message types, a secure sum's stage riding
        with them after a colon), how many messages, and the seconds from its push to its
        last reply's pull."""
        return [
            {
                "what": w["what"],
                "messages": w["messages"],
                "seconds": round(w["replied"] - w["started"], 4),
            }
            for w in measured["waves"]
        ]

    def take(self, nodes: Iterable[int]) -> dict[str, Any]:
        """The costs since the last call: per node of ``nodes`` (the round's sampled nodes)
        bytes down and up and its seconds of work, their means, and the server's CPU and
        wall seconds."""
        measured, self._round = self._round, self._fresh()
        nodes = sorted(set(nodes))
        per_node = {
            str(n): {
                "bytes_down": measured["down"][n],
                "bytes_up": measured["up"][n],
                "client_seconds": round(measured["seconds"][n], 6),
            }
            for n in nodes
        }
        count = max(len(nodes), 1)
        return {
            "bytes_down_per_client": sum(measured["down"][n] for n in nodes) / count,
            "bytes_up_per_client": sum(measured["up"][n] for n in nodes) / count,
            "client_seconds_per_client": sum(measured["seconds"][n] for n in nodes) / count,
            "server_cpu_seconds": time.process_time() - measured["cpu"],
            "round_seconds": time.monotonic() - measured["wall"],
            "waves": self._waves(measured),
            "nodes": per_node,
        }
