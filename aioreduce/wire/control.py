"""Control messages as typed events: what ranks tell each other besides data.

Each event is a frozen dataclass; :func:`encode` gives the msgpack-ready map a frame carries in
its header's ``meta`` (with an ``op`` naming the event), and :func:`decode` checks a received
map field by field and gives the event back, or raises :class:`MalformedControl` saying what
is wrong. The maps come from authenticated peers, but a peer of another version (or a bug)
must produce a clear error, never a ``KeyError`` deep in the rendezvous.

Carried in CONTROL frames (:meth:`aioreduce.transport.Mesh.send_control`): the rendezvous
(:class:`Register`, :class:`Table`, :class:`Abort`), the barrier (:class:`Arrive`,
:class:`Release`), and out of band (handled as they arrive, never queued for a receiver):
:class:`Notice` (a line for the peers' logs), :class:`Moved` (a rank rejoined with a new
incarnation), :class:`Running` (a live rank tells a new rank-0 process that the job runs),
:class:`HealAsk` (a newcomer asks for the job's state) and :class:`Reform` (a
ring takes a healed rank back). Carried as the meta of a
data frame on a tag of its own: :class:`LaneOffer` (:data:`~aioreduce.wire.tags.LANE_OFFER`)
and :class:`LaneReopen` (:data:`~aioreduce.wire.tags.REOPEN`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

MAX_TEXT = 1000  # characters of a reason or notice kept: a message, bounded for a log line
MAX_MEMBERS = 1 << 16  # ranks a re-formed ring may list (a bound on what a peer makes us read)
_NONCE = re.compile(r"[0-9a-f]{32}")


class MalformedControl(ValueError):
    """A control map that is not one of the events, or whose fields have the wrong types."""


@dataclass(frozen=True)
class Register:
    """A rank to rank 0 at the rendezvous: where it listens, and the world size it believes."""

    op: ClassVar[str] = "register"
    host: str
    port: int
    world: int


@dataclass(frozen=True)
class Table:
    """Rank 0 to every rank: every rank's (host, port) and incarnation, by rank (a table
    without incarnations: every rank's is 0), and on how many hosts the job started (0: as
    many as the addresses name)."""

    op: ClassVar[str] = "table"
    addresses: tuple[tuple[str, int], ...]
    incarnations: tuple[int, ...] = ()
    hosts: int = 0


@dataclass(frozen=True)
class Abort:
    """Rank 0 to the ranks that came: the job will not start (or barrier ``barrier`` failed),
    and which ranks never came."""

    op: ClassVar[str] = "abort"
    reason: str
    missing: tuple[int, ...] = ()
    barrier: int = -1  # which barrier failed (-1: the rendezvous)


# The job's last barrier (``Node.close``) is numbered apart from the callers' barriers: a rank
# that missed one of those (a ``monitored_barrier`` it never called) still closes with the
# others instead of the others waiting out the close timeout for it.
CLOSING_BARRIER = 1 << 62


@dataclass(frozen=True)
class Arrive:
    """A rank to rank 0: it reached barrier number ``barrier`` (each rank counts its barrier
    calls from 0, so a late arrival at one barrier is never counted at the next; the closing
    one is :data:`CLOSING_BARRIER`)."""

    op: ClassVar[str] = "barrier"
    barrier: int = 0


@dataclass(frozen=True)
class Release:
    """Rank 0 to a rank: every rank reached barrier number ``barrier``."""

    op: ClassVar[str] = "release"
    barrier: int = 0


@dataclass(frozen=True)
class Notice:
    """A line for the peers' logs (never queued for a receiver)."""

    op: ClassVar[str] = "notice"
    text: str


@dataclass(frozen=True)
class LaneOffer:
    """A lane's receiver to its sender: the TCP port to dial, the nonce to prove, an abstract
    Unix name to try first (ranks on one host), and the host to dial when it is not the one
    the address table says (a rank that rejoined elsewhere, before the table's update came)."""

    port: int
    nonce: str  # 16 random bytes in hex
    unix: str | None = None
    host: str | None = None


@dataclass(frozen=True)
class LaneReopen:
    """A replacement process to a tree, star or transpose peer whose lanes went with the dead one
    (``answer`` False): open lanes again, the chunks between us on them from step ``start``
    on (-1: the ask of the frame's step is withdrawn, the asker gave up waiting); the peer's
    answer (``answer`` True, at the step asked): from step ``start`` (at least the one asked,
    past every step the peer has touched), or -1: not at all (its session has no lanes)."""

    start: int
    answer: bool = False


@dataclass(frozen=True)
class StepFailed:
    """A step of a scheme failed on the sender (a ring's abort, to every rank): every rank
    raises the same error. ``kind`` "mismatch": the vectors of ``ranks`` differ; "lost":
    rank ``rank`` was lost."""

    kind: Literal["mismatch", "lost"]
    text: str
    ranks: tuple[int, ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class Moved:
    """Rank 0 to every rank: ``rank`` rejoined the running job as incarnation
    ``incarnation``, listening at (``host``, ``port``)."""

    op: ClassVar[str] = "moved"
    rank: int
    host: str
    port: int
    incarnation: int


@dataclass(frozen=True)
class Running:
    """A live rank to a rank-0 process that has no incarnation yet: the job runs (this
    process replaces a dead rank 0). Every rank's (host, port) and incarnation as the live
    rank knows them, and on how many hosts the job started."""

    op: ClassVar[str] = "running"
    addresses: tuple[tuple[str, int], ...]
    incarnations: tuple[int, ...]
    hosts: int


@dataclass(frozen=True)
class HealAsk:
    """A rank (incarnation ``incarnation``) that rejoined or fell behind, to a live peer: send
    me the job's step and state at your next step boundary, on frames whose step is
    ``ticket`` (see :mod:`aioreduce.heal`)."""

    op: ClassVar[str] = "heal"
    incarnation: int
    ticket: int = 0
    # A replacement of a rank that a ring left out (it was not back in time), to the ring's
    # lowest member: take me back, and send my state at the step I am taken back at.
    join: bool = False


@dataclass(frozen=True)
class Reform:
    """A ring's lowest member to every other member: from step ``start`` on, the ring runs
    over ``members`` (a healed replacement is taken back). Answered at once, on the
    :data:`~aioreduce.wire.tags.MEMBERS` ack tag, so that no member starts that step
    without knowing (see :mod:`aioreduce.heal`)."""

    op: ClassVar[str] = "reform"
    members: tuple[int, ...]
    start: int


@dataclass(frozen=True)
class ResultAsk:
    """A rank whose group's last step ``step`` failed because a rank died, to a live peer:
    send me that step's result if you finished it (answered on the
    :data:`~aioreduce.wire.tags.ROLL` tags once the peer's step ``step`` is over, see
    :mod:`aioreduce.heal`)."""

    op: ClassVar[str] = "result"
    step: int


Control = (Register | Table | Abort | Arrive | Release | Notice | Moved | Running | HealAsk
           | Reform | ResultAsk)
# handled on arrival, never queued
OUT_OF_BAND = frozenset({Notice.op, Moved.op, Running.op, HealAsk.op, Reform.op, ResultAsk.op})


def encode(event: Control) -> dict[str, object]:
    """The map a CONTROL frame carries for ``event``."""
    if isinstance(event, Register):
        return {"op": event.op, "host": event.host, "port": event.port, "world": event.world}
    if isinstance(event, Table | Running):
        return {"op": event.op, "table": [list(a) for a in event.addresses],
                "inc": list(event.incarnations), "hosts": event.hosts}
    if isinstance(event, Moved):
        return {"op": event.op, "rank": event.rank, "host": event.host, "port": event.port,
                "inc": event.incarnation}
    if isinstance(event, HealAsk):
        out: dict[str, object] = {"op": event.op, "inc": event.incarnation,
                                  "ticket": event.ticket}
        if event.join:
            out["join"] = True
        return out
    if isinstance(event, Reform):
        return {"op": event.op, "members": list(event.members), "start": event.start}
    if isinstance(event, ResultAsk):
        return {"op": event.op, "step": event.step}
    if isinstance(event, Abort):
        return {"op": event.op, "reason": event.reason[:MAX_TEXT],
                "missing": list(event.missing), "barrier": event.barrier}
    if isinstance(event, Notice):
        return {"op": event.op, "text": event.text[:MAX_TEXT]}
    return {"op": event.op, "barrier": event.barrier}


def decode(meta: dict[str, Any]) -> Control:
    """The event a CONTROL frame's map describes; :class:`MalformedControl` if none."""
    op = meta.get("op")
    if op == Register.op:
        host, port, world = meta.get("host"), meta.get("port"), meta.get("world")
        if type(host) is not str or type(port) is not int or type(world) is not int:
            raise MalformedControl("a registration needs a host, a port and a world size")
        return Register(host, port, world)
    if op in (Table.op, Running.op):
        table = meta.get("table")
        if not isinstance(table, list) or not all(
                isinstance(e, list) and len(e) == 2 and type(e[0]) is str
                and type(e[1]) is int for e in table):
            raise MalformedControl("an address table needs a [host, port] per rank")
        incs = meta.get("inc", [])
        if not isinstance(incs, list) or not all(type(i) is int and i >= 0 for i in incs):
            raise MalformedControl("an address table's incarnations are integers >= 0")
        hosts = meta.get("hosts", 0)
        if type(hosts) is not int or hosts < 0:
            raise MalformedControl("an address table's host count is an integer >= 0")
        addresses = tuple((e[0], e[1]) for e in table)
        if op == Table.op:
            return Table(addresses, tuple(incs), hosts)
        if len(incs) != len(addresses):
            raise MalformedControl("a running job's table has an incarnation per rank")
        return Running(addresses, tuple(incs), hosts)
    if op == Moved.op:
        rank, host, port, inc = (meta.get(k) for k in ("rank", "host", "port", "inc"))
        if (type(rank) is not int or type(host) is not str or type(port) is not int
                or type(inc) is not int or inc < 1):
            raise MalformedControl("a move needs a rank, a host, a port and an incarnation")
        return Moved(rank, host, port, inc)
    if op == HealAsk.op:
        inc, ticket = meta.get("inc"), meta.get("ticket")
        if type(inc) is not int or inc < 0 or type(ticket) is not int or ticket < 0:
            raise MalformedControl("a heal request needs the asker's incarnation and a ticket")
        return HealAsk(inc, ticket, meta.get("join") is True)
    if op == Reform.op:
        members, start = meta.get("members"), meta.get("start")
        if (not isinstance(members, list) or not members or len(members) > MAX_MEMBERS
                or not all(type(r) is int and r >= 0 for r in members)
                or type(start) is not int or start < 0):
            raise MalformedControl("a re-formed ring needs its members and the step it "
                                   "starts at")
        return Reform(tuple(members), start)
    if op == ResultAsk.op:
        step = meta.get("step")
        if type(step) is not int or step < 0:
            raise MalformedControl("a result request needs the step it asks about")
        return ResultAsk(step)
    if op == Abort.op:
        missing = meta.get("missing", [])
        if not isinstance(missing, list) or not all(type(r) is int for r in missing):
            raise MalformedControl("an abort lists the missing ranks as integers")
        return Abort(str(meta.get("reason", ""))[:MAX_TEXT], tuple(missing),
                     _barrier(meta, -1))
    if op == Arrive.op:
        return Arrive(_barrier(meta, 0))
    if op == Release.op:
        return Release(_barrier(meta, 0))
    if op == Notice.op:
        return Notice(str(meta.get("text", ""))[:MAX_TEXT])
    raise MalformedControl(f"unknown control message {str(op)[:40]!r}")


def _barrier(meta: dict[str, Any], default: int) -> int:
    n = meta.get("barrier", default)
    if type(n) is not int:
        raise MalformedControl("a barrier's number is an integer")
    return n


def offer_meta(offer: LaneOffer) -> dict[str, object]:
    """The meta of a lane offer's frame."""
    meta: dict[str, object] = {"port": offer.port, "nonce": offer.nonce}
    if offer.unix is not None:
        meta["unix"] = offer.unix
    if offer.host is not None:
        meta["host"] = offer.host
    return meta


def decode_offer(meta: dict[str, Any]) -> LaneOffer:
    """A lane offer from its frame's meta; :class:`MalformedControl` if it is not one (the
    Unix name's own shape is checked where it is dialed)."""
    port, nonce, unix, host = (meta.get(k) for k in ("port", "nonce", "unix", "host"))
    if (type(port) is not int or type(nonce) is not str or not _NONCE.fullmatch(nonce)
            or (unix is not None and type(unix) is not str)
            or (host is not None and (type(host) is not str or len(host) > 255))):
        raise MalformedControl("a lane offer needs a port, a 32-digit hex nonce and "
                               "optionally a Unix name and a host")
    return LaneOffer(port, nonce, unix, host)


def reopen_meta(event: LaneReopen) -> dict[str, object]:
    """The meta of a lane reopening's frame."""
    return {"start": event.start, "answer": event.answer}


def decode_reopen(meta: dict[str, Any]) -> LaneReopen:
    """A lane reopening from its frame's meta; :class:`MalformedControl` if it is not one."""
    start, answer = meta.get("start"), meta.get("answer")
    if type(start) is not int or start < -1 or type(answer) is not bool:
        raise MalformedControl("a lane reopening needs a step >= -1 and whether it answers")
    return LaneReopen(start, answer)


def failed_meta(event: StepFailed) -> dict[str, object]:
    """The meta of a step-failed frame."""
    meta: dict[str, object] = {"kind": event.kind, "text": event.text[:MAX_TEXT]}
    if event.kind == "mismatch":
        meta["ranks"] = list(event.ranks)
    elif event.rank is not None:
        meta["rank"] = event.rank
    return meta


def decode_failed(meta: dict[str, Any], sender: int) -> StepFailed:
    """A step-failed event from its frame's meta. Lenient: the step has failed whatever the
    map says, so what cannot be read becomes "``sender`` was lost"."""
    text = str(meta.get("text", ""))[:MAX_TEXT]
    if meta.get("kind") == "mismatch":
        ranks = meta.get("ranks")
        return StepFailed("mismatch", text, tuple(r for r in ranks if type(r) is int)
                          if isinstance(ranks, list) else ())
    lost = meta.get("rank")
    return StepFailed("lost", text, rank=lost if type(lost) is int else sender)
