"""A round's training on Flower, as Messages: what each sampled node is sent (its rows X[S(k)] or,
with ``payload = "full"``, the whole model; the dense parameters, its learning rate, the round's
chain of client transforms by name and options), and its reply read back into a
``ClientUpdate``. The messages follow Flower's conventions (docs/tutorials/flower.md, "Flower
conventions").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedsub.engine.server_round import RoundPlan
from fedsub.errors import FedsubError
from fedsub.flower.private_download import reply_rows
from fedsub.flower.records import number_of, read_deltas, record_of, submodel_record
from fedsub.flower.settings import Payload
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import ClientUpdate, pull

RowsOf = Callable[[int], dict[str, torch.Tensor]]  # a client's S(k) by its position


def train_messages(
    plan: RoundPlan, params: Params, sent_to: dict[int, int], rows_of: RowsOf, payload: Payload
) -> tuple[list[Message], int]:
    """The round's train Messages to the nodes ``sent_to`` (node id -> cohort position), and
    the bytes of their model arrays."""
    work, r = plan.work, plan.round
    chain = json.dumps(work.chain.describe())  # the ClientApp rebuilds it by name
    member_of = {int(j): m for m, j in enumerate(plan.cohort.clients.tolist())}
    messages, full, sent = [], None, 0
    for node, client in sent_to.items():
        if payload == "full":  # the same whole model for everyone, built once
            arrays = full = full or ArrayRecord(params.state_dict())
        else:
            rows = rows_of(client)
            arrays = submodel_record(rows, pull(params, rows))
        lr = float(work.lr[member_of[client]])
        settings = ConfigRecord({"round": r, "lr": lr, "chain": chain})
        sent += arrays.count_bytes()
        record = RecordDict({"arrays": arrays, "config": settings})
        messages.append(Message(record, node, MessageType.TRAIN, group_id=str(r)))
    return messages, sent


@dataclass(frozen=True)
class ReplyReader:
    """How this run reads a train reply: the rows it was sent, whether it downloads
    privately (the reply names the held rows it requested), the payload, and whether the
    sample count stays inside the secure sum (``privacy.level = "full"``)."""

    rows_of: RowsOf
    downloading: bool
    payload: Payload
    counts_secret: bool

    def update(self, reply: Message, client: int, partition: int) -> tuple[ClientUpdate, int]:
        """The update of ``client`` (``partition``) from its reply, and the bytes of the reply's
        arrays; a ``FedsubError`` when the reply cannot be read (the node is then left out)."""
        metrics = record_of(reply.content, "metrics", MetricRecord)
        if (said := int(number_of(metrics, "partition-id"))) != partition:
            raise FedsubError(f"a train reply from partition {said}, sent to partition {partition}")
        deltas_in = record_of(reply.content, "arrays", ArrayRecord)
        deltas = read_deltas(deltas_in)
        rows = {t: r for t, r in self.rows_of(client).items() if t in deltas.tables}
        if self.downloading:  # the held rows it requested
            rows = reply_rows(reply, rows, client)
        elif self.payload == "full":  # full-size deltas: only S(k) can be non-zero
            deltas = Params(
                {t: d.index_select(0, rows[t]) for t, d in deltas.tables.items()}, deltas.dense
            )
        weight = 1.0  # at privacy full no count comes: the secure sum weights the deltas
        if not self.counts_secret:
            weight = float(number_of(metrics, "num-examples"))
        update = ClientUpdate(client, weight, rows, deltas.tables, deltas.dense)
        return update, deltas_in.count_bytes()
