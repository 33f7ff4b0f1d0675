"""Mutual challenge–response authentication over the job's shared secret (sans-IO).

The connector opens with HELLO {job, rank, nonce_c}. The listener answers CHALLENGE
{nonce_s, proof_s}, where proof_s proves it knows the secret; the connector checks it and answers
AUTH {proof_c}; the listener checks that and sends WELCOME. Proofs are HMAC-SHA256 over both
nonces, the job id, the connector's rank and a role label, so a proof cannot be replayed on
another connection, for another rank, or reflected back in the other direction. Comparisons are
constant-time (:func:`hmac.compare_digest`). Until WELCOME, frames may carry no payload.

Each side also says which *incarnation* of its rank it is (HELLO's and CHALLENGE's ``inc``,
bound into the proofs): 0 for the processes the job started with, one more for each process
that replaced a dead one. A process that starts without one (-1, "joining") gets it from rank 0
at the rendezvous; the mesh refuses a connection from an older incarnation than it knows (see
:mod:`aioreduce.transport.mesh`).

A side that refuses the handshake says so before it closes: a control frame whose op is
"refused", with the reason (:func:`refusal`). So a connection that just closes, with no
refusal, means the peer is gone (killed, or its host went away), not that it refused us: the
dialer reports a lost peer, which a job that tolerates deaths goes on without, rather than a
fatal misconfiguration. A connector believes a refusal's reason only from a listener that
proved the secret; before that it is a stranger's word, reported as such.

A connector that names another job id is taken through the handshake under *its* job id: if
it proves the secret, it is one of ours started with the wrong id (a launch mistake, not an
attacker), so instead of WELCOME it is told which job this is, and the listener reports
:class:`WrongJob`. A stranger learns nothing: it fails at the proof like any other.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
from dataclasses import dataclass

from .frame import Header, Kind
from .incarnation import JOINING

NONCE_BYTES = 32


def new_nonce() -> bytes:
    """A fresh random nonce for one connection."""
    return os.urandom(NONCE_BYTES)


def proof(secret: bytes, role: str, job: str, rank: int, nonce_c: bytes, nonce_s: bytes,
          inc: int = 0) -> bytes:
    """HMAC-SHA256 binding the secret to this connection, direction, connector rank and the
    incarnation the proving side claims."""
    msg = b"\0".join([b"aioreduce-auth-v2", role.encode(), job.encode(), str(rank).encode(),
                      nonce_c, nonce_s, str(inc).encode()])
    return hmac.new(secret, msg, hashlib.sha256).digest()


def check(expected: bytes, received: object) -> bool:
    """Constant-time comparison that tolerates a wrong type from the peer."""
    return isinstance(received, bytes) and hmac.compare_digest(expected, received)


# -- the two sides as state machines: headers in, headers to send and an event out ---------------

@dataclass(frozen=True)
class Proved:
    """Connector side: the listener proved the secret; authenticate the connection the moment
    WELCOME is parsed (data may follow it in the same read), then send the outputs."""

    rank: int
    incarnation: int = 0  # the listener's


@dataclass(frozen=True)
class Accepted:
    """The handshake is complete: the peer is ``rank``, incarnation ``incarnation``."""

    rank: int
    incarnation: int = 0


@dataclass(frozen=True)
class Refused:
    """The handshake failed; drop the connection. ``reason`` says why (for the log)."""

    reason: str


@dataclass(frozen=True)
class WrongJob:
    """Listener side: ``rank`` proved the secret but was started for job ``job``; it has been
    told which job this is. Drop the connection and report it."""

    rank: int
    job: str


MAX_JOB_ID = 128  # characters of a job id accepted in HELLO

Event = Proved | Accepted | Refused | WrongJob | None


class _Fail(Exception):
    """Internal: the handshake fails with this reason (reported as :class:`Refused`)."""

Step = tuple[list[Header], Event]

MAX_REASON = 256  # characters of a refusal's reason sent or believed


def refusal(rank: int, reason: str) -> Header:
    """The frame a side sends, before it closes, to say it refuses the handshake and why."""
    return Header(Kind.CONTROL, src=rank, meta={"op": "refused", "reason": reason[:MAX_REASON]})


def _refused_by(header: Header) -> str | None:
    """The reason, if ``header`` is the peer's :func:`refusal`."""
    if header.kind is not Kind.CONTROL or header.meta.get("op") != "refused":
        return None
    return str(header.meta.get("reason"))[:MAX_REASON]


class _State(enum.Enum):
    START = 0
    SENT_CHALLENGE = 1  # listener
    SENT_HELLO = 2  # connector
    SENT_AUTH = 3  # connector
    DONE = 4
    FAILED = 5


class ListenerHandshake:
    """The accepting side: HELLO in, CHALLENGE out; AUTH in, WELCOME out and Accepted.

    Bounded and cheap before the peer proves the secret: one HMAC per connection, no payload
    (the decoder refuses payloads until the handshake is done).
    """

    def __init__(self, secret: bytes, job: str, rank: int, world_size: int,
                 incarnation: int = 0) -> None:
        self._secret, self._job, self._rank, self._world = secret, job, rank, world_size
        self._inc = incarnation
        self._state = _State.START
        self._peer = -1
        self._peer_inc = 0
        self._nonces = (b"", b"")
        self._claimed_job = job  # the job id the proofs are computed for

    def receive(self, header: Header) -> Step:
        try:
            if self._state is _State.START:
                return self._hello(_expect(header, Kind.HELLO))
            if self._state is _State.SENT_CHALLENGE:
                return self._auth(_expect(header, Kind.AUTH))
            raise _Fail(f"unexpected {header.kind.name} frame")
        except _Fail as exc:
            self._state = _State.FAILED
            return [refusal(self._rank, str(exc))], Refused(str(exc))

    def _hello(self, hello: Header) -> Step:
        job, rank, nonce_c = (hello.meta.get(k) for k in ("job", "rank", "nonce"))
        if not isinstance(job, str) or len(job) > MAX_JOB_ID:
            raise _Fail("no valid job id")
        if (not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self._world
                or rank == self._rank):
            raise _Fail(f"invalid rank {rank!r}")
        if not isinstance(nonce_c, bytes):
            raise _Fail("no nonce")
        inc = hello.meta.get("inc", 0)
        if not isinstance(inc, int) or isinstance(inc, bool) or inc < JOINING:
            raise _Fail(f"invalid incarnation {inc!r}")
        nonce_s = new_nonce()
        self._peer, self._nonces, self._claimed_job = rank, (nonce_c, nonce_s), job
        self._peer_inc = inc
        mine = proof(self._secret, "listener", job, rank, nonce_c, nonce_s, self._inc)
        self._state = _State.SENT_CHALLENGE
        return [Header(Kind.CHALLENGE, src=self._rank,
                       meta={"nonce": nonce_s, "proof": mine, "inc": self._inc})], None

    def _auth(self, auth: Header) -> Step:
        theirs = proof(self._secret, "connector", self._claimed_job, self._peer, *self._nonces,
                       self._peer_inc)
        if not check(theirs, auth.meta.get("proof")):
            raise _Fail("wrong proof of the job secret"
                        + (f" (for job id {self._claimed_job!r})"
                           if self._claimed_job != self._job else ""))
        if self._claimed_job != self._job:
            self._state = _State.FAILED
            return ([Header(Kind.CONTROL, src=self._rank,
                            meta={"op": "wrong-job", "job": self._job[:MAX_JOB_ID]})],
                    WrongJob(self._peer, self._claimed_job))
        self._state = _State.DONE
        return [Header(Kind.WELCOME, src=self._rank)], Accepted(self._peer, self._peer_inc)


class ConnectorHandshake:
    """The dialing side: :meth:`start` gives HELLO; CHALLENGE in, AUTH out and Proved;
    WELCOME in, Accepted."""

    def __init__(self, secret: bytes, job: str, rank: int, peer: int,
                 incarnation: int = 0) -> None:
        self._secret, self._job, self._rank, self._peer = secret, job, rank, peer
        self._inc = incarnation
        self._peer_inc = 0
        self._state = _State.START
        self._nonce_c = b""

    def start(self) -> Header:
        self._nonce_c = new_nonce()
        self._state = _State.SENT_HELLO
        return Header(Kind.HELLO, src=self._rank,
                      meta={"job": self._job, "rank": self._rank, "nonce": self._nonce_c,
                            "inc": self._inc})

    def receive(self, header: Header) -> Step:
        try:
            reason = _refused_by(header)
            if reason is not None and self._state is _State.SENT_HELLO:
                # Not proved yet: anyone could have said it (the caller may try elsewhere).
                raise _Fail(f"refused before proving the secret: {reason}")
            if reason is not None and self._state is _State.SENT_AUTH:
                raise _Fail(reason)  # a rank of this job (it proved the secret) refused us
            if self._state is _State.SENT_HELLO:
                return self._challenge(_expect(header, Kind.CHALLENGE))
            if self._state is _State.SENT_AUTH:
                if header.kind is Kind.CONTROL and header.meta.get("op") == "wrong-job":
                    # Trustworthy: the listener proved the secret in its CHALLENGE.
                    theirs = str(header.meta.get("job"))[:MAX_JOB_ID]
                    raise _Fail(f"it serves job {theirs!r}, this rank was started for job "
                                f"{self._job!r}: check AIOREDUCE_JOB on every host")
                _expect(header, Kind.WELCOME)
                self._state = _State.DONE
                return [], Accepted(self._peer, self._peer_inc)
            raise _Fail(f"unexpected {header.kind.name} frame")
        except _Fail as exc:
            self._state = _State.FAILED
            return [], Refused(str(exc))

    def _challenge(self, challenge: Header) -> Step:
        nonce_s = challenge.meta.get("nonce")
        if not isinstance(nonce_s, bytes):
            raise _Fail("no nonce")
        inc = challenge.meta.get("inc", 0)
        if not isinstance(inc, int) or isinstance(inc, bool):
            raise _Fail("no incarnation")
        expected = proof(self._secret, "listener", self._job, self._rank, self._nonce_c,
                         nonce_s, inc)
        if not check(expected, challenge.meta.get("proof")):
            raise _Fail("could not prove the job secret")
        self._peer_inc = inc
        mine = proof(self._secret, "connector", self._job, self._rank, self._nonce_c, nonce_s,
                     self._inc)
        self._state = _State.SENT_AUTH
        return ([Header(Kind.AUTH, src=self._rank, meta={"proof": mine})],
                Proved(self._peer, inc))


def _expect(header: Header, kind: Kind) -> Header:
    if header.kind is not kind:
        raise _Fail(f"expected {kind.name}, got {header.kind.name}")
    return header
