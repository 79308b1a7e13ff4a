"""Private heat over Flower: fedsub's secure aggregation (and randomized response) as
``query.heat`` Messages between the ServerApp and the nodes.

The server never receives a node's index sets S(k) here. For ``secagg`` and ``sketch`` it runs
the same message-passing code as in process (``fedsub.privacy.secagg``: ``SecAggServer`` on the
server, ``SecAggClient`` on each node) in groups of ``privacy.secagg_group`` nodes:

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
of the group remain and fails with ``SecAggError`` otherwise. A node keeps its protocol state
(its private keys, the shares it received) in its Flower ``Context.state``; it never leaves the
node. For ``randomized-response`` one stage, "report": each node sends its eps-LDP noisy bits
(drawn on the node) and its sample count; the server debiases.

A node answers only for the heat source its own config names, so a server cannot talk it into
a weaker one, and refuses a group of one, a threshold below a majority of its group, or an
unmask request with fewer than t survivors.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fedsub.errors import FedsubError
from fedsub.flower.exchange import PushPullGrid, exchange
from fedsub.flower.records import record_of
from fedsub.privacy import shamir
from fedsub.privacy.heat_sources import HeatPrivacy
from fedsub.privacy.heat_vectors import (
    PRIVATE_SOURCES,
    SUMMED_SOURCES,
    MeasuredHeat,
    heat_from_reports,
    heat_from_sum,
    noisy_bits,
    summed_length,
    summed_vector,
)
from fedsub.privacy.secagg import (
    AdvertiseKeys,
    EncryptedShares,
    MaskedInput,
    SecAggClient,
    SecAggError,
    SecAggServer,
    ShareKeys,
    UnmaskRequest,
    UnmaskShares,
)
from fedsub.submodel.heat import HeatKind

LOG = logging.getLogger("fedsub")
MESSAGE_TYPE = f"{MessageType.QUERY}.heat"
RECORD = "heat"  # the ConfigRecord of every heat message, both ways
STATE = "fedsub.heat-exchange"  # the node's protocol state in Context.state
STAGES = ("advertise", "share", "mask", "unmask", "report")

# (node id, stage, reply content): everything the server received, for a transcript
Recorder = Callable[[int, str, RecordDict], None]


class HeatMessageError(FedsubError):
    """A heat message that does not fit the protocol (named by node and stage)."""


@dataclass(frozen=True)
class HeatReport:
    """The heat the exchange measured, and whose contribution it holds (node ids)."""

    measured: MeasuredHeat
    contributors: tuple[int, ...]


# ---- typed fields of a heat ConfigRecord ---------------------------------------------------


def _get(record: ConfigRecord, key: str, kind: type, who: str) -> object:
    if key not in record:
        raise HeatMessageError(f"{who}: heat message lacks {key!r}")
    value = record[key]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise HeatMessageError(
            f"{who}: heat message's {key!r} is a {type(value).__name__}, expected {kind.__name__}"
        )
    return value


def number_field(record: ConfigRecord, key: str, kind: type[int] | type[float], who: str) -> float:
    """A numeric field of a protocol message, checked (for flower/secure_rows.py too)."""
    return float(_get(record, key, kind, who))  # type: ignore[arg-type]  # checked number


def int_list_field(record: ConfigRecord, key: str, who: str) -> list[int]:
    return _list(record, key, int, who)


def _int(record: ConfigRecord, key: str, who: str) -> int:
    return int(_get(record, key, int, who))  # type: ignore[call-overload]  # checked int


def _bytes(record: ConfigRecord, key: str, who: str) -> bytes:
    return bytes(_get(record, key, bytes, who))  # type: ignore[call-overload]  # checked bytes


def _str(record: ConfigRecord, key: str, who: str) -> str:
    return str(_get(record, key, str, who))


def _list(record: ConfigRecord, key: str, kind: type, who: str) -> list:
    value = _get(record, key, list, who)
    assert isinstance(value, list)
    if any(not isinstance(v, kind) or isinstance(v, bool) for v in value):
        raise HeatMessageError(f"{who}: heat message's {key!r} must be a list of {kind.__name__}")
    return value


def _heat_record(content: RecordDict, who: str) -> ConfigRecord:
    if RECORD not in content:
        raise HeatMessageError(f"{who}: not a heat message (no {RECORD!r} record)")
    try:
        return record_of(content, RECORD, ConfigRecord)
    except FedsubError as error:
        raise HeatMessageError(f"{who}: {error}") from None


def _expect(record: ConfigRecord, stage: str, session: bytes | None, who: str) -> None:
    got = _str(record, "stage", who)
    if got != stage:
        raise HeatMessageError(f"{who}: heat message of stage {got!r}, expected {stage!r}")
    if session is not None and _bytes(record, "session", who) != session:
        raise HeatMessageError(f"{who}: heat message from another session")


def _shares_fields(shares: Mapping[int, shamir.Share], prefix: str) -> dict[str, list]:
    owners = sorted(shares)
    return {
        f"{prefix}-owners": owners,
        f"{prefix}-x": [shares[o][0] for o in owners],
        f"{prefix}-y": [shares[o][1].to_bytes(shamir.SHARE_BYTES, "big") for o in owners],
    }


def _shares_of(record: ConfigRecord, prefix: str, who: str) -> dict[int, shamir.Share]:
    owners = _list(record, f"{prefix}-owners", int, who)
    xs = _list(record, f"{prefix}-x", int, who)
    ys = _list(record, f"{prefix}-y", bytes, who)
    if not len(owners) == len(xs) == len(ys) or len(set(owners)) != len(owners):
        raise HeatMessageError(f"{who}: heat message's {prefix} shares do not line up")
    if any(len(y) != shamir.SHARE_BYTES for y in ys):
        raise HeatMessageError(f"{who}: a {prefix} share is not {shamir.SHARE_BYTES} bytes")
    return {o: (x, int.from_bytes(y, "big")) for o, x, y in zip(owners, xs, ys, strict=True)}


# ---- the protocol's messages as records (server -> node, node -> server) ---------------


def advertise_request(session: bytes, client_id: int, threshold: int, source: str) -> dict:
    return {
        "stage": "advertise",
        "session": session,
        "id": client_id,
        "threshold": threshold,
        "source": source,
    }


def encode_advertise(m: AdvertiseKeys) -> dict:
    return {
        "stage": "advertise",
        "session": m.session,
        "sender": m.sender,
        "channel-key": m.channel_key,
        "mask-key": m.mask_key,
    }


def decode_advertise(record: ConfigRecord, session: bytes, who: str) -> AdvertiseKeys:
    _expect(record, "advertise", session, who)
    return AdvertiseKeys(
        session,
        _int(record, "sender", who),
        _bytes(record, "channel-key", who),
        _bytes(record, "mask-key", who),
    )


def share_request(session: bytes, keys: Sequence[AdvertiseKeys]) -> dict:
    return {
        "stage": "share",
        "session": session,
        "senders": [k.sender for k in keys],
        "channel-keys": [k.channel_key for k in keys],
        "mask-keys": [k.mask_key for k in keys],
    }


def keys_of(record: ConfigRecord, session: bytes, who: str) -> list[AdvertiseKeys]:
    _expect(record, "share", session, who)
    senders = _list(record, "senders", int, who)
    channel = _list(record, "channel-keys", bytes, who)
    mask = _list(record, "mask-keys", bytes, who)
    if not len(senders) == len(channel) == len(mask):
        raise HeatMessageError(f"{who}: the advertised keys do not line up")
    return [AdvertiseKeys(session, s, c, m) for s, c, m in zip(senders, channel, mask, strict=True)]


def encode_share_keys(m: ShareKeys) -> dict:
    return {
        "stage": "share",
        "session": m.session,
        "sender": m.sender,
        "commitment": m.self_mask_commitment,
        "recipients": [s.recipient for s in m.shares],
        "nonces": [s.nonce for s in m.shares],
        "ciphertexts": [s.ciphertext for s in m.shares],
    }


def decode_share_keys(record: ConfigRecord, session: bytes, who: str) -> ShareKeys:
    _expect(record, "share", session, who)
    sender = _int(record, "sender", who)
    recipients = _list(record, "recipients", int, who)
    nonces = _list(record, "nonces", bytes, who)
    boxes = _list(record, "ciphertexts", bytes, who)
    if not len(recipients) == len(nonces) == len(boxes):
        raise HeatMessageError(f"{who}: the encrypted shares do not line up")
    shares = tuple(
        EncryptedShares(session, sender, r, n, c)
        for r, n, c in zip(recipients, nonces, boxes, strict=True)
    )
    return ShareKeys(session, sender, _bytes(record, "commitment", who), shares)


def mask_request(session: bytes, inbox: Sequence[EncryptedShares]) -> dict:
    return {
        "stage": "mask",
        "session": session,
        "senders": [s.sender for s in inbox],
        "recipients": [s.recipient for s in inbox],
        "nonces": [s.nonce for s in inbox],
        "ciphertexts": [s.ciphertext for s in inbox],
    }


def inbox_of(record: ConfigRecord, session: bytes, who: str) -> list[EncryptedShares]:
    _expect(record, "mask", session, who)
    fields = [
        _list(record, "senders", int, who),
        _list(record, "recipients", int, who),
        _list(record, "nonces", bytes, who),
        _list(record, "ciphertexts", bytes, who),
    ]
    if len({len(f) for f in fields}) != 1:
        raise HeatMessageError(f"{who}: the routed shares do not line up")
    return [EncryptedShares(session, s, r, n, c) for s, r, n, c in zip(*fields, strict=True)]


def encode_masked(m: MaskedInput) -> dict:
    values = np.asarray(m.values, dtype="<u4")
    return {"stage": "mask", "session": m.session, "sender": m.sender, "values": values.tobytes()}


def decode_masked(record: ConfigRecord, session: bytes, length: int, who: str) -> MaskedInput:
    _expect(record, "mask", session, who)
    raw = _bytes(record, "values", who)
    if len(raw) != 4 * length:
        raise HeatMessageError(
            f"{who}: masked input of {len(raw)} bytes, expected {length} uint32 values"
        )
    values = np.frombuffer(raw, dtype="<u4").astype(np.uint32)
    return MaskedInput(session, _int(record, "sender", who), values)


def unmask_request(request: UnmaskRequest) -> dict:
    return {
        "stage": "unmask",
        "session": request.session,
        "survivors": list(request.survivors),
        "dropped": list(request.dropped),
    }


def request_of(record: ConfigRecord, session: bytes, who: str) -> UnmaskRequest:
    _expect(record, "unmask", session, who)
    survivors = tuple(_list(record, "survivors", int, who))
    return UnmaskRequest(session, survivors, tuple(_list(record, "dropped", int, who)))


def encode_unmask(m: UnmaskShares) -> dict:
    return {
        "stage": "unmask",
        "session": m.session,
        "sender": m.sender,
        **_shares_fields(m.self_mask_shares, "self"),
        **_shares_fields(m.mask_key_shares, "key"),
    }


def decode_unmask(record: ConfigRecord, session: bytes, who: str) -> UnmaskShares:
    _expect(record, "unmask", session, who)
    return UnmaskShares(
        session,
        _int(record, "sender", who),
        _shares_of(record, "self", who),
        _shares_of(record, "key", who),
    )


def encode_report(bits: Mapping[str, np.ndarray], num_samples: int) -> dict:
    fields: dict = {"stage": "report", "num-examples": int(num_samples)}
    fields.update({f"bits.{t}": np.packbits(b.astype(bool)).tobytes() for t, b in bits.items()})
    return fields


def decode_report(
    record: ConfigRecord, table_rows: Mapping[str, int], who: str
) -> tuple[dict[str, np.ndarray], int]:
    _expect(record, "report", None, who)
    bits = {}
    for table, size in table_rows.items():
        raw = _bytes(record, f"bits.{table}", who)
        if len(raw) != (size + 7) // 8:
            raise HeatMessageError(
                f"{who}: {len(raw)} bytes of bits for table {table!r}, expected {(size + 7) // 8}"
            )
        bits[table] = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=size).astype(bool)
    samples = _int(record, "num-examples", who)
    if samples < 0:
        raise HeatMessageError(f"{who}: num-examples = {samples} is negative")
    return bits, samples


# ---- the node's side ---------------------------------------------------------------------


def _key_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def save_client(client: SecAggClient) -> ConfigRecord:
    """A node's protocol state, kept in its own ``Context.state`` between stages."""
    peers = [client.peers[p] for p in sorted(client.peers)]
    return ConfigRecord(
        {
            "session": client.session,
            "id": client.client_id,
            "threshold": client.threshold,
            "channel-key": _key_bytes(client.channel_key),
            "mask-key": _key_bytes(client.mask_key),
            "self-mask-seed": client.self_mask_seed,
            **share_request(client.session, peers),
            **_shares_fields({u: s for u, (s, _) in client.received.items()}, "s"),
            **_shares_fields({u: b for u, (_, b) in client.received.items()}, "b"),
        }
    )


def load_client(state: ConfigRecord, session: bytes, who: str) -> SecAggClient:
    if _bytes(state, "session", who) != session:
        raise HeatMessageError(f"{who}: heat message from another session than this node's")
    peers = keys_of(ConfigRecord({**dict(state), "stage": "share"}), session, who)
    s, b = _shares_of(state, "s", who), _shares_of(state, "b", who)
    return SecAggClient(
        _int(state, "id", who),
        _int(state, "threshold", who),
        session,
        channel_key=X25519PrivateKey.from_private_bytes(_bytes(state, "channel-key", who)),
        mask_key=X25519PrivateKey.from_private_bytes(_bytes(state, "mask-key", who)),
        self_mask_seed=_bytes(state, "self-mask-seed", who),
        peers={k.sender: k for k in peers},
        received={u: (s[u], b[u]) for u in s},
    )


def answer_heat(
    message: Message,
    context: Context,
    privacy: HeatPrivacy,
    kind: HeatKind,
    table_rows: Mapping[str, int],
    rows: Mapping[str, np.ndarray],
    num_samples: int,
) -> Message:
    """A node's reply to one stage of the heat exchange (its ClientApp's ``query.heat``)."""
    who = "heat exchange (this node)"
    request = _heat_record(message.content, who)
    stage = _str(request, "stage", who)
    if privacy.source not in PRIVATE_SOURCES:
        raise HeatMessageError(
            f"{who}: asked for private heat, but this node's privacy.heat_source = "
            f"{privacy.source!r}"
        )
    if stage == "report":
        if privacy.source != "randomized-response":
            raise HeatMessageError(f"{who}: asked for randomized response, configured for secagg")
        bits = noisy_bits(privacy, table_rows, rows)
        return _reply(message, encode_report(bits, num_samples))
    if privacy.source not in SUMMED_SOURCES:
        raise HeatMessageError(f"{who}: asked for secure aggregation, configured otherwise")
    return answer_secagg(
        message,
        context,
        privacy.source,
        lambda _: summed_vector(privacy, kind, table_rows, rows, num_samples),
        who,
    )


def answer_secagg(
    message: Message,
    context: Context,
    source: str,
    vector: Callable[[ConfigRecord], np.ndarray],
    who: str,
) -> Message:
    """A node's reply to one stage of a secure sum over Flower (the heat exchange's, or the
    secure row sums' of flower/secure_rows.py): ``source`` is what this node agrees to sum,
    ``vector`` gives its uint32 input from the "mask" request."""
    request = _heat_record(message.content, who)
    stage = _str(request, "stage", who)
    session = _bytes(request, "session", who)
    if stage == "advertise":
        if _str(request, "source", who) != source:
            raise HeatMessageError(
                f"{who}: the server asks for heat source {request['source']!r}, this node's "
                f"privacy.heat_source is {source!r}"
            )
        client = SecAggClient(_int(request, "id", who), _int(request, "threshold", who), session)
        reply = encode_advertise(client.advertise())
    else:
        if STATE not in context.state:
            raise HeatMessageError(f"{who}: stage {stage!r} before this node advertised keys")
        client = load_client(record_of(context.state, STATE, ConfigRecord), session, who)
        if stage == "share":
            keys = keys_of(request, session, who)
            if len(keys) < 2 or 2 * client.threshold <= len(keys):
                raise HeatMessageError(
                    f"{who}: a group of {len(keys)} with threshold t = {client.threshold}: "
                    "the sum of fewer than two vectors, or a minority able to unmask, would "
                    "not hide this node's; refusing"
                )
            reply = encode_share_keys(client.share_keys(keys))
        elif stage == "mask":
            inbox = inbox_of(request, session, who)
            reply = encode_masked(client.masked_input(inbox, vector(request)))
        elif stage == "unmask":
            unmask = request_of(request, session, who)
            if len(unmask.survivors) < client.threshold:
                raise HeatMessageError(
                    f"{who}: only {len(unmask.survivors)} survivors, fewer than t = "
                    f"{client.threshold}: unmasking would reveal one node's vector; refusing"
                )
            reply = encode_unmask(client.unmask(unmask))
        else:
            raise HeatMessageError(f"{who}: unknown heat stage {stage!r}; expected {STAGES}")
    if stage == "unmask":
        del context.state[STATE]  # done: forget the keys
    else:
        context.state[STATE] = save_client(client)
    return _reply(message, reply)


def _reply(message: Message, fields: dict) -> Message:
    return Message(RecordDict({RECORD: ConfigRecord(fields)}), reply_to=message)


# ---- what the server received -------------------------------------------------------------


def _plain(value: object) -> object:
    """A record value as JSON: bytes as {"bytes": hex}, lists element-wise."""
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class Transcript:
    """A ``Recorder`` keeping, as JSON-able data, every reply the server received: its node,
    stage, and each record's values (arrays as lists with their dtype, bytes as hex)."""

    def __init__(self) -> None:
        self.entries: list[dict] = []

    def __call__(self, node: int, stage: str, content: RecordDict) -> None:
        records: dict[str, dict] = {}
        for name, record in content.items():
            if isinstance(record, ArrayRecord):
                records[name] = {
                    key: {"dtype": str(array.dtype), "array": array.numpy().tolist()}
                    for key, array in record.to_torch_state_dict().items()
                }
            else:
                records[name] = {key: _plain(v) for key, v in dict(record).items()}
        self.entries.append({"node": node, "stage": stage, "records": records})


# ---- the server's side -------------------------------------------------------------------


def _ask(
    grid: PushPullGrid,
    requests: Mapping[int, dict],
    stage: str,
    timeout: float,
    record: Recorder | None,
    message_type: str = MESSAGE_TYPE,
) -> dict[int, ConfigRecord]:
    """Send each node its request; the valid heat records of the replies by node."""
    messages = [
        Message(RecordDict({RECORD: ConfigRecord(fields)}), node, message_type)
        for node, fields in requests.items()
    ]
    replies: dict[int, ConfigRecord] = {}
    for reply in exchange(grid, messages, timeout):
        node = reply.metadata.src_node_id
        if reply.has_error():
            LOG.warning("heat exchange, stage %s: node %d failed: %s", stage, node, reply.error)
            continue
        if record is not None:
            record(node, stage, reply.content)
        if node not in requests or node in replies:
            LOG.warning("heat exchange, stage %s: unexpected reply from node %d", stage, node)
            continue
        try:
            replies[node] = _heat_record(reply.content, f"node {node}")
        except HeatMessageError as error:
            LOG.warning("heat exchange, stage %s: %s; left out", stage, error)
    for node in sorted(set(requests) - set(replies)):
        LOG.warning("heat exchange, stage %s: no reply from node %d; left out", stage, node)
    return replies


def _decoded(replies: Mapping[int, ConfigRecord], decode: Callable, stage: str, ids) -> list:
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
    grid: PushPullGrid,
    group: Sequence[int],
    source: str,
    length: int,
    timeout: float,
    record: Recorder | None,
    message_type: str = MESSAGE_TYPE,
    mask_fields: Mapping[int, dict] | None = None,
    threshold: int | None = None,
) -> tuple[np.ndarray, tuple[int, ...]]:
    """One group's secure sum (secagg's four stages as ``message_type`` Messages) and the
    nodes whose vectors it holds; ``mask_fields`` adds per-node fields to the "mask"
    request (what a node needs to build its vector); ``threshold``: secagg's t (default the
    majority)."""
    session = secrets.token_bytes(16)
    threshold = threshold or len(group) // 2 + 1
    ids = {node: i for i, node in enumerate(group)}
    node_of = dict(enumerate(group))
    server = SecAggServer(threshold, length, session)
    extra = mask_fields or {}

    def ask(requests: Mapping[int, dict], stage: str, decode: Callable) -> list:
        replies = _ask(grid, requests, stage, timeout, record, message_type)
        return _decoded(replies, decode, stage, ids)

    keys = server.collect_keys(
        ask(
            {n: advertise_request(session, ids[n], threshold, source) for n in group},
            "advertise",
            lambda r, who: decode_advertise(r, session, who),
        )
    )
    routed = server.route_shares(
        ask(
            {node_of[k.sender]: share_request(session, keys) for k in keys},
            "share",
            lambda r, who: decode_share_keys(r, session, who),
        )
    )
    request = server.collect_masked(
        ask(
            {
                node_of[u]: {**mask_request(session, inbox), **extra.get(node_of[u], {})}
                for u, inbox in routed.items()
            },
            "mask",
            lambda r, who: decode_masked(r, session, length, who),
        )
    )
    total = server.finish(
        request,
        ask(
            {node_of[u]: unmask_request(request) for u in request.survivors},
            "unmask",
            lambda r, who: decode_unmask(r, session, who),
        ),
    )
    for rejection in server.rejections:
        LOG.warning(
            "heat exchange, step %d: node %d rejected: %s",
            rejection.step,
            node_of.get(rejection.client, -1),
            rejection.reason,
        )
    return total, tuple(node_of[u] for u in request.survivors)


def groups_of(nodes: Sequence[int], size: int) -> list[list[int]]:
    """Consecutive groups of ``size`` nodes; a last group of one joins the one before, since
    a group's sum is all the server learns and one node's sum is its vector."""
    groups = [list(nodes[i : i + size]) for i in range(0, len(nodes), size)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        groups[-2].extend(groups.pop())
    return groups


def collect_heat(
    grid: PushPullGrid,
    nodes: Sequence[int],
    privacy: HeatPrivacy,
    kind: HeatKind,
    table_rows: Mapping[str, int],
    timeout: float,
    record: Recorder | None = None,
) -> HeatReport:
    """The heat of ``nodes``' rows by the private source ``privacy.source``, over Flower;
    ``record`` sees every reply the server receives. Raises ``SecAggError`` when a group
    keeps fewer than its threshold of nodes."""
    if privacy.source not in PRIVATE_SOURCES:
        raise ValueError(f"heat source {privacy.source!r} is not private: no exchange to run")
    if privacy.source == "randomized-response":
        replies = _ask(grid, {n: {"stage": "report"} for n in nodes}, "report", timeout, record)
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
            group_total, survivors = group_sum(grid, group, privacy.source, length, timeout, record)
        except SecAggError as error:  # name the group: the operator's next step
            raise SecAggError(
                f"heat exchange ({privacy.source}), group of nodes {group}: {error}"
            ) from None
        total += group_total.astype(np.int64)
        contributors.extend(survivors)
    return HeatReport(heat_from_sum(privacy, table_rows, total), tuple(contributors))
