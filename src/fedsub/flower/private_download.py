"""``privacy.level = download`` on Flower: asked for its rows, a node answers its *request*
(never its S(k)); the server sends the requested rows, the node skips every held row left out
of them, replies the deltas of the rows it requested, and row sums are divided by p. Each step
is the in-process code's (``privacy/requests.py``, ``privacy/requested_rows.py``,
``privacy/private_rounds.py``), so the two runs agree round by round and a node keeps no state
across rounds. docs/tutorials/flower.md, "Private submodel learning on Flower".
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message

from fedsub.algorithms.aggregation import Aggregation, ServerUpdate, aggregate
from fedsub.engine.schedule import Schedule
from fedsub.errors import FedsubError
from fedsub.flower.node_data import NodeData
from fedsub.flower.records import record_of, reply_row_ids
from fedsub.numerics import secret_streams
from fedsub.numerics.seeding import Secret, Seed
from fedsub.privacy.levels import Privacy, describe
from fedsub.privacy.private_rounds import unbias
from fedsub.privacy.requested_rows import local_submodel, reply_record
from fedsub.privacy.requests import client_request
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import CohortUpdate

SECRET = "fedsub.request-secret"  # the node's request secret in its run state


def downloads_privately(schedule: Schedule) -> bool:
    """Whether the run's clients download privately (privacy.level: download or full)."""
    privacy = schedule.setting(Privacy)
    return privacy is not None and privacy.private_download


def node_downloads(node: NodeData) -> bool:
    """Whether this node downloads privately (its config's privacy.level: download or full)."""
    return downloads_privately(node.schedule)


def privacy_described(schedule: Schedule) -> dict:
    """The run's privacy level and its guarantees (privacy/levels.py's ``describe``; level
    none without [privacy])."""
    return describe(schedule.setting(Privacy) or Privacy())


def requested_submodel(
    node: NodeData,
    rows: dict[str, torch.Tensor],
    received: Params,
    request: dict[str, np.ndarray],
) -> Params:
    """The submodel this node trains: the requested rows it ``received`` (``rows``), every
    other held row skipped (privacy/requested_rows.py's ``local_submodel``)."""
    return local_submodel(node.rows, node.client, rows, received, request)


def requested_reply(
    node: NodeData, request: dict[str, np.ndarray], table_deltas: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The held rows this node requested and their deltas: what it replies (the others
    skipped; privacy/requested_rows.py's ``reply_record``)."""
    return reply_record(node.rows, request, table_deltas)


def node_key(node: NodeData, context: Context) -> Seed:
    """The key of this node's requests (privacy/randomness.py): its own secret, drawn from the
    operating system the first time and kept in its SuperNode's run state (``context.state``,
    which never leaves the node), so the request and train messages of a round draw the same
    request; with ``privacy.randomness = "seeded"``, ``train.seed``."""
    privacy = node.schedule.setting(Privacy)
    if privacy is None or privacy.randomness == "seeded":
        return node.schedule.seed
    if SECRET not in context.state:
        context.state[SECRET] = ConfigRecord({"secret": secret_streams.draw_secret().to_bytes()})
    record = record_of(context.state, SECRET, ConfigRecord)
    data = record.get("secret")
    if not isinstance(data, bytes):
        raise FedsubError(f"partition {node.client}: its request secret is not bytes")
    return Secret.from_bytes(data)


def node_request(node: NodeData, round_index: int, key: Seed) -> dict[str, np.ndarray]:
    """The rows this node requests in round ``round_index`` (table -> sorted row ids), drawn
    from ``key`` (``node_key``)."""
    privacy = node.schedule.setting(Privacy)
    if privacy is None:
        raise FedsubError(f"partition {node.client}: no privacy.level to draw a request with")
    return client_request(privacy, node.rows, node.table_rows, key, round_index, node.client)


def reply_rows(
    reply: Message, request: dict[str, torch.Tensor], client: int
) -> dict[str, torch.Tensor]:
    """The row ids of a download reply's deltas, checked to be rows the node requested."""
    try:
        rows = reply_row_ids(reply, request)
    except FedsubError as error:
        raise FedsubError(f"partition {client}: {error}") from None
    if not all(bool(torch.isin(r, request[t]).all()) for t, r in rows.items()):
        raise FedsubError(f"partition {client}: its reply updates rows it did not request")
    return rows


def download_combine(
    aggregation: Aggregation, schedule: Schedule
) -> Callable[[CohortUpdate], ServerUpdate]:
    """The round's aggregation: the algorithm's, row sums divided by p under randomized
    response (each held row reaches the server from a fraction p of its clients)."""
    privacy = schedule.setting(Privacy)
    keep = 1.0 if privacy is None else privacy.keep  # keep is 1 below level download
    return lambda update: unbias(aggregate(update, aggregation), keep)
