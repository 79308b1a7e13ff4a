"""``train.privacy = download`` on Flower: the same requests and aggregation as in process.

- **Node** (``node_request``): asked for its rows, a node at level ``download`` answers its
  *request* (``privacy/requests.py``: randomized response or size buckets, keyed by (seed,
  round, client) exactly as ``engine/private_rounds.py`` keys its clients), never its S(k).
- **Server**: sends the requested rows; the node's model over S(k) (``local_submodel``) takes
  the requested rows from the message and every held row left out of the request from the
  node's *local copy* (``Context.state``: the values it last received, at first the run's
  seeded initial model, which the node draws itself). The simulator reads the row's current
  global value instead, so the two agree whenever the copy is current: with size buckets
  (every held row is requested), with ``payload = full`` (the whole model comes), and in the
  first round a node takes part.
- **Reply** (``reply_record``): the deltas of the held rows it requested (as the simulator's
  ``restrict``) with their row ids, in the clear (this level hides the download only; at
  ``full`` they go into the secure sum instead, flower/secure_rows.py).
- **Aggregation** (``download_combine``): the algorithm's aggregate, row sums divided by p
  (``engine/private_rounds.unbias``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message

from fedsub.algorithms.aggregation import Aggregation, ServerUpdate, aggregate
from fedsub.engine.loop import initial_params
from fedsub.engine.private_rounds import unbias
from fedsub.errors import FedsubError
from fedsub.flower.node_data import NodeData
from fedsub.flower.records import record_of
from fedsub.privacy.levels import Privacy
from fedsub.privacy.requests import client_request
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import CohortUpdate, pull

LOCAL_COPY = "fedsub.local-rows"  # the node's copy of its rows S(k) in Context.state


def downloads_privately(privacy: Privacy | None) -> bool:
    return privacy is not None and privacy.private_download


def node_request(node: NodeData, round_index: int) -> dict[str, np.ndarray]:
    """The rows this node requests in round ``round_index`` (table -> sorted row ids)."""
    privacy = node.schedule.privacy
    if privacy is None:
        raise FedsubError(f"partition {node.client}: no train.privacy to draw a request with")
    seed = node.schedule.seed
    return client_request(privacy, node.rows, node.table_rows, seed, round_index, node.client)


def _requested(own: np.ndarray, request: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which of ``own`` (sorted) are in ``request`` (sorted), and their places in it."""
    at = np.minimum(np.searchsorted(request, own), max(len(request) - 1, 0))
    hit = request[at] == own if len(request) else np.zeros(len(own), dtype=bool)
    return hit, at


def _local_copy(node: NodeData, context: Context) -> dict[str, torch.Tensor]:
    """The node's copy of its rows: as last received, at first the seeded initial model's."""
    if LOCAL_COPY in context.state:
        saved = record_of(context.state, LOCAL_COPY, ArrayRecord).to_torch_state_dict()
        return {t: saved[t] for t in node.rows}
    start = initial_params(node.model, node.schedule)
    own = {t: torch.from_numpy(r) for t, r in node.rows.items()}
    return pull(start, own).tables


def local_submodel(
    node: NodeData,
    context: Context,
    rows: dict[str, torch.Tensor],
    received: Params,
    request: dict[str, np.ndarray],
) -> Params:
    """The node's model over S(k) for training: requested rows as received (or the whole
    model's rows when it all came), the others from the local copy, which is then updated."""
    own = {t: torch.from_numpy(r) for t, r in node.rows.items()}
    if not rows:  # payload full: every row is current
        return pull(received, own)
    for t, r in request.items():
        if t not in rows or not np.array_equal(rows[t].numpy(), r):
            raise FedsubError(f"partition {node.client}: the rows received are not its request")
    copy = _local_copy(node, context)
    tables = {}
    for t, values in copy.items():
        hit, at = _requested(node.rows[t], request[t])
        mine = values.clone().to(received.tables[t].dtype)
        mine[torch.from_numpy(hit)] = received.tables[t][torch.from_numpy(at[hit])]
        tables[t] = mine
    context.state[LOCAL_COPY] = ArrayRecord({t: v.clone() for t, v in tables.items()})
    return Params(tables, {n: v.clone() for n, v in received.dense.items()})


def reply_record(
    own: dict[str, np.ndarray], request: dict[str, np.ndarray], table_deltas: dict
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The held rows the node requested and their deltas: a held row left out of the request
    is skipped this round (no update), as in the simulator."""
    rows, deltas = {}, {}
    for t, d in table_deltas.items():
        hit, _ = _requested(own[t], request[t])
        rows[t] = torch.from_numpy(own[t][hit])
        deltas[t] = d[torch.from_numpy(hit)]
    return rows, deltas


def reply_rows(
    reply: Message, request: dict[str, torch.Tensor], client: int
) -> dict[str, torch.Tensor]:
    """The row ids of a download reply's deltas, checked to be rows the node requested."""
    if "index" not in reply.content:
        raise FedsubError(f"partition {client}: its reply names no rows for its deltas")
    index = record_of(reply.content, "index", ArrayRecord).to_torch_state_dict()
    rows = {}
    for t, asked in request.items():
        r = index.get(f"rows.{t}")
        if r is None or r.ndim != 1 or r.is_floating_point():
            raise FedsubError(f"partition {client}: no row ids for table {t!r} in its reply")
        if not bool(torch.isin(r, asked).all()):
            raise FedsubError(f"partition {client}: its reply updates rows it did not request")
        rows[t] = r.to(torch.int64)
    return rows


def download_combine(
    aggregation: Aggregation, privacy: Privacy | None
) -> Callable[[CohortUpdate], ServerUpdate]:
    """The round's aggregation: the algorithm's, row sums divided by p under randomized
    response (each held row reaches the server from a fraction p of its clients)."""
    keep = 1.0 if privacy is None else privacy.keep  # keep is 1 below level download
    return lambda update: unbias(aggregate(update, aggregation), keep)
