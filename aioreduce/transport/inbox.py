"""Matching frames from one peer to the receives posted for them.

A receive is posted for a key ``(step, tag)`` with a destination view. When a frame's header is
parsed, the inbox decides where its payload goes:

* a receive is posted for its key: straight into the caller's array (zero-copy), even if its
  step is below the floor (whoever posted it still wants it);
* its step is below the *floor* (the caller said those steps are over): scratch, discarded, so
  a straggler's late frame is never mixed into a later step;
* otherwise it arrived early. Small payloads (``stage_limit``) are staged in a fresh buffer and
  copied on post. Large ones are *held back*: the connection stops reading, the bytes wait in the
  kernel, and the post that matches them resumes the connection into the caller's array. So a
  large frame is never received twice. To avoid a deadlock, a held frame is staged anyway as
  soon as someone waits for a different key from the same peer (TCP delivers in order, so that
  key can only come after it).

Frames that arrive before their receive is posted are also offered to *early handlers*
(:meth:`Inbox.on_early`): a scheme can act on them at once (a tree rank forwards a result it has
not asked for yet, a parent answers a request). Handlers are removable, so a scheme session
leaves nothing behind.

An authenticated peer is trusted with the secret, not with our memory (a bug or a compromised
host must not grow us without end). What it can make us keep is bounded by its
:class:`PeerBudget`: staged bytes and frames, control messages nobody has read, and how far
ahead of our current step its frames may be. Past a bound the frame is a
:class:`ProtocolError`, which closes that connection only (an honest peer never gets there:
the defaults cover what a parent pushes to a rank catching up, the scheme's result window).

*Emulated latency* (``latency`` seconds, for clusters emulated on one machine, where tc has no
netem): a data frame counts as arrived ``latency`` after its last byte did. A posted receive
resolves then, a staged frame claimed earlier resolves then too, and early handlers see the
frame then (dropped instead if its stage ended meanwhile). The bytes themselves land at once,
zero-copy as always; only the moment the scheme learns of them moves, one-way and per frame,
so frames in flight overlap their latencies as on a real link. Control frames are not delayed.

The inbox is the connection's router: an authenticated connection hands it every frame
directly. When a peer's last connection closes, every receive waiting on it fails with
:class:`PeerLost` naming the rank, and so does every later receive that is not already staged.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..delayline import LINE, Timer
from ..errors import PeerLost, VectorMismatch
from ..wire import DEFER, Frame, Header, Kind, ProtocolError, is_p2p
from ..wire.control import OUT_OF_BAND, Notice
from ..wire.decoder import Destination

if TYPE_CHECKING:
    from .protocol import FrameProtocol

log = logging.getLogger("aioreduce.transport")

Key = tuple[int, int]  # (step, tag)
NO_FLOOR = -(1 << 62)
EarlyHandler = Callable[[Header, memoryview], None]


@dataclass(frozen=True)
class PeerBudget:
    """What one authenticated peer can make this rank hold for it."""

    staged_bytes: int = 384 << 20  # early payloads (covers a 256 MiB result window + chunks)
    staged_frames: int = 1 << 16  # early frames of any size (each costs ~1 KiB of objects)
    control: int = 64  # control messages not yet read (rendezvous, barrier)
    steps_ahead: int = 1 << 16  # frames this far beyond our current step are refused


@dataclass(eq=False)
class _Posted:
    view: memoryview
    dtype: str
    future: asyncio.Future[Header]


class Inbox:
    """Receive matching for one source rank (all its connections)."""

    def __init__(self, rank: int, stage_limit: int,
                 on_lost: Callable[[int], None] | None = None,
                 budget: PeerBudget | None = None, latency: float = 0.0,
                 on_control: Callable[[int, dict[str, object]], None] | None = None,
                 timer: Timer = LINE) -> None:
        self.rank = rank
        # Out-of-band control messages but notices (a rank moved, a heal request) go here.
        self._on_control = on_control
        self.latency = latency  # emulated one-way latency, seconds (see the module docstring)
        # What times it: by default the precise delay line, not the loop's timers (uvloop's
        # count whole milliseconds, and the latencies emulated are often a fraction of one).
        self._timer = timer
        self.budget = budget or PeerBudget()
        self.staged_bytes = 0  # payload bytes in _staged
        self._on_lost = on_lost
        self.stage_limit = stage_limit
        # Frames with a (step, tag) below this are stale (a step's own stages cut by tag).
        self.floor_key: Key = (NO_FLOOR, 0)
        self.conns: set[FrameProtocol] = set()
        self.lost: PeerLost | None = None
        self.control: asyncio.Queue[dict[str, object] | None] = asyncio.Queue()
        self._posted: dict[Key, _Posted] = {}
        self._receiving: dict[FrameProtocol, tuple[Key, _Posted]] = {}
        # Early frames: header, payload, and when they arrived (loop time).
        self._staged: dict[Key, tuple[Header, memoryview, float]] = {}
        # Steps of staged frames, smallest first (lazily cleaned), so moving the floor costs
        # the frames it drops, not a scan of everything staged.
        self._staged_steps: list[int] = []
        self._tags_of: dict[int, set[int]] = {}
        self._held: dict[FrameProtocol, Header] = {}
        self._early: list[tuple[int, EarlyHandler]] = []
        # Staged frames not yet handed to the early handlers (their emulated latency runs).
        self._in_flight: set[Key] = set()
        # Waiters for a frame to arrive without taking it (:meth:`probe`), by key.
        self._probes: dict[Key, list[asyncio.Future[None]]] = {}
        # The loop this inbox serves, found at its first receive: asyncio.get_running_loop()
        # makes a getpid() system call each time, and a receive took two.
        self._loop: asyncio.AbstractEventLoop | None = None

    def on_early(self, min_tag: int, handler: EarlyHandler, *,
                 since: int | None = None) -> Callable[[], None]:
        """Hand frames with tag >= ``min_tag`` to ``handler`` when they arrive before their
        receive is posted (they stay staged for that receive too). Frames of steps below the
        floor are handed over only if they carry no payload (requests). Returns the remover.

        With ``since``, frames of steps >= ``since`` that are staged already (they came before
        the handler existed: a peer that switched schemes first, its new session's frames
        reaching us while we still ran the old one) are handed over too, soon after this
        call (not inside it: the caller is still setting itself up), each once, unless a
        receive claims it first. A frame still within its emulated latency is not: it is
        handed over when that ends, like every other."""
        entry = (min_tag, handler)
        self._early.append(entry)
        if since is not None:
            backlog = [key for key in self._staged
                       if key[0] >= since and key[1] >= min_tag and key not in self._in_flight]
            if backlog:
                asyncio.get_running_loop().call_soon(self._replay, entry, backlog)

        def remove() -> None:
            if entry in self._early:
                self._early.remove(entry)

        return remove

    # -- the caller's side --------------------------------------------------------------------
    def probe(self, key: Key) -> asyncio.Future[None]:
        """A future that resolves once a frame of ``key`` is here waiting for its receive
        (staged, or held back in the kernel), without receiving it: at once if it is already;
        with :class:`PeerLost` if the peer is lost first. What a receive from any source
        waits on (torch's ``recv`` without ``src``). Cancel it to stop waiting."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if key in self._staged or any((h.step, h.tag) == key for h in self._held.values()):
            fut.set_result(None)
        elif self.lost is not None and not self.conns:
            fut.set_exception(self.lost)
        else:
            waiting = self._probes.setdefault(key, [])
            waiting.append(fut)
            fut.add_done_callback(lambda f: self._unprobe(key, f))
        return fut

    def _unprobe(self, key: Key, fut: asyncio.Future[None]) -> None:
        waiting = self._probes.get(key)
        if waiting is not None and fut in waiting:
            waiting.remove(fut)
            if not waiting:
                del self._probes[key]

    def _arrived(self, key: Key) -> None:
        """A frame of ``key`` is here and nobody has received it: wake its probes."""
        for fut in self._probes.pop(key, ()):
            if not fut.done():
                fut.set_result(None)

    def post(self, key: Key, view: memoryview, dtype: str) -> asyncio.Future[Header]:
        """Post a receive of ``key`` into ``view``; the future resolves with the frame header."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        fut: asyncio.Future[Header] = loop.create_future()
        existing = self._posted.get(key)
        if existing is not None and not existing.future.done():  # (done: see _pop_posted)
            raise RuntimeError(f"a receive from rank {self.rank} for step {key[0]} tag {key[1]} "
                               "is already posted")
        staged = self._unstage(key) if self._staged else None
        if staged is not None:
            self._copy_in(fut, view, dtype, *staged)
            return fut
        if self.lost is not None and not self.conns:
            fut.set_exception(self.lost)
            return fut
        posted = _Posted(view, dtype, fut)
        self._posted[key] = posted
        if not self._held:  # the usual case: no frame waits in the kernel for its receive
            return fut
        for conn, header in list(self._held.items()):
            del self._held[conn]
            if (header.step, header.tag) == key and self._posted.get(key) is posted:
                del self._posted[key]
                err = self._mismatch(header, view, dtype)
                if err:
                    fut.set_exception(VectorMismatch(err, [self.rank]))
                    conn.resume_with(None)
                else:
                    self._receiving[conn] = (key, posted)
                    conn.resume_with(view)
            else:
                conn.resume_with(self._stage_buffer(header))
        return fut

    def cancel(self, key: Key, fut: asyncio.Future[Header]) -> None:
        """Withdraw a receive (timeout, cancellation): its buffer is never written again."""
        posted = self._posted.get(key)
        if posted is not None and posted.future is fut:
            del self._posted[key]
        for conn, (_k, p) in list(self._receiving.items()):
            if p.future is fut:
                conn.withdraw_payload()

    def set_floor(self, step: int, tag: int = 0) -> None:
        """Frames of steps below ``step``, and of step ``step`` with a tag below ``tag``, are
        stale from now on: drop staged and held ones (a scheme with stages inside a step, the
        transpose, drops a stage's late frames this way)."""
        key = (step, tag)
        if key <= self.floor_key:
            # Nothing new is stale: frames that came since the floor last moved were checked
            # against it on arrival. Schemes call this twice a step on every peer's inbox.
            return
        self.floor_key = key
        floor, floor_tag = key
        heap = self._staged_steps
        while heap and heap[0] < floor:
            old = heapq.heappop(heap)
            for t in self._tags_of.pop(old, ()):
                self._unstage((old, t))
        if floor_tag:  # only a scheme with stages inside a step sets one
            for t in [t for t in self._tags_of.get(floor, ()) if t < floor_tag]:
                self._unstage((floor, t))
        if self._held:  # (mostly empty: this runs for every peer twice a step)
            for conn, header in list(self._held.items()):
                if self._stale(header):
                    del self._held[conn]
                    conn.resume_with(None)

    @staticmethod
    def set_floors(inboxes: Iterable[Inbox], step: int, tag: int = 0) -> None:
        """:meth:`set_floor` on each of ``inboxes``, in one call: a mesh moves every peer's
        floor twice a step, and most inboxes then hold nothing staged or held, so only
        their key moves (instead of a method call per peer; docs/architecture.md)."""
        key = (step, tag)
        for inbox in inboxes:
            if key <= inbox.floor_key:
                continue
            if inbox._staged_steps or inbox._held:  # (a step staged is in the heap)
                inbox.set_floor(step, tag)
            else:
                inbox.floor_key = key

    @property
    def floor(self) -> int:
        """Frames of steps below this are stale."""
        return self.floor_key[0]

    def _stale(self, header: Header) -> bool:
        # A point-to-point frame's step is its pair's sequence number: no floor applies.
        return (header.step, header.tag) < self.floor_key and not is_p2p(header.tag)

    # -- the connection's side (its Router) ----------------------------------------------------
    def choose(self, conn: FrameProtocol, header: Header) -> Destination:
        key = (header.step, header.tag)
        posted = self._posted.pop(key, None)  # (_pop_posted inline: every frame with data)
        if posted is not None and not posted.future.done():
            err = self._mismatch(header, posted.view, posted.dtype)
            if err:
                posted.future.set_exception(VectorMismatch(err, [self.rank]))
                return None
            self._receiving[conn] = (key, posted)
            return posted.view
        if self._stale(header):
            return None
        self._check_ahead(header)
        if (header.payload_nbytes() <= self.stage_limit or self._posted
                or self._handled(header)):
            if self.staged_bytes + header.payload_nbytes() > self.budget.staged_bytes:
                raise ProtocolError(
                    f"rank {self.rank} sent more early data than its budget ("
                    f"{self.staged_bytes + header.payload_nbytes()} bytes staged, at most "
                    f"{self.budget.staged_bytes})")
            return self._stage_buffer(header)
        self._held[conn] = header
        if self._probes:
            self._arrived(key)
        return DEFER

    def delivered(self, conn: FrameProtocol, frame: Frame) -> None:
        header = frame.header
        if header.kind is Kind.CONTROL:
            op = header.meta.get("op")
            if op == Notice.op:  # for the log only, never queued
                log.error("rank %d says: %s", self.rank, str(header.meta.get("text"))[:500])
                return
            if op in OUT_OF_BAND:
                if self._on_control is not None:
                    self._on_control(self.rank, header.meta)
                return
            if self.control.qsize() >= self.budget.control:
                raise ProtocolError(f"rank {self.rank} sent more than {self.budget.control} "
                                    "control messages nobody has read")
            self.control.put_nowait(header.meta)
            return
        if header.kind is not Kind.DATA:
            conn.abort(f"unexpected {header.kind.name} frame after the handshake")
            return
        key = (header.step, header.tag)
        receiving = self._receiving.pop(conn, None)
        if receiving is not None:
            rkey, posted = receiving
            assert rkey == key, "frames on one connection complete in order"
            if frame.payload is not None and not posted.future.done():
                if self.latency <= 0:  # (inline: nearly every frame of a step lands here)
                    posted.future.set_result(header)
                else:
                    self._resolve(posted.future, header, self._now())
            return
        stale = self._stale(header)
        if stale and not header.payload_nbytes() and self._handled(header):
            self._hand_early_after(header, memoryview(b""))  # a stale request: answerable
            return
        if stale or (frame.payload is None and header.payload_nbytes()):
            log.debug("dropped stale frame from rank %d step %d tag %d (floor %d)",
                      self.rank, header.step, header.tag, self.floor)
            return
        payload = frame.payload if frame.payload is not None else memoryview(b"")
        waiting = self._pop_posted(key)
        if waiting is None:
            if self._unstage(key) is not None:  # e.g. a result re-sent after a parent died
                log.debug("rank %d sent step %d tag %d twice; keeping the newer frame",
                          self.rank, header.step, header.tag)
            self._check_ahead(header)
            if len(self._staged) >= self.budget.staged_frames:
                raise ProtocolError(f"rank {self.rank} sent more than "
                                    f"{self.budget.staged_frames} frames nobody has asked for")
            self._staged[key] = (header, payload, self._now())
            self.staged_bytes += payload.nbytes
            if is_p2p(header.tag):  # kept until received: no floor passes it
                if self._probes:
                    self._arrived(key)
                return
            tags = self._tags_of.get(header.step)
            if tags is None:
                tags = self._tags_of[header.step] = set()
                heapq.heappush(self._staged_steps, header.step)
            tags.add(header.tag)
            self._hand_early_after(header, payload)
            return
        self._copy_in(waiting.future, waiting.view, waiting.dtype, header, payload, self._now())

    def closed(self, conn: FrameProtocol, reason: str) -> None:
        self.conns.discard(conn)
        self._held.pop(conn, None)
        lost = PeerLost(self.rank, reason)
        receiving = self._receiving.pop(conn, None)
        if receiving is not None and not receiving[1].future.done():
            receiving[1].future.set_exception(lost)
        if self.conns:
            return
        self.lost = lost
        for posted in self._posted.values():
            if not posted.future.done():
                posted.future.set_exception(lost)
        self._posted.clear()
        for waiting in list(self._probes.values()):
            for fut in list(waiting):
                if not fut.done():
                    fut.set_exception(lost)
        self.control.put_nowait(None)
        if self._on_lost is not None:
            self._on_lost(self.rank)

    def connection_added(self, conn: FrameProtocol) -> None:
        self.conns.add(conn)
        self.lost = None

    def new_incarnation(self) -> None:
        """The rank's process was replaced: forget every frame its old process sent that is
        still here (staged, held, control), so none is mixed into the new one's."""
        for key in list(self._staged):
            self._unstage(key)
        for conn in list(self._held):
            del self._held[conn]
            conn.resume_with(None)
        while not self.control.empty():
            self.control.get_nowait()

    # -- helpers ------------------------------------------------------------------------------
    def _pop_posted(self, key: Key) -> _Posted | None:
        """The receive posted for ``key``, taken out; None if there is none, or if its owner
        cancelled it this turn (its withdrawal, a done-callback, has not run yet): nobody
        waits for a frame there, and its buffer is not ours to write."""
        posted = self._posted.pop(key, None)
        return None if posted is None or posted.future.done() else posted

    def _unstage(self, key: Key) -> tuple[Header, memoryview, float] | None:
        staged = self._staged.pop(key, None)
        if staged is not None:
            self.staged_bytes -= staged[1].nbytes
            tags = self._tags_of.get(key[0])
            if tags is not None:
                tags.discard(key[1])  # the step stays in the heap until the floor passes it
        return staged

    def _check_ahead(self, header: Header) -> None:
        """A frame far beyond our current step is no honest peer's: refuse it."""
        if (self.floor != NO_FLOOR and not is_p2p(header.tag)
                and header.step > self.floor + self.budget.steps_ahead):
            raise ProtocolError(f"rank {self.rank} sent a frame for step {header.step}, more "
                                f"than {self.budget.steps_ahead} steps ahead of step "
                                f"{self.floor}")

    def _handled(self, header: Header) -> bool:
        if is_p2p(header.tag):  # nobody's early handler: a receive claims it
            return False
        return any(header.tag >= lo for lo, _h in self._early)

    def _now(self) -> float:
        return self._timer.now() if self.latency > 0 else 0.0

    def _resolve(self, fut: asyncio.Future[Header], header: Header, arrived: float) -> None:
        """Resolve a receive whose frame arrived at ``arrived``: now, or once the emulated
        latency has passed since then."""
        if self.latency <= 0:
            fut.set_result(header)
            return
        due = arrived + self.latency
        if due <= self._timer.now():
            fut.set_result(header)
        else:
            self._timer.at(due, asyncio.get_running_loop(), _settle, fut, header)

    def _hand_early_after(self, header: Header, payload: memoryview) -> None:
        if self.latency <= 0:
            self._hand_early(header, payload)
        else:
            self._in_flight.add((header.step, header.tag))
            self._timer.at(self._timer.now() + self.latency, asyncio.get_running_loop(),
                           self._hand_late, header, payload)

    def _hand_late(self, header: Header, payload: memoryview) -> None:
        """An early frame whose emulated latency has passed: stale now if its stage ended
        meanwhile (as if it had arrived then), else offered to the handlers."""
        self._in_flight.discard((header.step, header.tag))
        if payload.nbytes and self._stale(header):
            return
        self._hand_early(header, payload)

    def _hand_early(self, header: Header, payload: memoryview) -> None:
        for entry in list(self._early):
            if header.tag >= entry[0]:
                self._offer(entry, header, payload)

    def _offer(self, entry: tuple[int, EarlyHandler], header: Header,
               payload: memoryview) -> None:
        try:
            entry[1](header, payload)
        except Exception:  # a scheme's bug must not break the connection
            log.exception("early-frame handler for rank %d failed", self.rank)

    def _replay(self, entry: tuple[int, EarlyHandler], keys: list[Key]) -> None:
        """Hand a new handler the frames that were staged before it existed (in the order
        they arrived), those still unclaimed, if it was not removed meanwhile."""
        for key in keys:
            staged = self._staged.get(key)
            if staged is None or entry not in self._early:
                continue
            self._offer(entry, staged[0], staged[1])

    def _stage_buffer(self, header: Header) -> memoryview:
        return np.empty(header.payload_nbytes(), dtype=np.uint8).data

    def _copy_in(self, fut: asyncio.Future[Header], view: memoryview, dtype: str,
                 header: Header, data: memoryview, arrived: float) -> None:
        """Complete a receive from a frame that was staged first (a small copy)."""
        err = self._mismatch(header, view, dtype)
        if err:
            fut.set_exception(VectorMismatch(err, [self.rank]))
        else:
            view[:] = data
            self._resolve(fut, header, arrived)

    def _mismatch(self, header: Header, view: memoryview, dtype: str) -> str:
        nbytes = header.payload_nbytes()
        if nbytes != view.nbytes or (nbytes and header.dtype != dtype):
            return (f"rank {self.rank} sent {header.dtype or 'no payload'} {list(header.shape)} "
                    f"({nbytes} bytes) for step {header.step} tag {header.tag}, but the receive "
                    f"buffer is {dtype} of {view.nbytes} bytes")
        return ""


def _settle(fut: asyncio.Future[Header], header: Header) -> None:
    if not fut.done():  # withdrawn meanwhile: nobody waits for it
        fut.set_result(header)
