"""What every scheme shares: the Comm it talks through, the Scheme/Session protocols, the step
result and the errors a step can end with.

A *scheme* is a small frozen object with options (``Ring()``, ``CodedTree(3, 2, 1)``);
``scheme.open(comm)`` returns a *session* that owns everything living across steps (what a
parent remembers for its grandchildren, a bypassed parent, background sends). Closing the
session removes every handler it installed on the comm, so switching schemes leaves nothing
behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from ..errors import AioreduceError
from ..wire import Header

OnInsufficient = Literal["raise", "approximate"]
EarlyHandler = Callable[[Header, memoryview], None]


class BulkLink(Protocol):
    """One direction of a blocking byte stream between two ranks, for a scheme's bulk data,
    driven from a worker thread instead of the event loop (the mesh's lanes,
    :mod:`aioreduce.transport.lane`). Each message is (step, index, payload, meta); what a
    message fills is the matcher's business (:class:`~.links.lanes.LaneLinks`)."""

    peer: int  # the rank at the other end
    sent: int  # payload bytes sent so far
    latency: float  # emulated one-way latency of every message received (0: none)

    @property
    def local(self) -> bool:
        """Whether the peer is on this host (a Unix socket: no network link in between)."""

    @property
    def buffered(self) -> int:
        """Bytes read ahead: a read of at most this many returns at once."""

    def send(self, step: int, index: int, payload: memoryview, meta: bytes = b"", *,
             lent: bool = False) -> None:
        """Queue one message (the sender thread writes it; a small one may go at once);
        ``lent``: ``payload`` may change once :meth:`release` returned."""

    def allow_lending(self) -> None:
        """Let sends be ``lent`` from now on (before the first send)."""

    def release(self) -> None:
        """Copy what is still queued of lent payloads (see :meth:`send`)."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued message is in the kernel; False after ``timeout``."""

    def read_head(self) -> tuple[int, int, int, int]:
        """The next message's (step, index, payload bytes, meta bytes)."""

    def read_meta(self, nbytes: int) -> bytes:
        """The next ``nbytes`` of meta."""

    def wait_readable(self, unit: int = 1) -> bool:
        """Block until bytes can be read (``unit``: a whole element of that many, see
        :meth:`recv_now`) or the link is interrupted: True; False once :meth:`wake` was
        called."""

    def wait_head(self) -> bool:
        """:meth:`wait_readable` before a message's head (an in-order receive's wait)."""

    def take_bare(self, step: int, index: int, view: memoryview) -> bool:
        """Copy the next message's payload into ``view`` if it is wholly read ahead and is
        (``step``, ``index``), bare, of ``view.nbytes``; whether it did."""

    @property
    def streaming(self) -> bool:
        """Whether :meth:`read_expected` would try (large messages coming, none read ahead)."""

    def read_expected(self, step: int, index: int, view: memoryview) -> bool | None:
        """Read the next message's head and payload in one call, the payload into ``view``:
        True if it was (``step``, ``index``), bare, of ``view.nbytes`` (all of it read);
        False if it was another (read ahead again; ``view`` may hold some of its bytes);
        None if nothing was tried or nothing is there yet."""

    def wake(self) -> None:
        """End a :meth:`wait_readable` in progress, or the next one (from any thread)."""

    def recv_now(self, view: memoryview, unit: int = 1) -> int:
        """Read what is there into ``view`` without blocking; the bytes read. ``unit`` > 1:
        only whole elements of that many bytes land in ``view`` (never a part of one)."""

    def read_into(self, view: memoryview) -> None:
        """Read exactly ``view.nbytes`` into ``view`` (blocking)."""

    def skip(self, nbytes: int) -> None:
        """Read and drop ``nbytes``."""

    def interrupt(self) -> None:
        """Make a blocked send or receive fail at once (from any thread)."""

    def close(self) -> None:
        """Close the link."""


class BulkLinks(Protocol):
    """The capability a comm may offer (:meth:`Comm.bulk_links`): blocking links to and from
    other ranks, opened over the comm, every peer at the same step."""

    async def open_links(self, send_to: Sequence[int], recv_from: Sequence[int], step: int,
                         *, partial: bool = False
                         ) -> tuple[Mapping[int, BulkLink], Mapping[int, BulkLink]]:
        """Links to every rank of ``send_to`` and from every rank of ``recv_from``; all or
        nothing (if one fails, the others are closed and its error raised), or with
        ``partial`` those that opened (a peer lost or not answering is left out of both)."""

    @property
    def spans_hosts(self) -> bool:
        """Whether the job's ranks were on more than one host when it started (alike on every
        rank, and on a replacement: it chooses the trees' chunking)."""

    def count_moved(self, step: int, sent: int, src: int, received: int, frames: int) -> None:
        """What a step moved over links (they bypass the comm): ``sent`` bytes, and
        ``received`` bytes in ``frames`` from ``src``, for step telemetry."""


class Comm(Protocol):
    """The point-to-point interface every scheme is written against.

    The mesh of real connections implements it (:class:`aioreduce.transport.Mesh`), and so
    does the in-memory network the unit tests use (:mod:`aioreduce.transport.memory`).
    Frames are matched on (source rank, step, tag).
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    async def send(self, rank: int, array: np.ndarray, *, step: int, tag: int = 0,
                   meta: dict[str, Any] | None = None) -> None:
        """Send one frame; return when ``array`` may be modified (it is in the kernel)."""

    def post_recv(self, rank: int, out: np.ndarray, *, step: int,
                  tag: int = 0) -> asyncio.Future[Header]:
        """Post a receive into ``out``; the future resolves with the frame's header or fails
        with :class:`~aioreduce.PeerLost`. Cancelling it withdraws the receive."""

    def discard_before(self, step: int, tag: int = 0) -> None:
        """Unclaimed frames of steps below ``step``, and of step ``step`` with a tag below
        ``tag``, are stale: dropped on arrival, never delivered."""

    def is_lost(self, rank: int) -> bool:
        """True while the connection to ``rank`` is broken."""

    def on_peer_lost(self, listener: Callable[[int], None]) -> Callable[[], None]:
        """Call ``listener(rank)`` when a peer's connection breaks; returns the remover."""

    def on_early(self, rank: int, min_tag: int, handler: EarlyHandler, *,
                 since: int | None = None) -> Callable[[], None]:
        """Hand frames from ``rank`` with tag >= ``min_tag`` to ``handler`` when they arrive
        before their receive is posted (payload-less ones even when stale); returns the
        remover. With ``since``, also the frames of steps >= ``since`` that arrived before
        the handler existed and are still unclaimed: soon after the call, once each."""

    def bulk_links(self) -> BulkLinks | None:
        """Blocking links for bulk data, if this comm offers them (the mesh does; the
        in-memory network of the unit tests does not). Every rank's comm is built the same
        way, so every rank gets the same answer."""


_PASSED_ON = ("send", "post_recv", "discard_before", "is_lost")


class CommWrapper:
    """A :class:`Comm` that passes every call on to the comm it wraps (``inner``): the base of
    wrappers that change a few calls (a session's gate, step telemetry) and keep the rest.
    Bulk links are the inner comm's."""

    def __init__(self, inner: Comm) -> None:
        self.inner = inner
        # A call the subclass leaves as it is goes straight to the inner comm, bound here
        # rather than passed on by a method of ours: a Python call less on every frame sent
        # or posted (a session's GatedComm changes only on_early).
        for name in _PASSED_ON:
            if getattr(type(self), name) is getattr(CommWrapper, name):
                setattr(self, name, getattr(inner, name))

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    async def send(self, rank: int, array: np.ndarray, *, step: int, tag: int = 0,
                   meta: dict[str, Any] | None = None) -> None:
        await self.inner.send(rank, array, step=step, tag=tag, meta=meta)

    def post_recv(self, rank: int, out: np.ndarray, *, step: int,
                  tag: int = 0) -> asyncio.Future[Header]:
        return self.inner.post_recv(rank, out, step=step, tag=tag)

    def discard_before(self, step: int, tag: int = 0) -> None:
        self.inner.discard_before(step, tag)

    def is_lost(self, rank: int) -> bool:
        return self.inner.is_lost(rank)

    def on_peer_lost(self, listener: Callable[[int], None]) -> Callable[[], None]:
        return self.inner.on_peer_lost(listener)

    def on_early(self, rank: int, min_tag: int, handler: EarlyHandler, *,
                 since: int | None = None) -> Callable[[], None]:
        return self.inner.on_early(rank, min_tag, handler, since=since)

    def bulk_links(self) -> BulkLinks | None:
        return self.inner.bulk_links()


@dataclass(frozen=True)
class Result:
    """The outcome of one aggregation step; identical on every rank.

    ``value`` is read-only (it may still be in flight to slower ranks); copy it to modify.
    ``used``: ranks whose contributions went into the value; ``late``: ranks that were
    skipped. ``exact`` is False only for an approximate decode, whose error is at most
    ``error_bound`` times the root-sum-square of the parts' gradient norms.

    Bounded-time schemes (``Transpose``) use whatever arrived by a deadline, so their
    results can differ between ranks; they also fill in ``received`` (the fraction of all
    ranks' contributions in this rank's value), ``worst_shard`` (the same for the worst
    shard), ``stand_in`` (shards, by owner, of which this rank missed some of the reduced
    values and used its stand-in), ``drifted`` (ranks known to have held such a result since
    the last re-sync: their replicas may differ), ``deadline`` (the step's time bound, seconds)
    and ``resync`` (re-synchronise the model after this step, e.g. ``Node.broadcast``).
    """

    value: np.ndarray
    step: int
    used: list[int] = field(default_factory=list)
    late: list[int] = field(default_factory=list)
    exact: bool = True
    error_bound: float = 0.0
    seconds: float = 0.0
    received: float = 1.0
    worst_shard: float = 1.0
    stand_in: list[int] = field(default_factory=list)
    drifted: list[int] = field(default_factory=list)
    deadline: float = 0.0
    resync: bool = False


@runtime_checkable
class Session(Protocol):
    """One scheme running on one rank: the state that lives from step to step."""

    async def step(self, step: int, like: np.ndarray, own: Awaitable[np.ndarray]) -> Result:
        """Run step ``step``. ``like`` fixes shape and dtype; ``own`` yields this rank's
        vector (receives are posted before it is awaited, so compute overlaps arrival)."""

    async def close(self, timeout: float) -> None:
        """Finish background sends (bounded by ``timeout``) and remove every handler."""

    def known(self, step: int) -> bool:
        """True if the outcome of ``step`` is already here: this rank is behind and its own
        vector for that step is not needed (the node then skips computing it)."""


class Arrival(Protocol):
    """A vector that reaches the host in pieces, and whose result may leave in pieces: a
    device tensor staged through host memory (:mod:`aioreduce.torch.staging`). A session
    that sums in place starts on the pieces that are in and hands back each piece of the
    result as soon as it is final, so the copies overlap the wire; a session that cannot
    waits for the whole vector first (``landed(0, size)``) and hands nothing back."""

    def landed(self, lo: int, hi: int) -> None:
        """Block until elements ``[lo, hi)`` of the vector are on the host (called off the
        event loop)."""

    def final(self, lo: int, hi: int) -> None:
        """Elements ``[lo, hi)`` of the result do not change again this step (each element
        at most once)."""


@runtime_checkable
class ReadsInOrder(Protocol):
    """A session that reads its vector in a known order of pieces: a staged vector is copied
    to the host in that order, so the step starts once the first piece is in."""

    def read_order(self, size: int) -> Sequence[tuple[int, int]]:
        """The ``(lo, hi)`` pieces of a vector of ``size`` elements, in the order the step
        first reads them (together they cover it once)."""


@runtime_checkable
class Rejoins(Protocol):
    """A session that a process replacing a dead rank opens mid-job (see
    :mod:`aioreduce.heal`): it asks for the outcomes from ``step`` on at once, instead of
    waiting out a deadline for results its peers sent the dead process."""

    def rejoined(self, step: int) -> None:
        """This process starts at ``step``; the job may be further on."""


@runtime_checkable
class SumsInPlace(Protocol):
    """A session that can write a step's sum into an array of the caller's (its own vector
    included), as ``torch.distributed`` collectives do: no result buffer, no copy back.
    Only sessions whose result always sums every rank's vector implement it."""

    async def step_into(self, step: int, like: np.ndarray, own: Awaitable[np.ndarray],
                        into: np.ndarray, divisor: float, arrival: Arrival | None = None
                        ) -> Result:
        """:meth:`Session.step`, with the sum divided by ``divisor`` (1: the sum) written into
        ``into`` (C-contiguous, ``like``'s shape and dtype; it may be the vector ``own``
        yields), which is the result's ``value``. If the step fails, ``into`` holds partial
        sums. With ``arrival``, the vector ``own`` yields may still be landing: see
        :class:`Arrival`."""


@runtime_checkable
class WritesInto(Protocol):
    """A session that can land a step's result straight in an array of the caller's (its own
    vector included) instead of in a buffer of its own that would then be copied: for
    results that need not sum every rank (those that do implement :class:`SumsInPlace`)."""

    async def step_to(self, step: int, like: np.ndarray, own: Awaitable[np.ndarray],
                      into: np.ndarray) -> Result:
        """:meth:`Session.step` with the result written into ``into`` (C-contiguous,
        ``like``'s shape and dtype; it may be the vector ``own`` yields), which is the
        result's ``value``. If the step fails, ``into`` holds partial results."""


@runtime_checkable
class TellsFailure(Protocol):
    """A session whose ranks wait in a step for one another's parts (the ring). A rank that
    fails a step without running it (a group's later steps after a death: see
    :mod:`aioreduce.heal`) tells its peers, or one that is running the step would wait for a
    part that never comes."""

    def tell_failed(self, step: int, error: BaseException) -> None:
        """Tell every live peer, in the background, that ``step`` failed here with ``error``
        (this rank does not run it)."""


@runtime_checkable
class Reforms(Protocol):
    """A session whose every step needs every member (the ring) that can run over fewer
    ranks: a lost rank whose replacement does not come in time is left out, and one that
    healed is taken back at a step boundary (see :mod:`aioreduce.heal`)."""

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks the steps run over now, ascending."""

    def reform(self, members: Sequence[int], *, joined: bool = False) -> None:
        """Run the steps from the next one over ``members`` (this rank among them).
        ``joined``: this is a replacement's new session, taken back by members that ran
        without it and change at that step (they open new lanes there, so it does too)."""


@runtime_checkable
class DecodeTimed(Protocol):
    """A session that can tell how long this rank spent decoding a step (for telemetry)."""

    def decode_seconds(self, step: int) -> float:
        """Seconds spent decoding and combining ``step`` on this rank (0 if none)."""


class Scheme(Protocol):
    """A scheme's options; :meth:`open` starts a session of it on a comm."""

    @property
    def coded(self) -> bool:
        """True if ranks pass coded vectors to ``Node.aggregate``, False for ``allreduce``."""

    def validate(self, world_size: int) -> None:
        """Raise ValueError if the scheme cannot run on ``world_size`` ranks."""

    def neighbours(self, rank: int, world_size: int) -> list[int]:
        """The ranks ``rank`` exchanges frames with (connections opened up front)."""

    def open(self, comm: Comm) -> Session:
        """A new session of this scheme on ``comm``."""


@runtime_checkable
class CodedScheme(Scheme, Protocol):
    """A scheme whose ranks compute on a placement of the data set."""

    @property
    def min_samples(self) -> int:
        """The smallest data-set size the placement fits; multiples of it fit too."""

    def placement(self, rank: int, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, weights) rank ``rank`` computes its weighted gradient on."""


class StragglerError(AioreduceError):
    """A step could not be decoded exactly in time: too many ranks of one family missing."""

    def __init__(self, step: int, missing: list[int], detail: str = "",
                 received: float | None = None, lost: list[int] | None = None) -> None:
        self.step = step
        self.missing = sorted(missing)
        self.detail = detail
        self.received = received  # bounded-time schemes: the fraction that did arrive
        # Of the missing ranks, those whose process died (a peer saw its connection break):
        # a rank that never talks to them learns it from this error (see aioreduce.heal).
        self.lost = sorted(lost or [])
        msg = f"step {step}: cannot decode without ranks {self.missing}"
        super().__init__(msg + (f" ({detail})" if detail else ""))


class FellBehind(AioreduceError):
    """This rank fell further behind than its peers keep results for.

    The node now stands at ``current_step``. With state hooks (``Node(state=...)``, see
    :mod:`aioreduce.heal`) it has healed already: ``healed`` is True, the program's state is
    a live peer's and the node stands at that peer's step; skip this step's update and go on.
    Without them, re-sync the model from a peer (for example with ``Node.broadcast``).
    """

    def __init__(self, rank: int, step: int, current_step: int) -> None:
        self.rank, self.step, self.current_step = rank, step, current_step
        self.healed = False
        super().__init__(f"rank {rank}: the result of step {step} is no longer kept by its "
                         f"peers; the job is at step {current_step}")


CHUNK_BYTES = 1 << 20
MAX_CHUNKS = 16
"""Chunking when every rank is on one host (``chunk_bytes`` and ``max_chunks`` left None): a
step's vector travels in chunks of ``CHUNK_BYTES``, at most ``MAX_CHUNKS`` per message (a
larger vector gets larger chunks). Every chunk costs a frame (a fraction of a millisecond of
Python on each side) and no network link binds there: a few chunks per level pipeline enough
(docs/schemes.md, "Pipelining")."""

HOSTS_CHUNK_BYTES = 256 << 10
HOSTS_MAX_CHUNKS = 64
"""Chunking when the job spans hosts (left None): finer chunks, so that a tree's levels fill
and drain sooner where links bind (docs/schemes.md has the fractions of bound)."""

MAX_CHUNKS_LIMIT = 1024  # what ``max_chunks`` may be at most (a frame per chunk)


@dataclass(frozen=True)
class StepOptions:
    """Knobs shared by the tree and star schemes."""

    deadline: float = 30.0  # seconds a parent waits for a sufficient set of children
    on_insufficient: OnInsufficient = "raise"
    # Pipelining granularity, and a message's chunks at most (None: by whether the job spans
    # hosts, see chunking()).
    chunk_bytes: int | None = None
    history_bytes: int = 256 << 20  # results kept for ranks that fell behind (at least 2)
    backlog_steps: int = 8  # a peer with this many steps unsent is not reading
    # Chunks to and from the parent and children over the comm's bulk links (lanes, off the
    # event loop) instead of the event loop's frames; see ReduceSession. None: when the
    # session's first vector has at least LANES_FROM bytes (every rank's is the same size).
    lanes: bool | None = None
    max_chunks: int | None = None

    def __post_init__(self) -> None:
        if self.deadline <= 0:
            raise ValueError("deadline must be positive")
        if self.on_insufficient not in ("raise", "approximate"):
            raise ValueError("on_insufficient must be 'raise' or 'approximate'")
        if ((self.chunk_bytes is not None and self.chunk_bytes < 1)
                or (self.max_chunks is not None
                    and not 1 <= self.max_chunks <= MAX_CHUNKS_LIMIT)):
            raise ValueError(f"chunk_bytes must be positive and max_chunks in [1, "
                             f"{MAX_CHUNKS_LIMIT}]")
        if self.history_bytes < 0 or self.backlog_steps < 1:
            raise ValueError("history_bytes must be >= 0 and backlog_steps >= 1")

    def chunking(self, spans_hosts: bool) -> tuple[int, int]:
        """``(chunk_bytes, max_chunks)`` for a job on one host or across hosts (what was
        left None takes that case's default). Every rank must pass the same ``spans_hosts``
        (:attr:`BulkLinks.spans_hosts`): parents and children cut at the same bounds."""
        chunk, most = ((HOSTS_CHUNK_BYTES, HOSTS_MAX_CHUNKS) if spans_hosts
                       else (CHUNK_BYTES, MAX_CHUNKS))
        return (chunk if self.chunk_bytes is None else self.chunk_bytes,
                most if self.max_chunks is None else self.max_chunks)


def spans_hosts(comm: Comm) -> bool:
    """Whether ``comm``'s job spans hosts (:attr:`BulkLinks.spans_hosts`; a comm without bulk
    links, the in-memory network, is one host): alike on every rank."""
    links = comm.bulk_links()
    return links is not None and links.spans_hosts


LANES_FROM = 1 << 20
"""From what size of vector (bytes) the trees take lanes (``StepOptions.lanes=None``): where
each rank has a core, lanes win for large vectors and lose for the papers' small ones
(docs/schemes.md)."""


def chunk_step(length: int, itemsize: int, chunk_bytes: int,
               max_chunks: int = MAX_CHUNKS) -> int:
    """Elements per pipelining chunk of a vector of ``length``: ``chunk_bytes`` worth, or more
    so that there are at most ``max_chunks`` chunks."""
    return max(1, chunk_bytes // max(1, itemsize), -(-length // max_chunks))


def chunk_bounds(length: int, itemsize: int, chunk_bytes: int,
                 max_chunks: int = MAX_CHUNKS) -> list[tuple[int, int]]:
    """Element ranges of the pipelining chunks of a vector (at least one, even if empty)."""
    step = chunk_step(length, itemsize, chunk_bytes, max_chunks)
    return [(lo, min(lo + step, length)) for lo in range(0, length, step)] or [(0, 0)]
