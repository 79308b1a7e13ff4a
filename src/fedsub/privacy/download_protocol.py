"""``privacy.level = download`` on a node that talks to the server itself (a Flower
SuperNode): asked for its rows, it answers its *request* (never its S(k)); sent the requested
rows, it skips every held row left out of them and replies the deltas of the rows it
requested. Each step is the in-process code's (``privacy/requests.py``,
``privacy/requested_rows.py``), so the two runs agree round by round and a node keeps no state
across rounds but its request secret. The runtime carries the request and the rows as it
carries any node's rows; the server divides row sums by p (``privacy/private_rounds.py``'s
``unbias``, engine/features/private.py). docs/tutorials/flower.md, "Private submodel learning
on Flower".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedsub.errors import FedsubError
from fedsub.feature_messages import NodeState
from fedsub.numerics import secret_streams
from fedsub.numerics.seeding import Secret, Seed
from fedsub.privacy.levels import Privacy
from fedsub.privacy.requested_rows import local_submodel, reply_record
from fedsub.privacy.requests import client_request
from fedsub.privacy.secure_rows_protocol import keep_deltas
from fedsub.submodel.params import Params

SECRET = "fedsub.request-secret"  # the node's request secret in its state


@dataclass(frozen=True)
class NodeRequests:
    """A node's private download requests: client ``client``, its rows S(k) (``rows``, table
    -> sorted row ids) of tables of ``table_rows`` rows, under ``privacy`` (a private
    download level) and the run's ``seed``."""

    privacy: Privacy
    seed: Seed
    client: int
    rows: dict[str, np.ndarray]
    table_rows: dict[str, int]

    def key(self, state: NodeState) -> Seed:
        """The key of this node's requests (privacy/randomness.py): its own secret, drawn
        from the operating system the first time and kept in its ``state`` (which never
        leaves the node), so the request and train messages of a round draw the same
        request; with ``privacy.randomness = "seeded"``, ``train.seed``."""
        if self.privacy.randomness == "seeded":
            return self.seed
        kept = state.fields(SECRET)
        if kept is None:
            state.keep_fields(SECRET, {"secret": secret_streams.draw_secret().to_bytes()})
            kept = state.fields(SECRET)
        data = None if kept is None else kept.get("secret")
        if not isinstance(data, bytes):
            raise FedsubError(f"partition {self.client}: its request secret is not bytes")
        return Secret.from_bytes(data)

    def request(self, round_index: int, state: NodeState) -> dict[str, np.ndarray]:
        """The rows this node requests in round ``round_index`` (table -> sorted row ids),
        drawn from its ``key``."""
        key = self.key(state)
        return client_request(
            self.privacy, self.rows, self.table_rows, key, round_index, self.client
        )

    def submodel(
        self, rows: dict[str, torch.Tensor], received: Params, request: dict[str, np.ndarray]
    ) -> Params:
        """The submodel this node trains: the requested rows it ``received`` (``rows``),
        every other held row skipped (privacy/requested_rows.py's ``local_submodel``)."""
        return local_submodel(self.rows, self.client, rows, received, request)

    @property
    def counts_hidden(self) -> bool:
        """Whether the node's sample count stays inside the secure row sum (level full): its
        train reply says none."""
        return self.privacy.secure_aggregation

    def reply(
        self,
        request: dict[str, np.ndarray],
        deltas: Params,
        round_index: int,
        state: NodeState,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """What this node replies after training in round ``round_index``: the held rows it
        requested, their deltas and the dense deltas (the other rows skipped;
        privacy/requested_rows.py's ``reply_record``); at level full, those wait in its
        ``state`` for the secure row sum and the reply carries none
        (privacy/secure_rows_protocol.py's ``keep_deltas``)."""
        kept, table_deltas = reply_record(self.rows, request, dict(deltas.tables))
        if self.privacy.secure_aggregation:  # kept for the secure sum
            return keep_deltas(state, kept, table_deltas, deltas.dense, round_index)
        return kept, table_deltas, dict(deltas.dense)
