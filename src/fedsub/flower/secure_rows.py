"""``privacy.level = full`` on Flower: the cohort's row deltas summed by secure aggregation.

A trained node keeps its deltas (the held rows it requested, and its dense deltas) in its
``Context.state`` and replies none of them: its train reply carries its partition id and
deltas of no rows, and no sample count (``num-examples`` is left out at this level). The
server then runs fedsub's secure aggregation with the nodes that replied, as
``query.secure_rows`` Messages over the heat exchange's transport (``heat_exchange.group_sum``
/ ``answer_secagg``: keys, encrypted shares, masked vectors, unmasking). In the "mask" request
each node gets the public part of its weight (``engine/private_rounds.SecureWeighting``: its
draws, the scale, whether its own count enters), the union of the cohort's requests (public:
the server built it from the requests) and the cohort size (which fixes the fixed-point
scale); it weights its deltas with its own sample count and puts its weight units in the
vector's integer slot (the in-process code, ``privacy/sparse_secagg.py``). The server decodes
per-row sums and the survivors' total units over the union, normalizes, and applies
FedSubAvg's coefficients and 1/p (``engine/private_rounds.server_update_of_sums``,
``unbias``): no node's S(k), delta or sample count reaches it. A node that drops out after its
train reply is left out by the protocol's threshold; the round's step is then the survivors'
weighted mean (their units are what the sum normalizes by).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType

from fedsub.algorithms.aggregation import Aggregation, ServerUpdate
from fedsub.algorithms.weighting import SecureWeighting
from fedsub.engine.private_rounds import (
    secure_weighting,
    server_update_of_sums,
    unbias,
)
from fedsub.errors import FedsubError
from fedsub.flower.exchange import PushPullGrid
from fedsub.flower.heat_exchange import (
    Recorder,
    answer_secagg,
    group_sum,
    int_list_field,
    number_field,
)
from fedsub.flower.private_download import download_combine
from fedsub.flower.records import record_of
from fedsub.privacy.fixed_point import FixedPoint
from fedsub.privacy.levels import Privacy
from fedsub.privacy.secagg import SecAggError
from fedsub.privacy.sparse_secagg import RowSlots, decode_sums, encode_client, union_of
from fedsub.submodel.transfer import CohortUpdate

LOG = logging.getLogger("fedsub")
ACTION = "secure_rows"
MESSAGE_TYPE = f"{MessageType.QUERY}.{ACTION}"
SOURCE = "secure-rows"  # what a node agrees to sum in this protocol
PENDING = "fedsub.secure-rows"  # a trained node's deltas in Context.state, until masked


def keep_deltas(
    context: Context,
    rows: Mapping[str, torch.Tensor],
    table_deltas: Mapping[str, torch.Tensor],
    dense_deltas: Mapping[str, torch.Tensor],
) -> None:
    """After training: the node's deltas wait in its state for the secure sum."""
    tensors = {f"rows.{t}": r for t, r in rows.items()}
    tensors.update({f"table.{t}": d for t, d in table_deltas.items()})
    tensors.update({f"dense.{n}": d for n, d in dense_deltas.items()})
    context.state[PENDING] = ArrayRecord(tensors)


def empty_deltas(
    table_deltas: Mapping[str, torch.Tensor], dense_deltas: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """What a node's train reply carries at ``full``: no rows, deltas of no rows, zero dense
    deltas (shapes and dtypes only)."""
    rows = {t: torch.zeros(0, dtype=torch.int64) for t in table_deltas}
    tables = {t: d[:0] for t, d in table_deltas.items()}
    dense = {n: torch.zeros_like(d) for n, d in dense_deltas.items()}
    return rows, tables, dense


def answer_secure_rows(message: Message, context: Context, privacy: Privacy, count: int) -> Message:
    """A node's reply to one stage of the secure row sum (its ``query.secure_rows``);
    ``count``: its sample count, which weights its deltas inside the sum."""
    who = "secure row sum (this node)"
    if not privacy.secure_aggregation:
        raise FedsubError(f"{who}: privacy.level = {privacy.level!r}, not 'full'; refusing")

    def vector(request: ConfigRecord) -> np.ndarray:
        if PENDING not in context.state:
            raise FedsubError(f"{who}: asked to mask deltas before training")
        flat = record_of(context.state, PENDING, ArrayRecord).to_torch_state_dict()
        del context.state[PENDING]  # masked once, then forgotten
        clients = int(number_field(request, "clients", int, who))
        # this member's part of the server's SecureWeighting (correction is the server's)
        weighting = SecureWeighting(
            (int(number_field(request, "draws", int, who)),),
            bool(number_field(request, "by-count", int, who)),
            float(number_field(request, "scale", float, who)),
            normalized=False,
        )
        units = weighting.units(0, count)
        a = weighting.coefficient(units)
        part: dict[str, dict[str, torch.Tensor]] = {"rows": {}, "table": {}, "dense": {}}
        for key, value in flat.items():
            kind, _, name = key.partition(".")
            part[kind][name] = value
        tables, dense = part["table"], part["dense"]
        union = {
            t: np.asarray(int_list_field(request, f"union.{t}", who), dtype=np.int64)
            for t in tables
        }
        slots = RowSlots(
            union,
            {t: int(d.shape[1]) for t, d in tables.items()},
            {n: tuple(d.shape) for n, d in dense.items()},
        )
        values = slots.client_values(
            {t: r.numpy() for t, r in part["rows"].items()},
            {t: d.double().numpy() * a for t, d in tables.items()},
            {n: d.double().numpy() * a for n, d in dense.items()},
        )
        coding = FixedPoint.for_clients(clients, privacy.secagg_clip)
        return encode_client(slots, coding, values, units, clients)

    return answer_secagg(message, context, SOURCE, vector, who)


class SecureRows:
    """The server's half: the round's combine at level ``full``."""

    def __init__(
        self,
        grid: PushPullGrid,
        node_of: Mapping[int, int],
        aggregation: Aggregation,
        privacy: Privacy,
        requests: Callable[[], Mapping[int, Mapping[str, np.ndarray]]],
        timeout: float,
        record: Recorder | None = None,
    ) -> None:
        self.grid = grid
        self.node_of = node_of
        self.aggregation = aggregation
        self.privacy = privacy
        self.requests = requests  # the round's requests by client (the runtime's)
        self.timeout = timeout
        self.record = record
        self.clipped = 0  # values clipped to the fixed-point range, over the run

    def combine(self, update: CohortUpdate) -> ServerUpdate:
        """Secure sum of the members' weighted deltas and weight units over the union of their
        requests; ``update`` holds who replied, how often each was drawn and the deltas'
        shapes (no rows, no sample counts)."""
        members = [int(k) for k in update.clients.tolist()]
        weighting = secure_weighting(self.aggregation, [int(m) for m in update.multiplicity])
        requests = self.requests()
        union = union_of(requests[k] for k in members)
        slots = RowSlots(
            {t: union.get(t, np.empty(0, np.int64)) for t in update.rows},
            {t: int(d.shape[1]) for t, d in update.table_deltas.items()},
            {n: tuple(v.shape[1:]) for n, v in update.dense_deltas.items()},
        )
        shared = {f"union.{t}": r.tolist() for t, r in slots.rows.items()}
        public = {"scale": weighting.scale, "by-count": int(weighting.by_count)}
        fields = {
            self.node_of[k]: {
                "draws": weighting.draws[j], "clients": len(members), **public, **shared
            }
            for j, k in enumerate(members)
        }  # fmt: skip
        coding = FixedPoint.for_clients(len(members), self.privacy.secagg_clip)
        nodes = [self.node_of[k] for k in members]
        try:
            total, survivors = group_sum(
                self.grid, nodes, SOURCE, slots.length, self.timeout, self.record,
                MESSAGE_TYPE, fields,
            )  # fmt: skip
        except SecAggError as error:  # name the nodes: the operator's next step
            raise SecAggError(f"secure row sum over nodes {nodes}: {error}") from None
        decoded = decode_sums(slots, coding, total, len(survivors))
        self.clipped += decoded.clipped
        if decoded.clipped:
            LOG.warning(
                "secure row sum: %d values clipped to [-%g, %g] (privacy.secagg_clip)",
                decoded.clipped,
                self.privacy.secagg_clip,
                self.privacy.secagg_clip,
            )
        server_update = server_update_of_sums(self.aggregation, update, slots, decoded, weighting)
        return unbias(server_update, self.privacy.keep)


def round_combine(
    grid: PushPullGrid | None,
    node_of: Mapping[int, int],
    aggregation: Aggregation,
    privacy: Privacy | None,
    requests: Callable[[], Mapping[int, Mapping[str, np.ndarray]]],
    timeout: float,
    record: Recorder | None = None,
) -> Callable[[CohortUpdate], ServerUpdate]:
    """The Flower runtime's aggregation for ``privacy``: secure row sums at ``full``, else the
    algorithm's aggregate (divided by p under randomized response)."""
    if privacy is not None and privacy.secure_aggregation:
        if grid is None:  # e.g. a runtime without its nodes
            raise FedsubError("Flower: secure row sums need the nodes (no grid given)")
        return SecureRows(grid, node_of, aggregation, privacy, requests, timeout, record).combine
    return download_combine(aggregation, privacy)
