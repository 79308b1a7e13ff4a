"""Mask expansion and key derivation for secure aggregation (arithmetic mod 2^32).

A 32-byte seed is expanded into a uint32 vector by the ChaCha20 keystream; keys for masks and
for the share channel come from X25519 agreements through HKDF-SHA256, each bound to the
session and its purpose so that no derived key serves two roles.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

ZERO_NONCE = bytes(16)


def expand(seed: bytes, length: int) -> np.ndarray:
    """``length`` pseudo-random uint32 values from a 32-byte seed (ChaCha20 keystream)."""
    encryptor = Cipher(algorithms.ChaCha20(seed, ZERO_NONCE), mode=None).encryptor()
    stream = encryptor.update(bytes(4 * length))
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32)


def derive(shared_secret: bytes, purpose: bytes, session: bytes) -> bytes:
    return HKDF(
        algorithm=hashes.SHA256(), length=32, salt=session, info=b"fedsub-secagg/" + purpose
    ).derive(shared_secret)
