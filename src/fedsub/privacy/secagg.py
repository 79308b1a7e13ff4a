"""Secure aggregation of integer vectors mod 2^32 (Bonawitz et al., CCS 2017).

The server learns the sum of the surviving clients' vectors and nothing else about any one
of them, even when up to n - t clients drop after sending their masked input. Every step is a
function from plain data messages to plain data messages, so the protocol runs the same in
the simulator (``secure_sum``) and over a network.

    step 0  client -> server   AdvertiseKeys(c_pk, s_pk)             server broadcasts Keys
    step 1  client -> server   ShareKeys: per peer, AEAD(shares of s_sk and of b_u),
                               and a commitment H(b_u)               server routes to peers
    step 2  client -> server   MaskedInput y_u = x_u + PRG(b_u) + sum_v +-PRG(s_uv)
    step 3  client -> server   UnmaskShares: shares of b_u for survivors, of s_sk for
                               the dropped                           server reconstructs

``s_uv`` comes from X25519(s_sk_u, s_pk_v), so the pairwise masks of u and v cancel in the sum;
b_u's self mask stops the server from learning y_u - x_u by reconstructing s_sk of a slow
client. Messages carry the session id, step and sender; a malformed, replayed or foreign
message is rejected with its sender named, and the protocol goes on without that client while
at least t remain.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from fedsub.errors import FedsubError
from fedsub.privacy import shamir
from fedsub.privacy.masks import derive, expand


class SecAggError(FedsubError):
    """The protocol cannot finish (e.g. fewer than t clients left)."""


@dataclass(frozen=True)
class Rejection:
    client: int
    step: int
    reason: str


# ---- messages (plain data) -------------------------------------------------------------


@dataclass(frozen=True)
class AdvertiseKeys:
    session: bytes
    sender: int
    channel_key: bytes  # X25519 public key for the share channel
    mask_key: bytes  # X25519 public key for pairwise masks


@dataclass(frozen=True)
class EncryptedShares:
    session: bytes
    sender: int
    recipient: int
    nonce: bytes
    ciphertext: bytes


@dataclass(frozen=True)
class ShareKeys:
    session: bytes
    sender: int
    self_mask_commitment: bytes
    shares: tuple[EncryptedShares, ...]


@dataclass(frozen=True)
class MaskedInput:
    session: bytes
    sender: int
    values: np.ndarray  # uint32


@dataclass(frozen=True)
class UnmaskRequest:
    session: bytes
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]


@dataclass(frozen=True)
class UnmaskShares:
    session: bytes
    sender: int
    self_mask_shares: dict[int, shamir.Share]  # for survivors
    mask_key_shares: dict[int, shamir.Share]  # for dropped clients


# ---- helpers -----------------------------------------------------------------------------


def _public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _private_int(key: X25519PrivateKey) -> int:
    return int.from_bytes(key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()), "big")


def _key_from_int(value: int) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(value.to_bytes(32, "big"))


def _aad(session: bytes, sender: int, recipient: int) -> bytes:
    return session + struct.pack(">II", sender, recipient) + b"step1"


def _pack_shares(
    sender: int, recipient: int, s_share: shamir.Share, b_share: shamir.Share
) -> bytes:
    n = shamir.SHARE_BYTES
    return (
        struct.pack(">IIII", sender, recipient, s_share[0], b_share[0])
        + s_share[1].to_bytes(n, "big")
        + b_share[1].to_bytes(n, "big")
    )


def _unpack_shares(blob: bytes) -> tuple[int, int, shamir.Share, shamir.Share]:
    n = shamir.SHARE_BYTES
    if len(blob) != 16 + 2 * n:
        raise ValueError(f"share payload of {len(blob)} bytes, expected {16 + 2 * n}")
    sender, recipient, sx, bx = struct.unpack(">IIII", blob[:16])
    sy = int.from_bytes(blob[16 : 16 + n], "big")
    by = int.from_bytes(blob[16 + n :], "big")
    return sender, recipient, (sx, sy), (bx, by)


def pairwise_mask(
    own_mask_key: X25519PrivateKey, peer_public: bytes, session: bytes, length: int
) -> np.ndarray:
    secret = own_mask_key.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return expand(derive(secret, b"pairwise-mask", session), length)


def _commit(seed: bytes) -> bytes:
    return hashlib.sha256(b"fedsub-secagg-self-mask" + seed).digest()


# ---- client ------------------------------------------------------------------------------


@dataclass
class SecAggClient:
    """One client's side of the protocol; its vector never leaves it unmasked."""

    client_id: int
    threshold: int
    session: bytes
    modulus_bits: int = 32
    channel_key: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    mask_key: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    self_mask_seed: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    peers: dict[int, AdvertiseKeys] = field(default_factory=dict)
    received: dict[int, tuple[shamir.Share, shamir.Share]] = field(default_factory=dict)
    channels: dict[int, ChaCha20Poly1305] = field(default_factory=dict)

    def advertise(self) -> AdvertiseKeys:
        return AdvertiseKeys(
            self.session,
            self.client_id,
            _public_bytes(self.channel_key),
            _public_bytes(self.mask_key),
        )

    def _channel(self, peer: int) -> ChaCha20Poly1305:
        if peer not in self.channels:
            secret = self.channel_key.exchange(
                X25519PublicKey.from_public_bytes(self.peers[peer].channel_key)
            )
            self.channels[peer] = ChaCha20Poly1305(derive(secret, b"share-channel", self.session))
        return self.channels[peer]

    def share_keys(self, keys: Iterable[AdvertiseKeys]) -> ShareKeys:
        self.peers = {k.sender: k for k in keys}
        n = max(self.peers) + 1
        s_shares = shamir.split(_private_int(self.mask_key), n, self.threshold)
        b_shares = shamir.split(int.from_bytes(self.self_mask_seed, "big"), n, self.threshold)
        encrypted = []
        for peer in sorted(self.peers):
            payload = _pack_shares(self.client_id, peer, s_shares[peer], b_shares[peer])
            nonce = secrets.token_bytes(12)
            box = self._channel(peer).encrypt(
                nonce, payload, _aad(self.session, self.client_id, peer)
            )
            encrypted.append(EncryptedShares(self.session, self.client_id, peer, nonce, box))
        return ShareKeys(
            self.session, self.client_id, _commit(self.self_mask_seed), tuple(encrypted)
        )

    def masked_input(self, inbox: Iterable[EncryptedShares], values: np.ndarray) -> MaskedInput:
        """Decrypts the shares addressed to it, then masks ``values`` (uint32)."""
        for message in inbox:
            if message.recipient != self.client_id or message.session != self.session:
                continue
            try:
                plain = self._channel(message.sender).decrypt(
                    message.nonce,
                    message.ciphertext,
                    _aad(self.session, message.sender, self.client_id),
                )
            except (InvalidTag, KeyError, ValueError):
                raise SecAggError(
                    f"client {self.client_id}: shares from client {message.sender} failed "
                    "authentication; aborting as the protocol requires"
                ) from None
            sender, recipient, s_share, b_share = _unpack_shares(plain)
            if (sender, recipient) != (message.sender, self.client_id):
                raise ValueError(f"share from client {message.sender} is addressed wrongly")
            self.received[sender] = (s_share, b_share)
        values = np.asarray(values)
        if values.size and (values.min() < 0 or int(values.max()) >= 1 << self.modulus_bits):
            raise ValueError(
                f"client {self.client_id}: inputs must lie in [0, 2^{self.modulus_bits})"
            )
        values = values.astype(np.uint32)
        masked = values + expand(self.self_mask_seed, len(values))
        for peer in self.received:
            if peer == self.client_id:
                continue
            mask = pairwise_mask(
                self.mask_key, self.peers[peer].mask_key, self.session, len(values)
            )
            masked = masked + mask if self.client_id < peer else masked - mask
        return MaskedInput(
            self.session, self.client_id, masked.astype(np.uint32) & _low_bits(self.modulus_bits)
        )

    def unmask(self, request: UnmaskRequest) -> UnmaskShares:
        if request.session != self.session:
            raise ValueError("unmask request from another session")
        if set(request.survivors) & set(request.dropped):
            raise ValueError("a client cannot be both survivor and dropped: refusing to unmask")
        return UnmaskShares(
            self.session,
            self.client_id,
            {u: self.received[u][1] for u in request.survivors if u in self.received},
            {u: self.received[u][0] for u in request.dropped if u in self.received},
        )


# ---- server ------------------------------------------------------------------------------


@dataclass
class SecAggServer:
    """The aggregator: routes messages, learns only the sum of the survivors' vectors."""

    threshold: int
    length: int
    session: bytes
    modulus_bits: int = 32
    keys: dict[int, AdvertiseKeys] = field(default_factory=dict)
    commitments: dict[int, bytes] = field(default_factory=dict)
    routed: dict[int, list[EncryptedShares]] = field(default_factory=dict)
    masked: dict[int, np.ndarray] = field(default_factory=dict)
    rejections: list[Rejection] = field(default_factory=list)
    _seen: set[tuple[int, int]] = field(default_factory=set)

    def _accept(self, step: int, sender: int, session: bytes) -> bool:
        if session != self.session:
            self.rejections.append(Rejection(sender, step, "message from another session"))
            return False
        if (step, sender) in self._seen:
            self.rejections.append(Rejection(sender, step, "replayed message"))
            return False
        self._seen.add((step, sender))
        return True

    def _need(self, alive: Iterable[int], step: str) -> None:
        count = len(set(alive))
        if count < self.threshold:
            raise SecAggError(
                f"only {count} clients left at {step}; the threshold is t = {self.threshold}, "
                "so the sum cannot be recovered"
            )

    def collect_keys(self, messages: Iterable[AdvertiseKeys]) -> list[AdvertiseKeys]:
        for m in messages:
            if not self._accept(0, m.sender, m.session):
                continue
            if len(m.channel_key) != 32 or len(m.mask_key) != 32:
                self.rejections.append(Rejection(m.sender, 0, "public keys must be 32 bytes"))
                continue
            self.keys[m.sender] = m
        self._need(self.keys, "key advertisement")
        return [self.keys[k] for k in sorted(self.keys)]

    def route_shares(self, messages: Iterable[ShareKeys]) -> dict[int, list[EncryptedShares]]:
        senders = {}
        for m in messages:
            if not self._accept(1, m.sender, m.session) or m.sender not in self.keys:
                continue
            recipients = sorted(s.recipient for s in m.shares)
            if recipients != sorted(self.keys) or any(s.sender != m.sender for s in m.shares):
                self.rejections.append(Rejection(m.sender, 1, "shares not one per advertised peer"))
                continue
            senders[m.sender] = m
        self._need(senders, "key sharing")
        self.commitments = {u: m.self_mask_commitment for u, m in senders.items()}
        self.routed = {v: [] for v in senders}
        for m in senders.values():
            for share in m.shares:
                if share.recipient in self.routed:
                    self.routed[share.recipient].append(share)
        return self.routed

    def collect_masked(self, messages: Iterable[MaskedInput]) -> UnmaskRequest:
        for m in messages:
            if not self._accept(2, m.sender, m.session) or m.sender not in self.commitments:
                continue
            values = np.asarray(m.values)
            if values.shape != (self.length,) or values.dtype != np.uint32:
                self.rejections.append(
                    Rejection(
                        m.sender,
                        2,
                        f"masked input must be {self.length} uint32 values, got "
                        f"{values.shape} {values.dtype}",
                    )
                )
                continue
            self.masked[m.sender] = values
        self._need(self.masked, "masked input collection")
        survivors = tuple(sorted(self.masked))
        dropped = tuple(sorted(set(self.commitments) - set(self.masked)))
        return UnmaskRequest(self.session, survivors, dropped)

    def finish(self, request: UnmaskRequest, responses: Iterable[UnmaskShares]) -> np.ndarray:
        """The sum over ``request.survivors`` of their vectors, mod 2^32."""
        accepted = [r for r in responses if self._accept(3, r.sender, r.session)]
        accepted = [r for r in accepted if r.sender in request.survivors]
        self._need([r.sender for r in accepted], "unmasking")
        total = np.zeros(self.length, dtype=np.uint32)
        for values in (self.masked[u] for u in request.survivors):
            total = total + values
        for u in request.survivors:
            shares = {r.sender: r.self_mask_shares.get(u) for r in accepted}
            commitment = self.commitments[u]
            seed_int = self._recover(
                u,
                shares,
                lambda s, c=commitment: _fits_32_bytes(s) and _commit(s.to_bytes(32, "big")) == c,
            )
            total = total - expand(seed_int.to_bytes(32, "big"), self.length)
        for u in request.dropped:
            shares = {r.sender: r.mask_key_shares.get(u) for r in accepted}
            expected_public = self.keys[u].mask_key
            key_int = self._recover(
                u,
                shares,
                lambda s, p=expected_public: (
                    _fits_32_bytes(s) and _public_bytes(_key_from_int(s)) == p
                ),
            )
            key = _key_from_int(key_int)
            for v in request.survivors:
                mask = pairwise_mask(key, self.keys[v].mask_key, self.session, self.length)
                # v added +mask if v < u, else -mask: take it back out
                total = total - mask if v < u else total + mask
        return total.astype(np.uint32) & _low_bits(self.modulus_bits)

    def _recover(self, owner: int, shares: dict[int, shamir.Share | None], valid) -> int:
        """The secret of ``owner`` from its shares, naming any client whose share is bad."""
        offered = {sender: s for sender, s in shares.items() if s is not None}
        if len(offered) < self.threshold:
            raise SecAggError(
                f"only {len(offered)} shares of client {owner}'s secret; need t = {self.threshold}"
            )
        senders = sorted(offered)
        for subset in combinations(senders, self.threshold):
            secret = shamir.reconstruct([offered[s] for s in subset])
            if valid(secret):
                points = [offered[s] for s in subset]
                for sender in senders:
                    x, y = offered[sender]
                    if shamir.interpolate(points, x) != y:
                        self.rejections.append(
                            Rejection(sender, 3, f"bad share of client {owner}'s secret")
                        )
                return secret
        raise SecAggError(f"no t = {self.threshold} of the shares of client {owner} agree")


def _low_bits(bits: int) -> np.uint32:
    """The mask that reduces mod 2^bits (bits <= 32): arithmetic runs mod 2^32 and is then
    reduced, which is exact because 2^bits divides 2^32."""
    if not 1 <= bits <= 32:
        raise ValueError(f"modulus must be 2^bits with 1 <= bits <= 32, got bits = {bits}")
    return np.uint32((1 << bits) - 1)


def _fits_32_bytes(value: int) -> bool:
    return 0 <= value < 2**256


def secure_sum(
    vectors: dict[int, np.ndarray],
    threshold: int,
    drop_before_masking: Iterable[int] = (),
    drop_after_masking: Iterable[int] = (),
    modulus_bits: int = 32,
) -> tuple[np.ndarray, SecAggServer]:
    """Run the protocol in process over ``vectors`` (client id -> uint32 vector).

    Clients in ``drop_before_masking`` vanish after sharing their keys (the server removes
    their pairwise masks from the others' inputs); clients in ``drop_after_masking`` send their
    masked input and then vanish (their input counts, but they help no one unmask). Returns
    the sum over the clients whose masked input arrived, and the server (its view)."""
    session = secrets.token_bytes(16)
    length = len(next(iter(vectors.values())))
    clients = {i: SecAggClient(i, threshold, session, modulus_bits) for i in vectors}
    server = SecAggServer(threshold, length, session, modulus_bits)
    keys = server.collect_keys(c.advertise() for c in clients.values())
    inboxes = server.route_shares(c.share_keys(keys) for c in clients.values())
    before, after = set(drop_before_masking), set(drop_after_masking)
    masked = [clients[u].masked_input(inboxes[u], vectors[u]) for u in inboxes if u not in before]
    request = server.collect_masked(masked)
    responses = [clients[v].unmask(request) for v in request.survivors if v not in after]
    return server.finish(request, responses), server
