"""The secure aggregation protocol's messages (``fedsub.privacy.secagg``) as flat records of
numbers, bytes, text and lists, and back, checked: whatever carries them (privacy/heat_protocol.py
and privacy/secure_rows_protocol.py, as Flower Messages by flower/protocols.py), a reply that
does not fit raises a ``HeatMessageError`` naming the sender (``who``) and the field. Also
a node's protocol state as such a record, and the randomized-response report."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from fedsub.errors import FedsubError
from fedsub.privacy import shamir
from fedsub.privacy.secagg import (
    AdvertiseKeys,
    EncryptedShares,
    MaskedInput,
    SecAggClient,
    ShareKeys,
    UnmaskRequest,
    UnmaskShares,
)

Record = Mapping[str, object]  # one message's fields (a Flower ConfigRecord is one)


class HeatMessageError(FedsubError):
    """A heat message that does not fit the protocol (named by node and stage)."""


# ---- typed fields of a message ------------------------------------------------------------


def _get(record: Record, key: str, kind: type, who: str) -> object:
    if key not in record:
        raise HeatMessageError(f"{who}: heat message lacks {key!r}")
    value = record[key]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise HeatMessageError(
            f"{who}: heat message's {key!r} is a {type(value).__name__}, expected {kind.__name__}"
        )
    return value


def number_field(record: Record, key: str, kind: type[int] | type[float], who: str) -> float:
    """A numeric field of a protocol message, checked (for privacy/secure_rows_protocol.py too)."""
    return float(_get(record, key, kind, who))  # type: ignore[arg-type]  # checked number


def int_list_field(record: Record, key: str, who: str) -> list[int]:
    return _list(record, key, int, who)


def int_field(record: Record, key: str, who: str) -> int:
    return int(_get(record, key, int, who))  # type: ignore[call-overload]  # checked int


def bytes_field(record: Record, key: str, who: str) -> bytes:
    return bytes(_get(record, key, bytes, who))  # type: ignore[call-overload]  # checked bytes


def text_field(record: Record, key: str, who: str) -> str:
    return str(_get(record, key, str, who))


def _list(record: Record, key: str, kind: type, who: str) -> list:
    value = _get(record, key, list, who)
    assert isinstance(value, list)
    if any(not isinstance(v, kind) or isinstance(v, bool) for v in value):
        raise HeatMessageError(f"{who}: heat message's {key!r} must be a list of {kind.__name__}")
    return value


def _expect(record: Record, stage: str, session: bytes | None, who: str) -> None:
    got = text_field(record, "stage", who)
    if got != stage:
        raise HeatMessageError(f"{who}: heat message of stage {got!r}, expected {stage!r}")
    if session is not None and bytes_field(record, "session", who) != session:
        raise HeatMessageError(f"{who}: heat message from another session")


def _shares_fields(shares: Mapping[int, shamir.Share], prefix: str) -> dict[str, list]:
    owners = sorted(shares)
    return {
        f"{prefix}-owners": owners,
        f"{prefix}-x": [shares[o][0] for o in owners],
        f"{prefix}-y": [shares[o][1].to_bytes(shamir.SHARE_BYTES, "big") for o in owners],
    }


def _shares_of(record: Record, prefix: str, who: str) -> dict[int, shamir.Share]:
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


def decode_advertise(record: Record, session: bytes, who: str) -> AdvertiseKeys:
    _expect(record, "advertise", session, who)
    return AdvertiseKeys(
        session,
        int_field(record, "sender", who),
        bytes_field(record, "channel-key", who),
        bytes_field(record, "mask-key", who),
    )


def share_request(session: bytes, keys: Sequence[AdvertiseKeys]) -> dict:
    return {
        "stage": "share",
        "session": session,
        "senders": [k.sender for k in keys],
        "channel-keys": [k.channel_key for k in keys],
        "mask-keys": [k.mask_key for k in keys],
    }


def keys_of(record: Record, session: bytes, who: str) -> list[AdvertiseKeys]:
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


def decode_share_keys(record: Record, session: bytes, who: str) -> ShareKeys:
    _expect(record, "share", session, who)
    sender = int_field(record, "sender", who)
    recipients = _list(record, "recipients", int, who)
    nonces = _list(record, "nonces", bytes, who)
    boxes = _list(record, "ciphertexts", bytes, who)
    if not len(recipients) == len(nonces) == len(boxes):
        raise HeatMessageError(f"{who}: the encrypted shares do not line up")
    shares = tuple(
        EncryptedShares(session, sender, r, n, c)
        for r, n, c in zip(recipients, nonces, boxes, strict=True)
    )
    return ShareKeys(session, sender, bytes_field(record, "commitment", who), shares)


def mask_request(session: bytes, inbox: Sequence[EncryptedShares]) -> dict:
    return {
        "stage": "mask",
        "session": session,
        "senders": [s.sender for s in inbox],
        "recipients": [s.recipient for s in inbox],
        "nonces": [s.nonce for s in inbox],
        "ciphertexts": [s.ciphertext for s in inbox],
    }


def inbox_of(record: Record, session: bytes, who: str) -> list[EncryptedShares]:
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


def decode_masked(record: Record, session: bytes, length: int, who: str) -> MaskedInput:
    _expect(record, "mask", session, who)
    raw = bytes_field(record, "values", who)
    if len(raw) != 4 * length:
        raise HeatMessageError(
            f"{who}: masked input of {len(raw)} bytes, expected {length} uint32 values"
        )
    values = np.frombuffer(raw, dtype="<u4").astype(np.uint32)
    return MaskedInput(session, int_field(record, "sender", who), values)


def unmask_request(request: UnmaskRequest) -> dict:
    return {
        "stage": "unmask",
        "session": request.session,
        "survivors": list(request.survivors),
        "dropped": list(request.dropped),
    }


def request_of(record: Record, session: bytes, who: str) -> UnmaskRequest:
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


def decode_unmask(record: Record, session: bytes, who: str) -> UnmaskShares:
    _expect(record, "unmask", session, who)
    return UnmaskShares(
        session,
        int_field(record, "sender", who),
        _shares_of(record, "self", who),
        _shares_of(record, "key", who),
    )


def encode_report(bits: Mapping[str, np.ndarray], num_samples: int) -> dict:
    fields: dict = {"stage": "report", "num-examples": int(num_samples)}
    fields.update({f"bits.{t}": np.packbits(b.astype(bool)).tobytes() for t, b in bits.items()})
    return fields


def decode_report(
    record: Record, table_rows: Mapping[str, int], who: str
) -> tuple[dict[str, np.ndarray], int]:
    _expect(record, "report", None, who)
    bits = {}
    for table, size in table_rows.items():
        raw = bytes_field(record, f"bits.{table}", who)
        if len(raw) != (size + 7) // 8:
            raise HeatMessageError(
                f"{who}: {len(raw)} bytes of bits for table {table!r}, expected {(size + 7) // 8}"
            )
        bits[table] = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=size).astype(bool)
    samples = int_field(record, "num-examples", who)
    if samples < 0:
        raise HeatMessageError(f"{who}: num-examples = {samples} is negative")
    return bits, samples


# ---- a node's protocol state -----------------------------------------------------------------


def _key_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def save_client(client: SecAggClient) -> dict:
    """A node's protocol state, which it keeps between stages (never sent)."""
    peers = [client.peers[p] for p in sorted(client.peers)]
    return {
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


def load_client(state: Record, session: bytes, who: str) -> SecAggClient:
    if bytes_field(state, "session", who) != session:
        raise HeatMessageError(f"{who}: heat message from another session than this node's")
    peers = keys_of({**dict(state), "stage": "share"}, session, who)
    s, b = _shares_of(state, "s", who), _shares_of(state, "b", who)
    return SecAggClient(
        int_field(state, "id", who),
        int_field(state, "threshold", who),
        session,
        channel_key=X25519PrivateKey.from_private_bytes(bytes_field(state, "channel-key", who)),
        mask_key=X25519PrivateKey.from_private_bytes(bytes_field(state, "mask-key", who)),
        self_mask_seed=bytes_field(state, "self-mask-seed", who),
        peers={k.sender: k for k in peers},
        received={u: (s[u], b[u]) for u in s},
    )
