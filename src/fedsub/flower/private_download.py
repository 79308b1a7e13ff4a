"""``privacy.level = download`` on Flower: the same requests and aggregation as in process.

- **Node** (``node_request``): asked for its rows, a node at level ``download`` answers its
  *request* (``privacy/requests.py``: randomized response or size buckets, keyed by (seed,
  round, client) exactly as ``engine/private_rounds.py`` keys its clients), never its S(k).
- **Server**: sends the requested rows (or, with ``payload = full``, the whole model); the
  node's model over S(k) (``privacy/requested_rows.local_submodel``) takes the requested rows
  as received, and every held row left out of the request is *skipped*: it reads as zero in
  the local steps (as if that feature were absent from the node's samples) and gets no update,
  with either payload. The simulator does the same (``engine/private_rounds.WithoutRows``), so
  the two agree in every round, and the node keeps no state across rounds.
- **Reply** (``requested_rows.reply_record``): the deltas of the held rows it requested (as
  the simulator's ``restrict``) with their row ids, in the clear (this level hides the
  download only; at ``full`` they go into the secure sum instead, flower/secure_rows.py).
- **Aggregation** (``download_combine``): the algorithm's aggregate, row sums divided by p
  (``engine/private_rounds.unbias``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import Message

from fedsub.algorithms.aggregation import Aggregation, ServerUpdate, aggregate
from fedsub.engine.private_rounds import unbias
from fedsub.errors import FedsubError
from fedsub.flower.node_data import NodeData
from fedsub.flower.records import reply_row_ids
from fedsub.privacy.levels import Privacy
from fedsub.privacy.requests import client_request
from fedsub.submodel.transfer import CohortUpdate


def downloads_privately(privacy: Privacy | None) -> bool:
    return privacy is not None and privacy.private_download


def node_request(node: NodeData, round_index: int) -> dict[str, np.ndarray]:
    """The rows this node requests in round ``round_index`` (table -> sorted row ids)."""
    privacy = node.schedule.privacy
    if privacy is None:
        raise FedsubError(f"partition {node.client}: no privacy.level to draw a request with")
    seed = node.schedule.seed
    return client_request(privacy, node.rows, node.table_rows, seed, round_index, node.client)


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
    aggregation: Aggregation, privacy: Privacy | None
) -> Callable[[CohortUpdate], ServerUpdate]:
    """The round's aggregation: the algorithm's, row sums divided by p under randomized
    response (each held row reaches the server from a fraction p of its clients)."""
    keep = 1.0 if privacy is None else privacy.keep  # keep is 1 below level download
    return lambda update: unbias(aggregate(update, aggregation), keep)
