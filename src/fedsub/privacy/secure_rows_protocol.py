"""``privacy.level = full`` when the server talks to the nodes (Flower): the cohort's row
deltas summed by secure aggregation, so no node's S(k), delta or sample count reaches the
server. Written against fedsub/feature_messages.py's types alone; Flower carries it
(flower/protocols.py).

A trained node keeps its deltas in its ``NodeState`` and replies none of them; the server
runs the secure sum over the heat exchange's messages: its keys ride with the round's request
query, its shares with the train messages (``SecureRows.open``: who is in the sum, its
threshold), and its last two stages, with the nodes that replied, are its own
(``SECURE_ROWS``: Flower's ``query.secure_rows``); each node weights (with ``[dp]``: clips
and noises) its own deltas with the in-process code, so the decoded step is the in-process
one. What each side sends and learns, and how dropouts end: docs/tutorials/flower.md,
"Private submodel learning on Flower"; with ``[dp]``, docs/tutorials/differential-privacy.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from fedsub.algorithms.aggregation import Aggregation, ServerUpdate
from fedsub.algorithms.weighting import SecureWeighting
from fedsub.errors import FedsubError
from fedsub.feature_messages import Answer, Ask, Carried, Fields, NodeState
from fedsub.numerics.fixed_point import FixedPoint
from fedsub.privacy import secure_sum
from fedsub.privacy.heat_protocol import secagg_answer
from fedsub.privacy.levels import Privacy
from fedsub.privacy.private_rounds import NoisySum, RoundNoise, SecureRound, weighted_input
from fedsub.privacy.secagg import SecAggError
from fedsub.privacy.secagg_records import int_list_field, number_field
from fedsub.privacy.secure_sum import GroupSum
from fedsub.privacy.sparse_secagg import (
    INTEGER_SLOTS,
    RowSlots,
    decode_sums,
    majority_threshold,
    noised_input,
)
from fedsub.submodel.params import Params
from fedsub.submodel.transfer import CohortUpdate

LOG = logging.getLogger("fedsub")
# its own messages: Flower's "query.secure_rows", their fields a "heat" record (the heat
# exchange's) both ways; its first two stages ride with the round's other messages
SECURE_ROWS = Carried("secure_rows", "heat", "secure row sum", rides=True, timed=True)
SOURCE = "secure-rows"  # what a node agrees to sum in this protocol
PENDING = "fedsub.secure-rows"  # a trained node's deltas in its state, until masked
PENDING_ROUND = "fedsub.secure-rows.round"  # the round they were trained in


# ---- the node's side ---------------------------------------------------------------------


def keep_deltas(
    state: NodeState,
    rows: Mapping[str, torch.Tensor],
    table_deltas: Mapping[str, torch.Tensor],
    dense_deltas: Mapping[str, torch.Tensor],
    round_index: int,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """After training in round ``round_index``: the node's deltas wait in its ``state`` for
    the secure sum (its rows, their deltas, the dense deltas); its train reply carries no
    rows, deltas of no rows and zero dense deltas instead (shapes, dtypes)."""
    tensors = {f"rows.{t}": r for t, r in rows.items()}
    tensors.update(Params(dict(table_deltas), dict(dense_deltas)).state_dict())
    state.keep_tensors(PENDING, tensors)
    state.keep_fields(PENDING_ROUND, {"round": round_index})
    no_rows = {t: torch.zeros(0, dtype=torch.int64) for t in table_deltas}
    tables = {t: d[:0] for t, d in table_deltas.items()}
    return no_rows, tables, {n: torch.zeros_like(d) for n, d in dense_deltas.items()}


def _pending(state: NodeState, who: str) -> tuple[dict[str, torch.Tensor], Params, int]:
    """The deltas kept by ``keep_deltas`` (its rows, the deltas, the round), then forgotten:
    masked once."""
    flat, kept = state.tensors(PENDING), state.fields(PENDING_ROUND)
    if flat is None:
        raise FedsubError(f"{who}: asked to mask deltas before training")
    if kept is None:
        raise FedsubError(f"{who}: its deltas are kept without their round")
    trained_in = int(number_field(kept, "round", int, who))
    state.forget(PENDING)
    rows = {k[len("rows.") :]: v for k, v in flat.items() if k.startswith("rows.")}
    deltas = Params.from_state_dict({k: v for k, v in flat.items() if not k.startswith("rows.")})
    return rows, deltas, trained_in


class NodeShares(Protocol):
    """A node's part in distributed DP ([dp] at level full) as its copy of the run config
    states it (dp/distributed.py's ``NodeNoise``, from runs/run_setup.py's
    ``node_noise``): where its shares come from, and the refusals of a sum with less noise."""

    def generator(self, round_index: int) -> np.random.Generator: ...

    def check_threshold(self, threshold: int) -> None: ...

    def round_noise(
        self, clip: float, noise_multiplier: float, min_survivors: int, clients: int, length: int
    ) -> RoundNoise: ...


def check_threshold(noise: NodeShares, request: Fields, who: str) -> None:
    """Refuse to take part in a secure sum whose threshold (the server's "advertise" request)
    is below this node's K_min: its sum could be unmasked from fewer noise shares than the
    accounted noise needs."""
    if request.get("stage") != "advertise":
        return
    threshold = int(number_field(request, "threshold", int, who))
    try:
        noise.check_threshold(threshold)
    except ValueError as error:
        raise FedsubError(f"{who}: {error}") from None


def round_noise(noise: NodeShares, request: Fields, length: int, who: str) -> RoundNoise:
    """The round's public noise from the server's "mask" request, refused when it asks for
    less noise than this node's config states (dp/distributed.py's ``NodeNoise``)."""
    clip = float(number_field(request, "dp-clip", float, who))
    z = float(number_field(request, "dp-noise-multiplier", float, who))
    k_min = int(number_field(request, "dp-min-survivors", int, who))
    clients = int(number_field(request, "clients", int, who))
    try:
        return noise.round_noise(clip, z, k_min, clients, length)
    except ValueError as error:
        raise FedsubError(f"{who}: {error}") from None


def _input(
    request: Fields, state: NodeState, privacy: Privacy, count: int, noise: NodeShares | None
) -> np.ndarray:
    """This node's uint32 input to the sum from the "mask" ``request``: its kept deltas
    weighted by its sample ``count`` (with [dp]: its noisy share)."""
    who = "secure row sum (this node)"
    rows, deltas, trained_in = _pending(state, who)
    tables, dense = deltas.tables, deltas.dense
    slots = RowSlots(
        {t: np.asarray(int_list_field(request, f"union.{t}", who), np.int64) for t in tables},
        {t: int(d.shape[1]) for t, d in tables.items()},
        {n: tuple(d.shape) for n, d in dense.items()},
    )
    values = slots.client_values(
        {t: r.numpy() for t, r in rows.items()},
        {t: d.double().numpy() for t, d in tables.items()},
        {n: d.double().numpy() for n, d in dense.items()},
    )
    if noise is not None:  # its noisy share, drawn on its side (dp/distributed.py)
        public = round_noise(noise, request, slots.length - INTEGER_SLOTS, who)
        return noised_input(values, public.share, noise.generator(trained_in))
    clients = int(number_field(request, "clients", int, who))
    weighting = SecureWeighting(  # its part of the server's (correction is the server's)
        (int(number_field(request, "draws", int, who)),),
        bool(number_field(request, "by-count", int, who)),
        float(number_field(request, "scale", float, who)),
        normalized=False,
    )
    coding = FixedPoint.for_clients(clients, privacy.secagg_clip)
    return weighted_input(SecureRound(slots, coding, clients, 1.0, weighting), 0, count, values)


def secure_rows_answer(
    privacy: Privacy | None, level: str, count: int, noise: NodeShares | None
) -> Answer:
    """A node's answer to each stage of the secure row sum: its sample ``count`` weights its
    deltas inside the sum; with [dp] at full (``noise``: its ``NodeNoise``) its unweighted
    deltas go in as its noisy share instead. ``level``: its config's privacy.level (a node
    below full refuses)."""
    who = "secure row sum (this node)"

    def answer(request: Fields, state: NodeState) -> dict:
        if privacy is None or not privacy.secure_aggregation:
            raise FedsubError(f"{who}: privacy.level = {level!r}, not 'full'; refusing")
        if noise is not None:
            check_threshold(noise, request, who)
        vector = lambda mask: _input(mask, state, privacy, count, noise)  # noqa: E731
        return secagg_answer(SOURCE, vector, who)(request, state)

    return answer


# ---- the server's side -------------------------------------------------------------------


@dataclass
class SecureRows:
    """The server's half: the round's combine at level ``full``. Its secure sum's first two
    stages ride with the round's earlier waves (``open``, ``take_keys``, ``take_shares``: the
    runtime reads what rode back for the nodes ``riding_with``); a combine with no sum opened
    (or too few nodes in a riding stage) runs all four stages itself through ``ask``, over the
    nodes that replied to train, as before they rode."""

    carried = SECURE_ROWS
    ask: Ask  # its own messages (SECURE_ROWS) to the nodes
    node_of: Mapping[int, int]
    aggregation: Aggregation
    privacy: Privacy
    requests: Callable[[], Mapping[int, Mapping[str, np.ndarray]]]  # the runtime's, by client
    dp: NoisySum | None = None  # [dp] at full: distributed DP (dp/distributed.py's)
    steps: GroupSum | None = field(default=None, init=False)  # this round's, once opened

    def open(self, nodes: Sequence[int]) -> dict[int, dict]:
        """This round's secure sum over ``nodes`` (those asked for their download requests):
        its "advertise" requests, to ride with that query. Its threshold t is fixed here, for
        every node's Shamir shares: the majority of ``nodes`` (with [dp] raised to K_min), at
        least the majority of the members the sum ends with (docs/tutorials/flower.md,
        "Private submodel learning on Flower")."""
        threshold = majority_threshold(len(nodes))
        if self.dp is not None:
            threshold = self.dp.threshold(threshold)
        self.steps = GroupSum(list(nodes), SOURCE, threshold)
        return self.steps.advertise()

    @property
    def riding_with(self) -> Collection[int] | None:
        """The nodes of the sum whose stages ride with the round's messages (None: no sum is
        open, nothing rides)."""
        return None if self.steps is None else self.steps.ids

    def _restart(self, error: SecAggError) -> None:
        """Fewer than t nodes took part in a riding stage (no vector was masked yet): the
        combine runs the sum's four stages anew, over the nodes that replied to train."""
        LOG.warning(
            "secure row sum: %s; its four stages run after the training instead, with the "
            "nodes that replied",
            error,
        )
        self.steps = None

    def take_keys(self, riding: Mapping[int, Fields]) -> dict[int, dict]:
        """The keys advertised with the request query (``riding``: by node, those of the
        nodes sent a train message; any other's left out, as if never advertised); the
        "share" requests to ride with those train messages."""
        if self.steps is None:
            return {}
        try:
            self.steps.take_keys(riding)
        except SecAggError as error:
            self._restart(error)
            return {}
        return self.steps.share()

    def take_shares(self, riding: Mapping[int, Fields]) -> None:
        """The shares riding with the train replies (by node): a node that failed training
        sends none, and is outside the sum."""
        if self.steps is None:
            return
        try:
            self.steps.take_shares(riding)
        except SecAggError as error:
            self._restart(error)

    def combine(self, update: CohortUpdate) -> ServerUpdate:
        """Secure sum of the members' weighted deltas and weight units (with [dp]: their
        noisy shares, privacy/private_rounds.py's ``SecureRound`` as in process) over the
        union of their requests; ``update`` holds who replied, how often each was drawn and
        the deltas' shapes (no rows, no sample counts). With [dp] the sum's threshold is
        K_min, so fewer survivors abort the round (``SecAggError``). A node that shared
        its keys but is not a member (its reply left out) is a dropout the unmasking
        recovers."""
        steps, self.steps = self.steps, None
        members = [int(k) for k in update.clients.tolist()]
        nodes = [self.node_of[k] for k in members]
        if self.dp is not None and len(members) < self.dp.min_survivors:
            raise SecAggError(
                f"secure row sum: {len(members)} node(s) replied to train, fewer than "
                f"dp.min_survivors K_min = {self.dp.min_survivors}; the round's sum would "
                "hold less noise than accounted, so it is not run"
            )
        requests = [self.requests()[k] for k in members]
        plan = SecureRound.plan(update, requests, self.aggregation, self.privacy, self.dp)
        union = {f"union.{t}": r.tolist() for t, r in plan.slots.rows.items()}
        fields = {node: {**_told(plan, self.dp, j), **union} for j, node in enumerate(nodes)}
        length = plan.slots.length
        try:
            if steps is None:  # none opened (or restarted): the four stages here
                total, survivors = secure_sum.group_sum(
                    self.ask, nodes, SOURCE, length, fields, plan.threshold
                )
            else:
                total, survivors = steps.finish(self.ask, length, fields, nodes)
        except SecAggError as error:  # name the nodes: the operator's next step
            raise SecAggError(f"secure row sum over nodes {nodes}: {error}") from None
        decoded = decode_sums(plan.slots, plan.coding, total, len(survivors))
        if decoded.clipped:  # never with [dp]: its integer slots carry nothing
            clip = self.privacy.secagg_clip
            message = "secure row sum: %d values clipped to [-%g, %g] (privacy.secagg_clip)"
            LOG.warning(message, decoded.clipped, clip, clip)
        return plan.server_update(self.aggregation, update, decoded)


def _told(plan: SecureRound, dp: NoisySum | None, member: int) -> dict:
    """What ``member`` is told of the round's plan besides the union: its part of the
    weighting, or distributed DP's public settings."""
    if plan.weighting is not None:
        w, clients = plan.weighting, plan.members
        return {
            "draws": w.draws[member],
            "clients": clients,
            "scale": w.scale,
            "by-count": int(w.by_count),
        }
    assert dp is not None and plan.noise is not None  # distributed DP
    return {
        "clients": plan.members,
        "dp-clip": plan.noise.clip,
        "dp-noise-multiplier": dp.noise_multiplier,
        "dp-min-survivors": dp.min_survivors,
    }
