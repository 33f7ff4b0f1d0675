"""Mutual challenge–response authentication over the job's shared secret (sans-IO).

The connector opens with HELLO {job, rank, nonce_c}. The listener answers CHALLENGE
{nonce_s, proof_s}, where proof_s proves it knows the secret; the connector checks it and answers
AUTH {proof_c}; the listener checks that and sends WELCOME. Proofs are HMAC-SHA256 over both
nonces, the job id, the connector's rank and a role label, so a proof cannot be replayed on
another connection, for another rank, or reflected back in the other direction. Comparisons are
constant-time (:func:`hmac.compare_digest`). Until WELCOME, frames may carry no payload.
"""

from __future__ import annotations

import hashlib
import hmac
import os

NONCE_BYTES = 32


def new_nonce() -> bytes:
    """A fresh random nonce for one connection."""
    return os.urandom(NONCE_BYTES)


def proof(secret: bytes, role: str, job: str, rank: int, nonce_c: bytes, nonce_s: bytes) -> bytes:
    """HMAC-SHA256 binding the secret to this connection, direction and connector rank."""
    msg = b"\0".join([b"aioreduce-auth-v1", role.encode(), job.encode(), str(rank).encode(),
                      nonce_c, nonce_s])
    return hmac.new(secret, msg, hashlib.sha256).digest()


def check(expected: bytes, received: object) -> bool:
    """Constant-time comparison that tolerates a wrong type from the peer."""
    return isinstance(received, bytes) and hmac.compare_digest(expected, received)
