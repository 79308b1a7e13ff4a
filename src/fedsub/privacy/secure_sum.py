"""fedsub's secure aggregation (``fedsub.privacy.secagg``: ``SecAggServer`` on the server,
``SecAggClient`` on each node) as a message exchange, whatever carries the messages: a node's
reply to each stage, and the server's secure sum of a group and private heat measurement over
an ``Ask`` (flower/protocols.py carries them as Flower Messages). The stages:

    stage "advertise"  server -> node: session, the node's id in its group, threshold t
                       node -> server: its two X25519 public keys
    stage "share"      server -> node: every advertised key of the group
                       node -> server: its Shamir shares, encrypted per peer, and a commitment
    stage "mask"       server -> node: the encrypted shares addressed to it
                       node -> server: its masked vector (privacy.heat_vectors.summed_vector)
    stage "unmask"     server -> node: who survived, who dropped
                       node -> server: shares of the survivors' self masks / the dropped's keys

A node that fails, times out or sends a malformed or foreign reply is left out of its group
from that stage on (logged by node id); the protocol finishes while at least t = floor(n/2) + 1
of the group remain and fails with ``SecAggError`` otherwise. A node answers only for the
source it agreed to sum, and refuses a group of one, a threshold below a majority of its group,
or an unmask request with fewer than t survivors.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedsub import feature_messages
from fedsub.privacy.heat_report import HeatReport
from fedsub.privacy.heat_sources import HeatPrivacy
from fedsub.privacy.heat_vectors import (
    PRIVATE_SOURCES,
    SUMMED_SOURCES,
    heat_from_reports,
    heat_from_sum,
    noisy_bits,
    summed_length,
    summed_vector,
)
from fedsub.privacy.secagg import SecAggClient, SecAggError, SecAggServer
from fedsub.privacy.secagg_records import (
    HeatMessageError,
    Record,
    advertise_request,
    bytes_field,
    decode_advertise,
    decode_masked,
    decode_report,
    decode_share_keys,
    decode_unmask,
    encode_advertise,
    encode_masked,
    encode_report,
    encode_share_keys,
    encode_unmask,
    inbox_of,
    int_field,
    keys_of,
    load_client,
    mask_request,
    request_of,
    save_client,
    share_request,
    text_field,
    unmask_request,
)
from fedsub.submodel.heat import HeatKind

LOG = logging.getLogger("fedsub")
STAGES = ("advertise", "share", "mask", "unmask", "report")

# (requests by node, stage) -> the replies' records by node: what carries the messages
Ask = feature_messages.Ask


# ---- the node's side ---------------------------------------------------------------------


def heat_reply(
    request: Record,
    state: Record | None,
    privacy: HeatPrivacy,
    kind: HeatKind,
    table_rows: Mapping[str, int],
    rows: Mapping[str, np.ndarray],
    num_samples: int,
    who: str,
) -> tuple[dict, Record | None]:
    """A node's reply to one stage of the heat exchange, and its protocol state after it."""
    stage = text_field(request, "stage", who)
    if privacy.source not in PRIVATE_SOURCES:
        raise HeatMessageError(
            f"{who}: asked for private heat, but this node's privacy.heat_source = "
            f"{privacy.source!r}"
        )
    if stage == "report":
        if privacy.source != "randomized-response":
            raise HeatMessageError(f"{who}: asked for randomized response, configured for secagg")
        return encode_report(noisy_bits(privacy, table_rows, rows), num_samples), state
    if privacy.source not in SUMMED_SOURCES:
        raise HeatMessageError(f"{who}: asked for secure aggregation, configured otherwise")
    return secure_sum_reply(
        request,
        state,
        privacy.source,
        lambda _: summed_vector(privacy, kind, table_rows, rows, num_samples),
        who,
    )


def secure_sum_reply(
    request: Record,
    state: Record | None,
    source: str,
    vector: Callable[[Any], np.ndarray],  # given the "mask" request (the carrier's record)
    who: str,
) -> tuple[dict, dict | None]:
    """A node's reply to one stage of a secure sum, and its protocol state after it (None once
    done: the keys forgotten); ``source`` is what this node agrees to sum, ``vector`` gives its
    uint32 input from the "mask" request."""
    stage = text_field(request, "stage", who)
    session = bytes_field(request, "session", who)
    if stage == "advertise":
        if text_field(request, "source", who) != source:
            raise HeatMessageError(
                f"{who}: the server asks for heat source {request['source']!r}, this node's "
                f"privacy.heat_source is {source!r}"
            )
        client = SecAggClient(
            int_field(request, "id", who), int_field(request, "threshold", who), session
        )
        return encode_advertise(client.advertise()), save_client(client)
    if state is None:
        raise HeatMessageError(f"{who}: stage {stage!r} before this node advertised keys")
    client = load_client(state, session, who)
    if stage == "share":
        keys = keys_of(request, session, who)
        if len(keys) < 2 or 2 * client.threshold <= len(keys):
            raise HeatMessageError(
                f"{who}: a group of {len(keys)} with threshold t = {client.threshold}: "
                "the sum of fewer than two vectors, or a minority able to unmask, would "
                "not hide this node's; refusing"
            )
        return encode_share_keys(client.share_keys(keys)), save_client(client)
    if stage == "mask":
        inbox = inbox_of(request, session, who)
        return encode_masked(client.masked_input(inbox, vector(request))), save_client(client)
    if stage == "unmask":
        unmask = request_of(request, session, who)
        if len(unmask.survivors) < client.threshold:
            raise HeatMessageError(
                f"{who}: only {len(unmask.survivors)} survivors, fewer than t = "
                f"{client.threshold}: unmasking would reveal one node's vector; refusing"
            )
        return encode_unmask(client.unmask(unmask)), None
    raise HeatMessageError(f"{who}: unknown heat stage {stage!r}; expected {STAGES}")


# ---- the server's side -------------------------------------------------------------------


def _decoded(replies: Mapping[int, Record], decode: Callable, stage: str, ids) -> list:
    """Each reply decoded, its claimed sender checked against the node's id in the group;
    a reply that does not fit is left out, naming its node."""
    messages = []
    for node, fields in replies.items():
        who = f"node {node}"
        try:
            message = decode(fields, who)
            if message.sender != ids[node]:
                raise HeatMessageError(
                    f"{who}: claims to be client {message.sender} of its group, "
                    f"it is client {ids[node]}"
                )
        except HeatMessageError as error:
            LOG.warning("heat exchange, stage %s: %s; left out", stage, error)
            continue
        messages.append(message)
    return messages


def group_sum(
    ask: Ask,
    group: Sequence[int],
    source: str,
    length: int,
    mask_fields: Mapping[int, dict] | None = None,
    threshold: int | None = None,
) -> tuple[np.ndarray, tuple[int, ...]]:
    """One group's secure sum (secagg's four stages) and the nodes whose vectors it holds;
    ``mask_fields`` adds per-node fields to the "mask" request (what a node needs to build
    its vector); ``threshold``: secagg's t (default the majority; distributed DP raises it to
    K_min, so no sum with less noise than accounted is decoded)."""
    steps = GroupSum(group, source, threshold)
    steps.take_keys(ask(steps.advertise(), "advertise"))
    steps.take_shares(ask(steps.share(), "share"))
    return steps.finish(ask, length, mask_fields or {})


class GroupSum:
    """One group's secure sum stage by stage, for a carrier that sends its first two stages
    with other messages (privacy/secure_rows_protocol.py: "advertise" rides with a round's request
    query, "share" with its train messages); ``group_sum`` runs the four in a row. The
    threshold t is fixed when the keys are advertised (each node's Shamir shares are drawn
    for it); a node that advertised and sends no shares is outside the sum (no mask of it
    is ever added), one that shared and sends no masked vector is a dropout the unmasking
    recovers, and fewer than t left at any stage ends the sum with ``SecAggError``."""

    def __init__(self, group: Sequence[int], source: str, threshold: int | None = None) -> None:
        self.session = secrets.token_bytes(16)
        self.source = source
        self.threshold = threshold or len(group) // 2 + 1
        self.ids = {node: i for i, node in enumerate(group)}
        self.node_of = dict(enumerate(group))
        self.server = SecAggServer(self.threshold, 0, self.session)  # length: at "mask"
        self.keys: list = []
        self.routed: dict[int, list] = {}

    def _stage(self, replies: Mapping[int, Record], name: str, decode: Callable) -> list:
        return _decoded(replies, decode, name, self.ids)

    def advertise(self) -> dict[int, dict]:
        """Stage "advertise": every node's request."""
        t, session = self.threshold, self.session
        return {n: advertise_request(session, i, t, self.source) for n, i in self.ids.items()}

    def take_keys(self, replies: Mapping[int, Record]) -> None:
        """The advertised keys of ``replies`` (by node); the others are outside the sum."""
        decode = lambda r, who: decode_advertise(r, self.session, who)  # noqa: E731
        self.keys = self.server.collect_keys(self._stage(replies, "advertise", decode))

    def share(self) -> dict[int, dict]:
        """Stage "share": a request to every node that advertised keys."""
        request = share_request(self.session, self.keys)
        return {self.node_of[k.sender]: request for k in self.keys}

    def take_shares(self, replies: Mapping[int, Record]) -> None:
        decode = lambda r, who: decode_share_keys(r, self.session, who)  # noqa: E731
        self.routed = self.server.route_shares(self._stage(replies, "share", decode))

    def finish(
        self,
        ask: Ask,
        length: int,
        mask_fields: Mapping[int, dict],
        among: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, tuple[int, ...]]:
        """Stages "mask" and "unmask" over ``ask``: the sum of the ``length`` values of the
        nodes that shared (of ``among`` only: any other that shared is a dropout the
        unmasking recovers), and the nodes whose vectors it holds."""
        session, node_of = self.session, self.node_of
        self.server.length = length
        requests = {
            node_of[u]: {**mask_request(session, inbox), **mask_fields.get(node_of[u], {})}
            for u, inbox in self.routed.items()
            if among is None or node_of[u] in among
        }
        decode = lambda r, who: decode_masked(r, session, length, who)  # noqa: E731
        request = self.server.collect_masked(self._stage(ask(requests, "mask"), "mask", decode))
        unmasking = {node_of[u]: unmask_request(request) for u in request.survivors}
        shares = lambda r, who: decode_unmask(r, session, who)  # noqa: E731
        total = self.server.finish(request, self._stage(ask(unmasking, "unmask"), "unmask", shares))
        _log_rejections(self.server, node_of)
        return total, tuple(node_of[u] for u in request.survivors)


def _log_rejections(server: SecAggServer, node_of: Mapping[int, int]) -> None:
    """Warn of each node the server rejected (named by its node id, not its secagg id): the
    sum goes on without it, so the log is where an operator sees why."""
    for rejection in server.rejections:
        LOG.warning(
            "heat exchange, step %d: node %d rejected: %s",
            rejection.step,
            node_of.get(rejection.client, -1),
            rejection.reason,
        )


def groups_of(nodes: Sequence[int], size: int) -> list[list[int]]:
    """Consecutive groups of ``size`` nodes; a last group of one joins the one before, since
    a group's sum is all the server learns and one node's sum is its vector."""
    groups = [list(nodes[i : i + size]) for i in range(0, len(nodes), size)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        groups[-2].extend(groups.pop())
    return groups


def measure_heat(
    ask: Ask,
    nodes: Sequence[int],
    privacy: HeatPrivacy,
    kind: HeatKind,
    table_rows: Mapping[str, int],
) -> HeatReport:
    """The heat of ``nodes``' rows by the private source ``privacy.source``. Raises
    ``SecAggError`` when a group keeps fewer than its threshold of nodes."""
    if privacy.source not in PRIVATE_SOURCES:
        raise ValueError(f"heat source {privacy.source!r} is not private: no exchange to run")
    if privacy.source == "randomized-response":
        replies = ask({n: {"stage": "report"} for n in nodes}, "report")
        reports, reporters = [], []
        for node, fields in replies.items():
            try:
                reports.append(decode_report(fields, table_rows, f"node {node}"))
            except HeatMessageError as error:
                LOG.warning("heat exchange, stage report: %s; left out", error)
                continue
            reporters.append(node)
        if not reports:
            raise SecAggError("heat exchange: no node sent a randomized-response report")
        measured = heat_from_reports(privacy, kind, table_rows, reports)
        return HeatReport(measured, tuple(reporters))
    if len(nodes) < 2:
        raise SecAggError(
            f"secure aggregation needs at least 2 nodes, got {len(nodes)}: the sum of one "
            "node's vector is the vector"
        )
    length = summed_length(privacy, table_rows)
    total = np.zeros(length, dtype=np.int64)
    contributors: list[int] = []
    for group in groups_of(sorted(nodes), privacy.group_size):
        try:
            group_total, survivors = group_sum(ask, group, privacy.source, length)
        except SecAggError as error:  # name the group: the operator's next step
            raise SecAggError(
                f"heat exchange ({privacy.source}), group of nodes {group}: {error}"
            ) from None
        total += group_total.astype(np.int64)
        contributors.extend(survivors)
    return HeatReport(heat_from_sum(privacy, table_rows, total), tuple(contributors))
