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
from fedsub.flower.records import (
    count_of,
    packed,
    read_deltas,
    record_of,
    reply_row_ids,
    submodel_record,
    tensors_of,
)
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
            arrays = full = full or packed(params.state_dict())
        else:
            rows = rows_of(client)
            arrays = submodel_record(rows, pull(params, rows))
        lr = float(work.lr[member_of[client]])
        settings = ConfigRecord({"round": r, "lr": lr, "chain": chain})
        sent += arrays.count_bytes()
        record = RecordDict({"arrays": arrays, "config": settings})
        messages.append(Message(record, node, MessageType.TRAIN, group_id=str(r)))
    return messages, sent


def requested_rows(
    reply: Message, request: dict[str, torch.Tensor], client: int
) -> dict[str, torch.Tensor]:
    """The row ids of a reply's deltas (a node that downloads privately replies its
    requested held rows only), checked to be rows the node requested."""
    try:
        rows = reply_row_ids(reply, request)
    except FedsubError as error:
        raise FedsubError(f"partition {client}: {error}") from None
    if not all(bool(torch.isin(r, request[t]).all()) for t, r in rows.items()):
        raise FedsubError(f"partition {client}: its reply updates rows it did not request")
    return rows


@dataclass(frozen=True)
class ReplyReader:
    """How this run reads a train reply: the rows it was sent, whether it downloads
    privately (the reply names the held rows it requested), the payload, and whether the
    sample count stays inside the secure sum (``privacy.level = "full"``)."""

    rows_of: RowsOf
    downloading: bool
    payload: Payload
    counts_secret: bool

    def update(
        self,
        reply: Message,
        client: int,
        partition: int,
        model: Params,
        examples: int = 0,
        round_index: int | None = None,
    ) -> tuple[ClientUpdate, int]:
        """The update of ``client`` (``partition``, which registered ``examples`` samples; 0:
        not known) from its reply to round ``round_index``'s message, and the bytes of the
        reply's arrays; a ``FedsubError`` saying what is wrong when the reply cannot be read
        or does not fit ``model`` (the node is then left out of the round: a node's garbage
        never reaches the aggregation)."""
        group = reply.metadata.group_id
        if round_index is not None and group != str(round_index):
            raise FedsubError(f"a reply for round {group[:20]!r}, not round {round_index}")
        metrics = record_of(reply.content, "metrics", MetricRecord)
        if (said := count_of(metrics, "partition-id")) != partition:
            raise FedsubError(f"a train reply from partition {said}, sent to partition {partition}")
        deltas_in = record_of(reply.content, "arrays", ArrayRecord)
        flat = tensors_of(deltas_in)
        unknown = sorted(k for k in flat if not k.startswith(("table.", "dense.")))
        if unknown:
            raise FedsubError(f"its arrays {_names(unknown)} are not the model's")
        deltas = read_deltas(deltas_in)
        rows = self.rows_of(client)
        if self.downloading:  # the held rows it requested
            rows = requested_rows(reply, rows, client)
        full = self.payload == "full" and not self.downloading
        fits(deltas, rows, model, full)
        if full:  # full-size deltas: only S(k) can be non-zero
            deltas = Params(
                {t: d.index_select(0, rows[t]) for t, d in deltas.tables.items()}, deltas.dense
            )
        weight = 1.0  # at privacy full no count comes: the secure sum weights the deltas
        if not self.counts_secret:
            count = count_of(metrics, "num-examples")
            if examples and count != examples:
                raise FedsubError(f"num-examples {count}, but it registered {examples} samples")
            weight = float(count)
        update = ClientUpdate(client, weight, rows, deltas.tables, deltas.dense)
        return update, deltas_in.count_bytes()


def fits(deltas: Params, rows: dict[str, torch.Tensor], model: Params, full: bool) -> None:
    """Check a reply's deltas against the model: every table and dense parameter of it, no
    other; each of the model's dtype, its rows (``rows``; ``full``: the whole table) and its
    other dimensions. A ``FedsubError`` naming the first that does not fit."""
    for kind, given, own in (
        ("table", deltas.tables, model.tables),
        ("dense", deltas.dense, model.dense),
    ):
        if set(given) != set(own):
            missing, extra = sorted(set(own) - set(given)), sorted(set(given) - set(own))
            raise FedsubError(
                f"its {kind} deltas are not the model's (missing {_names(missing)}, "
                f"unexpected {_names(extra)})"
            )
        for name, delta in given.items():
            expected = list(own[name].shape)
            if kind == "table" and not full:
                expected[0] = len(rows[name])
            if list(delta.shape) != expected or delta.dtype != own[name].dtype:
                raise FedsubError(
                    f"its {kind} delta {name[:40]!r} is {_shape(delta)}, expected "
                    f"{tuple(expected)} {own[name].dtype}"
                )


def _shape(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {tensor.dtype}"


def _names(names: list[str], most: int = 5) -> str:
    """A few names, cut short (a reply may name anything)."""
    shown = [n[:40] for n in names[:most]]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{shown}{more}"
