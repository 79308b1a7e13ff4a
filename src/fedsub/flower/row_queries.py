"""With a private ``privacy.heat_source`` the server learns a node's S(k) only when it samples
it, as the download of X[S(k)] names those rows: a "rows" query before the round (with private
download, privacy/download_protocol.py, the node's download request for the round instead)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
from flwr.app import Message
from flwr.app.typing import ConfigRecordValues
from flwr.serverapp import Grid

from fedsub.engine.membership import Membership
from fedsub.errors import FedsubError
from fedsub.feature_messages import Carried
from fedsub.flower.exchange import exchange
from fedsub.flower.protocols import ride
from fedsub.flower.records import query_message, reply_row_ids

LOG = logging.getLogger("fedsub")


def row_ids(reply: Message, tables: dict[str, int]) -> dict[str, np.ndarray]:
    """A "rows" reply's S(k) per table; a ``FedsubError`` unless they are row ids of every
    table."""
    rows = reply_row_ids(reply, tables)
    for table, r in rows.items():
        if len(r) and not 0 <= int(r.min()) <= int(r.max()) < tables[table]:
            raise FedsubError(f"its rows of table {table!r} are not row ids below {tables[table]}")
    return {t: r.numpy() for t, r in rows.items()}


class SampledRows:
    """The S(k) (or this round's request) of the sampled clients, by position in
    ``membership.counted``, asked when a round samples a client not known yet."""

    def __init__(
        self,
        membership: Membership,
        downloading: bool,
        query: Mapping[str, ConfigRecordValues],
        timeout: float,
    ) -> None:
        self.membership = membership
        self.downloading = downloading  # private download: asks each round's requests
        self.query = query  # sent with every question, e.g. the run's spec hash
        self.timeout = timeout
        self.rows: dict[int, dict[str, np.ndarray]] = {}

    def forget(self, partition: int) -> None:
        """A new node took ``partition`` over: ask its rows again when it is sampled."""
        if partition in self.membership.counted:
            self.rows.pop(self.membership.counted.index(partition), None)

    def ask(
        self,
        grid: Grid,
        clients: list[int],
        server_round: int,
        riders: tuple[Carried, Mapping[int, dict]] | None = None,
    ) -> list[Message]:
        """The rows of the round's sampled ``clients`` not known yet; with private download
        a new request from every sampled client, every round. ``riders``: a protocol's
        stage riding with the query (its requests by node: at privacy full the secure row
        sum's, engine/features/private.py); the replies, for it."""
        asked: dict[str, ConfigRecordValues] = {"what": "rows", **self.query}
        if self.downloading:
            self.rows = {}
            asked = {"what": "request", "round": server_round, **self.query}
        unknown = [j for j in clients if j not in self.rows]
        if not unknown:
            return []
        counted = self.membership.counted
        position = {self.membership.node_of(counted[j]): j for j in unknown}  # node -> j
        query = [query_message(node, asked, server_round) for node in position]
        if riders is not None:
            ride(query, riders[1], riders[0])
        replies = exchange(grid, query, self.timeout)
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error() or node not in position:
                LOG.warning("round %d: no rows from node %d", server_round, node)
                continue
            try:
                self.rows[position[node]] = row_ids(reply, self.membership.tables)
            except FedsubError as error:  # left out of the round, like a node that failed
                LOG.warning("round %d: node %d: %s", server_round, node, error)
        return replies
