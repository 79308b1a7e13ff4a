"""A deployment's rounds as records, and its rule for rounds short of replies.

A runtime whose clients may fail (Flower's nodes) keeps one record per round: who was
sampled, who replied, who was left out, the bytes, what the step did, its costs. A round with
fewer than ``min_replies`` updates leaves the model unchanged (``RoundFailed``); after
``max_failed_rounds`` such rounds in a row the run stops (``RoundsFailed``). The records are
kept in checkpoints as the runtime's history, so a resumed run counts on; ``run_costs`` gives
the run's means of the rounds' costs. (The limits are
named as the Flower run config names them: ``min-replies``, ``max-failed-rounds``.)
"""

from __future__ import annotations

import logging
from typing import Any

from fedsub.engine.round_runtime import RoundFailed
from fedsub.errors import FedsubError

LOG = logging.getLogger("fedsub")


class RoundsFailed(FedsubError):
    """Too many consecutive rounds got fewer than ``min_replies`` replies."""

    def __init__(self, round_index: int, reason: str) -> None:
        super().__init__(f"round {round_index}: {reason}")
        self.round = round_index
        self.reason = reason


class RoundRecords:
    """The records of the rounds run (``rounds``) and of the round in progress."""

    def __init__(self, min_replies: int, max_failed_rounds: int) -> None:
        self.min_replies, self.max_failed_rounds = min_replies, max_failed_rounds
        self.rounds: list[dict] = []  # one record per round: replies, bytes, left out
        self.current: dict[str, Any] = {}
        self.failed_in_a_row = 0

    def judge(self, record: dict[str, Any]) -> RoundFailed | None:
        """Keep ``record`` as the round's; ``RoundFailed`` when fewer than ``min_replies`` of
        its sampled clients replied (its replies, left_out and available say who)."""
        self.current = record
        if record["replies"] >= self.min_replies:
            self.failed_in_a_row = 0
            return None
        self.failed_in_a_row += 1
        reason = (
            f"{record['replies']} of {record['sampled']} sampled nodes replied, fewer than "
            f"min-replies = {self.min_replies} (missing partitions "
            f"{record['left_out'][:10]}; {record['available']} client(s) available); "
            f"{self.failed_in_a_row} such round(s) in a row, "
            f"max-failed-rounds = {self.max_failed_rounds}"
        )
        LOG.warning("round %d: %s: model unchanged", record["round"], reason)
        record["failed"] = reason
        return RoundFailed(reason)

    def close(self, updated: bool, diverged: str | None, costs: dict | None) -> dict[str, Any]:
        """The round's record, finished (what the step did, its costs) and kept."""
        record = self.current
        record["updated"] = updated
        if diverged is not None:
            record["diverged"] = diverged
        if costs is not None:
            record["costs"] = costs
        self.rounds.append(record)
        return record

    def stop_if_failing(self, round_index: int) -> None:
        """``RoundsFailed`` after ``max_failed_rounds`` failed rounds in a row."""
        record = self.rounds[-1]
        if "failed" in record and self.failed_in_a_row >= self.max_failed_rounds:
            raise RoundsFailed(round_index, record["failed"])

    def history(self) -> list[dict]:
        return [{"record": record} for record in self.rounds]

    def restore_history(self, history: list[dict]) -> None:
        self.rounds = [entry["record"] for entry in history if "record" in entry]
        self.failed_in_a_row = 0
        for record in reversed(self.rounds):  # the failed rounds in a row at the end
            if "failed" not in record:
                break
            self.failed_in_a_row += 1


def round_line(record: dict, rounds: int) -> str:
    """A round's record as one line of a log (``flwr run --stream`` shows Flower's)."""
    line = (
        f"fedsub round {record['round']}/{rounds}: {record['replies']} of {record['sampled']} "
        f"sampled nodes replied"
    )
    if record["left_out"]:
        line += f", partitions left out: {record['left_out'][:10]}"
    if "failed" in record:
        line += f"; model unchanged ({record['failed']})"
    elif "diverged" in record:
        line += f"; diverged: {record['diverged']}"
    else:
        line += "; model updated" if record["updated"] else "; model unchanged"
    if "epsilon" in record:  # [dp]: spent so far, every round
        line += f"; epsilon {record['epsilon']:.4g}"
    return line


def run_costs(rounds: list[dict], totals: dict[str, dict[str, int]]) -> dict[str, Any]:
    """The run's means per client and round (over the rounds with costs), as in-process
    ``privacy.json`` reports them, and the bytes by message type over the whole run."""
    costed = [r["costs"] for r in rounds if "costs" in r]
    count = max(len(costed), 1)

    def mean(key: str) -> float:
        return sum(c[key] for c in costed) / count

    return {
        "rounds": len(costed),
        "bytes_up_per_client_round": mean("bytes_up_per_client"),
        "bytes_down_per_client_round": mean("bytes_down_per_client"),
        "client_seconds_per_client_round": mean("client_seconds_per_client"),
        "server_cpu_seconds_per_round": mean("server_cpu_seconds"),
        "round_seconds": mean("round_seconds"),
        "bytes_by_message_type": {k: dict(v) for k, v in sorted(totals.items())},
    }
