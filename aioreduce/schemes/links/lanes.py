"""Messages over lanes: one blocking lane to and one from each peer a scheme names (the
transpose: every peer; a tree: its parent and children).

Why. Through the event loop a rank moves its slices only when its loop turns: on a host
whose ranks share cores, a loop busy with a rotation or a sum (or a rank waiting for a core)
held the last slice of a shard back for 30-80 ms, and the rank waiting for it started its next
step that much late and was cut from it. On a lane, bytes move on threads of their own while
the loop computes, and a slice costs no Python per chunk beyond a few calls.

How. Every peer's incoming lane has a reader thread. It reads a message's header and meta
(a wire :class:`~aioreduce.wire.Header`, validated as any frame's) and claims the posted
receive for (peer, step, slice): it waits for the post if the message is ahead of this
rank (backpressure: the peer's lane fills, nothing is buffered here), and drops the message
if it is below the floor. The payload goes straight into the posted buffer, chunk by chunk,
each chunk read without blocking once the lane has bytes, and marked as being written while
it is: :meth:`LaneLinks.discard_before` withdraws a post between two chunks (waiting at most
for one chunk's copy), so once it returns the buffer is never written again, even if the peer
sends the rest later. Sends go to the lane's own sender thread; a peer with
``backlog_steps`` steps unsent is skipped (None: never, a ring's way: it waits for every
rank anyway), so a stopped peer holds at most that many steps
of our arrays. While we skip it we tell it (if the scheme gives a ``notice_tag``), over the
mesh (whose frames it reads all at once when it runs again), which step we are at: a
stopped rank that resumes learns at once how far behind it is and jumps (``FellBehind``),
instead of first running through every step its lanes still hold while its peers keep
skipping it because those lanes are full. Once it reads again, ``on_resumed`` lets the
scheme send what was skipped (a tree's results).

Without reader threads (``readers=False``, the ring's way). A thread that receives one
message after another from a peer, in the order they are sent, reads that peer's lane itself
(:meth:`LaneLinks.recv`): no post, no hand-off between threads per message, the same floor
(stale messages dropped), loss book and telemetry. Waiting for the next message it can be
woken (``Lane.wake``: :meth:`LaneLinks.discard_before` does, and the receive gives up with
:class:`Withdrawn`); a payload already coming is read to its end first (its peer is sending
it now), and discard_before waits for that copy, as it waits for a reader's chunk.

Early messages. A message that no receive is posted for yet normally waits in the lane (see
above). A scheme that must act on some before it asks for them (a tree rank forwards a result
from its parent to its children while it still computes its own step) names them with
``early(src, step, tag)``: those are read into a buffer of their own at once (at most
``stage_bytes`` of them held; beyond that they wait as any other), handed to
``on_early(src, header, payload)`` on the event loop, and kept for the receive that is posted
later (copied into it, as the mesh's inbox does with the frames it stages).

Waking. One lock guards the book; a reader waiting for a post waits on its own peer's
condition, and the session waiting for a chunk's copy on another, so a post or a copied
chunk wakes only the thread that cares (with one shared condition, every chunk read on a
12-child star woke all twelve readers, and the master spent four times the CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from ...delayline import LINE
from ...errors import LaneMismatch, PeerLost
from ...wire import Header, Kind, byte_view
from ...wire.frame import ProtocolError
from ..base import BulkLink, BulkLinks, Comm
from .posts import Post, PostBook, Wait

log = logging.getLogger("aioreduce.schemes")
_NOTHING = np.empty(0, np.uint8)


class Withdrawn(Exception):
    """An in-order receive (:meth:`LaneLinks.recv`) whose step is over: it fell below the
    floor (:meth:`LaneLinks.discard_before`) before or while it came."""


class LaneLinks:
    """:class:`~.links.Links` over lanes ``outs`` (to each peer) and ``ins`` (from each), which
    this object owns from now on (see the module docstring); ``opened_by``, the comm's bulk
    links they came from, is told what each step moved over them (step telemetry).
    ``lending``: sends may be lent (:meth:`lends`, :meth:`release`; the lanes' sends then
    time out now and then, see ``Lane.allow_lending``)."""

    def __init__(self, comm: Comm, outs: Mapping[int, BulkLink], ins: Mapping[int, BulkLink],
                 backlog_steps: int | None, newest: int = -1, *,
                 opened_by: BulkLinks | None = None, notice_tag: int | None = None,
                 on_resumed: Callable[[int, int, int], None] | None = None,
                 early: Callable[[int, int, int], bool] | None = None,
                 on_early: Callable[[int, Header, memoryview], None] | None = None,
                 stage_bytes: int = 0, hear_comm: bool = True,
                 lost: Mapping[int, PeerLost] | None = None, readers: bool = True,
                 lending: bool = False) -> None:
        self.comm = comm
        # Sends may be lent (see Links.lends): the lanes' sends then time out, see Lane.
        self._lending = lending
        self._opened_by = opened_by
        self._notice_tag = notice_tag
        # (peer, first, last): a peer we skipped reads again; steps first..last were skipped.
        self._on_resumed = on_resumed
        self._early, self._on_early, self._stage_bytes = early, on_early, stage_bytes
        self._staged: dict[tuple[int, int, int], tuple[Header, memoryview]] = {}
        self._staging = 0  # bytes staged or being read into staging buffers
        self._loop = asyncio.get_running_loop()
        self._backlog = backlog_steps
        # One lock; on its conditions wait the session for a withdrawn chunk's copy
        # (_cond) and each peer's reader for a post (_posted[src]): see "Waking" above.
        lock = threading.RLock()
        # Taken directly, also around a condition's wait or notify (the same lock): a
        # Condition's ``with`` is two Python calls more, several times a step.
        self._lock = lock
        self._cond = threading.Condition(lock)
        self._book = PostBook()  # what each incoming slice fills (see .posts)
        self._closed = False
        self._heard_at: dict[int, float] = {}  # peer -> perf_counter of its last bytes
        self.newest = newest
        self.cut_at = -1  # the newest step a peer told us it skipped us at (see _heard)
        self._skipping: dict[int, list[int]] = {}  # peer -> [first, last] step skipped
        self._sent: dict[int, int] = {}  # step -> bytes queued
        self._got: dict[int, dict[int, list[int]]] = {}  # step -> src -> [bytes, messages]
        self._told: dict[int, int] = {}  # peer -> the step we last told it we are at
        # Which step the peers are at, from their frames on the comm too (a scheme's verdicts
        # and notices); a user of the comm's other frames (exact exchanges) leaves them be.
        self._hear_comm = hear_comm
        self._removers: list[Callable[[], None]] = []
        # Without reader threads, the thread that waits for a message reads (see recv()).
        self._inline = not readers
        self._discarding = 0  # discard_before calls waiting for a copy to end
        self._readers: list[threading.Thread] = []
        # Per peer (set up by add, for these lanes and any opened later): its lanes, its
        # reader's condition, the step of every message queued on its lane (oldest first;
        # the lane counts what it sent, in the same order) and how many of those are
        # forgotten, what is left of a stale message, and the message recv is reading now.
        self._outs: dict[int, BulkLink] = {}
        self._ins: dict[int, BulkLink] = {}
        self._posted: dict[int, threading.Condition] = {}
        # How many readers of each peer wait for a post now (two, briefly, while a
        # replaced lane's reader leaves): only those peers' are notified (a Condition's
        # notify is Python even with nobody waiting, several times a step).
        self._waiting: dict[int, int] = {}
        self._queued: dict[int, deque[int]] = {}
        self._forgotten: dict[int, int] = {}
        self._skip_left: dict[int, int] = {}
        self._reading: dict[int, tuple[int, int] | None] = {}
        self._gone: dict[int, PeerLost] = {}
        self.add(outs, ins)
        # peer -> why its lane (either way) ended, or never opened (``lost``)
        self._gone.update(lost or {})

    def _start_reader(self, src: int, lane: BulkLink) -> None:
        reader = threading.Thread(target=self._read, args=(src, lane), daemon=True,
                                  name=f"aioreduce-lane-from-{src}")
        self._readers.append(reader)
        reader.start()

    def add(self, outs: Mapping[int, BulkLink], ins: Mapping[int, BulkLink]) -> None:
        """Take over lanes ``outs`` and ``ins``: those given at construction, and lanes
        opened later with peers whose lanes ended (a replacement process of a dead rank, see
        :mod:`aioreduce.heal`), which replace those peers' old lanes (closed). The old
        lanes' reader can no longer claim a post (it checks that its lane is still the
        peer's), so nothing the dead process sent lands in a receive meant for its
        replacement."""
        old: list[BulkLink] = []
        with self._lock:
            for peer, lane in outs.items():
                if peer in self._outs:
                    old.append(self._outs[peer])
                if self._lending:
                    lane.allow_lending()
                self._outs[peer] = lane
                self._queued[peer] = deque()
                self._forgotten[peer] = 0
                self._skipping.pop(peer, None)
                self._told.pop(peer, None)
            for src, lane in ins.items():
                if src in self._ins:
                    old.append(self._ins[src])
                elif self._hear_comm:
                    self._removers.append(self.comm.on_early(src, 0, self._heard))
                self._ins[src] = lane
                self._posted.setdefault(src, threading.Condition(self._lock)).notify_all()
                self._skip_left[src] = 0
                self._reading[src] = None
            for peer in {*outs, *ins}:
                self._gone.pop(peer, None)
                self._heard_at.pop(peer, None)
        if old:  # (closing joins a lane's sender thread: not on the event loop)
            threading.Thread(target=_close_all, args=(old,), daemon=True,
                             name="aioreduce-lanes-replaced").start()
        if not self._inline:
            for src, lane in ins.items():
                self._start_reader(src, lane)

    # -- the session's side (event loop) ------------------------------------------------------
    def post(self, src: int, out: np.ndarray, step: int, tag: int, *,
             whole: bool = False) -> asyncio.Future[Header]:
        fut: asyncio.Future[Header] = self._loop.create_future()
        key = (src, step, tag)
        with self._lock:
            staged = self._staged.pop(key, None)
            if staged is not None:  # it came early: copy it in (on the loop, as the inbox)
                header, payload = staged
                self._staging -= payload.nbytes
                view = byte_view(out)
                if view.nbytes != payload.nbytes:
                    fut.set_exception(_mismatch(key, payload.nbytes, view.nbytes))
                else:
                    view[:] = payload
                    fut.set_result(header)
                    self._count(step, src, payload.nbytes)
                return fut
            gone = self._gone.get(src)
            if gone is not None:
                fut.set_exception(gone)
                return fut
            self._book.post(Post(key, byte_view(out), fut,
                                 unit=out.dtype.itemsize if whole else 1))
            if src in self._waiting:
                self._posted[src].notify()
        return fut

    def recv(self, src: int, out: np.ndarray, step: int, tag: int) -> None:
        """Without reader threads (``readers=False``): receive message (step, ``tag``) from
        ``src`` into ``out``, the calling thread (not the loop) reading ``src``'s lane itself,
        in order: a message below the floor is dropped, the next one must be this one. The
        same framing, floor and loss as the posted receives, without a hand-off per message
        (a ring's segments, one after the other: a reader thread handing each over cost a
        13-rank 40 KB ring three times its CPU on 2 cores).

        Raises :class:`Withdrawn` once (step, ``tag``) is below the floor
        (:meth:`discard_before`: the step failed elsewhere; a payload that is coming is read
        to its end first, and discard_before waits for that), :class:`PeerLost` if the lane
        ended or the peer sent something else, :class:`LaneMismatch` for a message of
        another size (dropped: the lane stays usable)."""
        lane, view, key = self._ins[src], byte_view(out), (step, tag)
        try:
            while True:
                if key < self._book.floor:
                    raise Withdrawn()
                gone = self._gone.get(src)
                if gone is not None:
                    raise gone
                if self._skip_left[src]:  # the rest of a stale message
                    self._skip_left[src] = self._drop(lane, self._skip_left[src])
                    continue
                if lane.streaming:  # large messages coming: head and payload in one read
                    with self._lock:
                        if key < self._book.floor:
                            continue
                        self._reading[src] = key  # (discard_before waits for this copy)
                    landed = self._land(src, lane, view, key, expected=True)
                    if landed:
                        break
                    if landed is None:  # nothing there yet
                        lane.wait_readable()  # (or woken: either way, look again)
                        continue
                    # Another message: its bytes are read ahead, for the general way.
                if not lane.wait_head():
                    continue  # woken: look at the floor again
                with self._lock:  # the usual small message, whole in the lane's read-ahead
                    if key >= self._book.floor and lane.take_bare(step, tag, view):
                        self._count(step, src, view.nbytes)
                        break
                m_step, m_tag, nbytes, meta_bytes = lane.read_head()
                if meta_bytes:  # a described message: its header is checked, not needed
                    self._described(src, lane, m_step, m_tag, meta_bytes)
                if (m_step, m_tag) < self._book.floor:  # a failed step's: stale
                    self._skip_left[src] = nbytes
                    continue
                if (m_step, m_tag) != key:
                    raise PeerLost(src, f"lane from rank {src}: message {(m_step, m_tag)} "
                                   f"where {key} was next")
                if nbytes != view.nbytes:
                    self._skip_left[src] = nbytes
                    raise _mismatch((src, step, tag), nbytes, view.nbytes)
                with self._lock:
                    if key < self._book.floor:
                        self._skip_left[src] = nbytes
                        continue
                    if lane.buffered >= nbytes:  # a small one, read with its head
                        lane.read_into(view)
                        self._count(step, src, nbytes)
                        break
                    self._reading[src] = key  # (discard_before waits for this copy)
                self._land(src, lane, view, key, expected=False)
                break
        except PeerLost as exc:
            self._lost(src, exc)
            raise self._gone.get(src, exc) from None
        if lane.latency > 0:  # emulated: it arrives this much later
            time.sleep(lane.latency)

    def send(self, peer: int, array: np.ndarray, step: int, tag: int,
             meta: dict[str, Any], *, bare: bool = False, lent: bool = False) -> bool:
        """See :class:`~.comm.Links`; False if ``peer`` is lost (nothing was sent).
        ``bare``: the message carries no wire header (dtype, shape, meta), only the lane's
        (step, slice, bytes), for a receiver that knows what it receives (a ring's segments:
        the header would cost more than a small one's copy); never for a message the
        receiver may take early."""
        if self.is_lost(peer):
            return False
        lane = self._outs[peer]
        if self._backlog is None:  # never skipped: nothing to keep count of
            return self._put(peer, lane, array, step, tag, meta, bare, lent)
        queued = self._queued[peer]
        sent = lane.sent  # once: the lane's thread may count more meanwhile
        for _done in range(sent - self._forgotten[peer]):
            queued.popleft()
        self._forgotten[peer] = sent
        if len(queued) >= self._backlog and len(set(queued) - {step}) >= self._backlog:
            self._tell(peer, step)
            skipped = self._skipping.get(peer)
            if skipped is None:
                self._skipping[peer] = [step, step]
                log.warning("rank %d: rank %d is not reading (%d messages unsent); skipping "
                            "its messages until it drains", self.comm.rank, peer, len(queued))
            else:
                skipped[1] = max(skipped[1], step)
            return True
        skipped = self._skipping.pop(peer, None)
        if skipped is not None:
            log.warning("rank %d: rank %d reads again", self.comm.rank, peer)
            if self._on_resumed is not None:
                # Before this message: what the scheme re-sends goes out first, in step order.
                self._on_resumed(peer, skipped[0], skipped[1])
        if not self._put(peer, lane, array, step, tag, meta, bare, lent):
            return False
        queued.append(step)
        return True

    def _put(self, peer: int, lane: BulkLink, array: np.ndarray, step: int, tag: int,
             meta: dict[str, Any], bare: bool, lent: bool) -> bool:
        """Queue the message on ``lane``; False if the lane has ended (``peer`` is lost)."""
        # dtype and shape as on the mesh: an early message is forwarded as what it is.
        head = b"" if bare else Header(Kind.DATA, step, tag, self.comm.rank, array.dtype.str,
                                       array.shape, meta).to_bytes()
        try:
            lane.send(step, tag, byte_view(array), head, lent=lent)
        except PeerLost as exc:
            self._lost(peer, exc)
            return False
        self._sent[step] = self._sent.get(step, 0) + array.nbytes
        return True

    def lends(self, peer: int) -> bool:
        return self._lending and peer in self._outs

    def on_host(self, peer: int) -> bool:
        """Whether the lane to ``peer`` stays on this host (a Unix socket): no network link
        that other flows share lies between us."""
        lane = self._outs.get(peer)
        return lane is not None and lane.local

    def release(self, peers: Iterable[int]) -> None:
        for peer in peers:
            lane = self._outs.get(peer)
            if lane is not None:
                lane.release()

    async def flush(self, peers: Iterable[int]) -> None:
        """Return once every message queued to ``peers`` is in the kernel, so the arrays sent
        may change (what a lost peer's lane held is dropped: its loss is reported by the
        receives)."""
        ours = [p for p in peers if p in self._outs]
        if any(not _flushed(self._outs[p], 0.0) for p in ours):
            await asyncio.to_thread(self.wait_sent, ours)

    def wait_sent(self, peers: Iterable[int]) -> None:
        """:meth:`flush` for a worker thread: block until it is so."""
        for peer in peers:
            if peer in self._outs:
                _flushed(self._outs[peer], None)

    def lost(self, peer: int) -> PeerLost | None:
        """Why ``peer`` can no longer be sent to or received from (None: it can)."""
        gone = self._gone.get(peer)
        if gone is None and self.comm.is_lost(peer):
            gone = PeerLost(peer, "connection lost")
        return gone

    def _tell(self, peer: int, step: int) -> None:
        """Tell a peer we skip that we are at ``step`` (once a step, in the background)."""
        if self._notice_tag is None or self._told.get(peer, -1) >= step:
            return
        self._told[peer] = step
        sending = asyncio.ensure_future(self.comm.send(peer, _NOTHING, step=step,
                                                      tag=self._notice_tag))
        sending.add_done_callback(lambda f: f.cancelled() or f.exception())  # lost: no matter

    def _heard(self, header: Header, _payload: memoryview) -> None:
        if header.tag == self._notice_tag and header.step > self.cut_at:
            self.cut_at = header.step  # (on the loop, as every reader of it)
        if header.step > self.newest:
            with self._lock:
                self.newest = max(self.newest, header.step)

    def discard_before(self, step: int, tag: int = 0) -> None:
        self.comm.discard_before(step, tag)
        with self._lock:
            for key in [k for k in self._staged if (k[1], k[2]) < (step, tag)]:
                self._staging -= self._staged.pop(key)[1].nbytes
            writing = self._book.discard_before(step, tag)
            floor = self._book.floor
            # One chunk's copy at most (the read never blocks). While we wait, readers may
            # complete or lose other posts: the book took these out already. An in-order
            # receive (recv) reads the rest of a message its peer is sending now.
            self._discarding += 1
            try:
                while (any(p.writing for p in writing)
                       or any(k is not None and k < floor for k in self._reading.values())):
                    self._cond.wait()
            finally:
                self._discarding -= 1
            for src in self._waiting:  # a message it waits with may be over now
                self._posted[src].notify()
        if self._inline:  # a thread waiting in recv: let it see its receive is over
            for lane in self._ins.values():
                lane.wake()

    def is_lost(self, rank: int) -> bool:
        return rank in self._gone or self.comm.is_lost(rank)

    def heard_at(self, src: int) -> float:
        return self._heard_at.get(src, 0.0)

    def tell(self, peer: int, step: int) -> None:
        """A lane is read in order, so a peer behind us sees our newer steps only once it
        has read the older ones: tell it over the mesh (see ``notice_tag``)."""
        if not self.is_lost(peer):
            self._tell(peer, step)

    def landed(self, src: int, step: int, tag: int) -> int:
        with self._lock:
            return self._book.landed((src, step, tag))

    def end_step(self, step: int) -> None:
        with self._lock:  # (what landed in this step's cut receives is asked for after)
            self._book.forget(step - 1)
        sent = self._sent.pop(step, 0)
        got = self._got.pop(step, {})
        if not got:
            got = {next(iter(self._ins), self.comm.rank): [0, 0]}
        for src, (nbytes, messages) in got.items():
            if self._opened_by is not None:
                self._opened_by.count_moved(step, sent, src, nbytes, messages)
            sent = 0
        for old in [s for s in self._sent if s < step]:  # steps that ended in an error
            del self._sent[old]

    async def close(self, timeout: float) -> None:
        for remove in self._removers:
            remove()
        self._removers.clear()
        with self._lock:
            self._closed = True
            self._cond.notify_all()
            for waiting in self._posted.values():
                waiting.notify()
        await asyncio.to_thread(self._shut, timeout)

    def _shut(self, timeout: float) -> None:
        until = time.monotonic() + timeout
        for lane in self._outs.values():
            with contextlib.suppress(PeerLost):
                lane.flush(max(0.0, until - time.monotonic()))
        for lane in (*self._outs.values(), *self._ins.values()):
            lane.close()
        for reader in self._readers:
            reader.join(timeout=5)

    # -- the readers (one thread per peer; without them, recv() reads) ------------------------
    def _read(self, src: int, lane: BulkLink) -> None:
        try:
            while True:
                self._receive(src, lane)
        except PeerLost as exc:
            self._lost(src, exc, lane)
        except Exception as exc:  # a bug: end this lane, say why
            self._lost(src, PeerLost(src, f"lane from rank {src}: {exc!r}"), lane)

    def _receive(self, src: int, lane: BulkLink) -> None:
        """Take one message off ``src``'s lane and put it where it goes."""
        step, tag, nbytes, header = self._head(src, lane)
        post = self._claim(src, lane, step, tag, nbytes)
        if post is None:
            lane.skip(nbytes)
        elif post.view.nbytes != nbytes:
            self._finish(post, None, _mismatch(post.key, nbytes, post.view.nbytes))
            lane.skip(nbytes)
        elif post.future is None:  # an early message, into a buffer of its own
            self._fill(lane, post, nbytes)
            self._staged_in(post, header, lane.latency)
        elif self._fill(lane, post, nbytes):
            self._finish(post, header, None, nbytes, lane.latency)

    @classmethod
    def _head(cls, src: int, lane: BulkLink) -> tuple[int, int, int, Header]:
        """The next message's (step, slice, payload bytes) and wire header, checked."""
        step, tag, nbytes, meta_bytes = lane.read_head()
        if not meta_bytes:  # a bare message (see send): what the lane says is all there is
            return step, tag, nbytes, Header(Kind.DATA, step, tag, src)
        return step, tag, nbytes, cls._described(src, lane, step, tag, meta_bytes)

    @staticmethod
    def _described(src: int, lane: BulkLink, step: int, tag: int, meta_bytes: int) -> Header:
        """A message's wire header (``meta_bytes`` of it follow the lane's head), checked."""
        try:
            header = Header.from_bytes(lane.read_meta(meta_bytes))
        except ProtocolError as exc:
            raise PeerLost(src, f"lane from rank {src}: {exc}") from None
        if (header.step, header.tag, header.src) != (step, tag, src):
            raise PeerLost(src, f"lane from rank {src}: header {header} for "
                           f"(step, slice) {(step, tag)}")
        return header

    @staticmethod
    def _drop(lane: BulkLink, nbytes: int) -> int:
        """Read and drop up to ``nbytes`` until woken; what is left."""
        sink = memoryview(bytearray(min(nbytes, 1 << 18)))
        while nbytes > 0 and lane.wait_readable():
            nbytes -= lane.recv_now(sink[:min(nbytes, sink.nbytes)])
        return nbytes

    def _claim(self, src: int, lane: BulkLink, step: int, tag: int, nbytes: int
               ) -> Post | None:
        """The post this message fills, once there is one (or a staging buffer, for an early
        message the scheme wants at once); None: drop it (below the floor)."""
        with self._lock:
            self.newest = max(self.newest, step)
            while True:
                if self._closed:
                    raise PeerLost(src, "closed")
                if self._ins.get(src) is not lane:  # replaced (add): a dead process's
                    raise PeerLost(src, "lane replaced")
                post = self._book.claim(src, step, tag)
                if not isinstance(post, Wait):
                    return post
                key = (src, step, tag)
                if key in self._staged:
                    return None  # sent twice: not by one of ours; the first one counts
                if (self._early is not None and self._early(src, step, tag)
                        and self._staging + nbytes <= self._stage_bytes):
                    self._staging += nbytes
                    return Post(key, memoryview(bytearray(nbytes)), None)
                self._waiting[src] = self._waiting.get(src, 0) + 1
                try:
                    self._posted[src].wait()
                finally:
                    left = self._waiting[src] = self._waiting[src] - 1
                    if not left:
                        del self._waiting[src]

    def _staged_in(self, post: Post, header: Header, latency: float) -> None:
        """An early message is in its buffer: fill the receive posted for it meanwhile, or
        keep it for the one posted later and show it to the scheme's early handler."""
        with self._lock:
            key = post.key
            waiting = self._book.posts.get(key)
            if (key[1], key[2]) < self._book.floor or self._closed:
                self._staging -= post.view.nbytes  # over meanwhile
                return
            if waiting is None:
                self._staged[key] = (header, post.view)
            else:
                self._staging -= post.view.nbytes
                self._book.complete(waiting)
        if waiting is not None:
            if waiting.view.nbytes != post.view.nbytes:
                self._finish(waiting, None, _mismatch(key, post.view.nbytes,
                                                      waiting.view.nbytes))
            else:  # out of the book: nobody else writes it now
                waiting.view[:] = post.view
                self._finish(waiting, header, None, post.view.nbytes, latency)
            return
        handler = self._on_early
        if handler is not None:
            def early() -> None:
                handler(key[0], header, post.view)

            try:
                if latency > 0:
                    LINE.at(time.monotonic() + latency, self._loop, early)
                else:
                    self._loop.call_soon_threadsafe(early)
            except RuntimeError:  # the loop is closed
                pass

    def _fill(self, lane: BulkLink, post: Post, nbytes: int) -> bool:
        """Read the payload into the post's buffer; False if it was withdrawn meanwhile (the
        rest is read and dropped)."""
        got, unit = 0, post.unit
        while got < nbytes:
            lane.wait_readable(unit)
            with self._lock:  # (the conditions' lock, without a Condition's Python per chunk)
                if not self._book.begin_write(post):
                    break
            try:
                got += lane.recv_now(post.view[got:], unit)
                # (the post's source: a re-formed scheme numbers its peers by position)
                self._heard_at[post.key[0]] = time.perf_counter()
            finally:
                with self._lock:
                    post.landed = got
                    self._book.end_write(post)
                    if post.withdrawn:  # the session may wait for this copy
                        self._cond.notify_all()
        if got < nbytes:
            lane.skip(nbytes - got)
            return False
        with self._lock:
            self._book.complete(post)
        return True

    def _finish(self, post: Post, header: Header | None, exc: BaseException | None,
                nbytes: int = 0, latency: float = 0.0) -> None:
        fut = post.future
        assert fut is not None  # a staging buffer is never finished

        def done() -> None:
            if fut.done():
                return  # withdrawn: the stage ended without it
            if exc is not None:
                fut.set_exception(exc)
                return
            assert header is not None
            fut.set_result(header)
            self._count(header.step, header.src, nbytes)

        try:
            if latency > 0:  # emulated one-way latency: it arrives this much later
                LINE.at(time.monotonic() + latency, self._loop, done)
            else:
                self._loop.call_soon_threadsafe(done)
        except RuntimeError:  # the loop is closed: nobody waits for it any more
            pass

    def _land(self, src: int, lane: BulkLink, view: memoryview, key: tuple[int, int], *,
              expected: bool) -> bool | None:
        """Read the message that ``recv`` waits for into ``view`` (``expected``: head and all
        in one read, see :meth:`BulkLink.read_expected`, whose answer is returned), the
        caller having set ``_reading[src]``: discard_before waits until this copy is over.
        Raises :class:`Withdrawn` if the step ended meanwhile (the bytes landed for nobody)."""
        landed: bool | None = None
        try:
            if expected:
                landed = lane.read_expected(key[0], key[1], view)
            else:
                lane.read_into(view)
                landed = True
        finally:
            with self._lock:  # (the lock of _cond: notify may be called here)
                self._reading[src] = None
                if self._discarding:
                    self._cond.notify_all()
                over = key < self._book.floor
                if landed and not over:
                    self._count(key[0], src, view.nbytes)
        if landed and over:
            raise Withdrawn()
        return landed

    def _count(self, step: int, src: int, nbytes: int) -> None:
        """A message of ``nbytes`` from ``src`` completed a receive of ``step`` (telemetry)."""
        counts = self._got.setdefault(step, {}).setdefault(src, [0, 0])
        counts[0] += nbytes
        counts[1] += 1

    def _lost(self, peer: int, exc: PeerLost, lane: BulkLink | None = None) -> None:
        """``peer``'s lane ended: its posts fail now and later ones at once (not if that was
        ``lane``, a lane that :meth:`add` replaced since)."""
        with self._lock:
            if self._closed or (lane is not None and lane is not self._ins.get(peer)
                                and lane is not self._outs.get(peer)):
                return
            self._gone.setdefault(peer, exc)
            posts = self._book.lose(peer)
        for post in posts:
            self._finish(post, None, exc)


def unopened(peers: Iterable[int], outs: Mapping[int, object], ins: Mapping[int, object],
             step: int) -> dict[int, PeerLost]:
    """The peers whose lanes a partial opening at ``step`` left out (for ``lost``)."""
    return {p: PeerLost(p, f"no lane with rank {p}: it did not open its side at step {step}")
            for p in peers if p not in outs or p not in ins}


def _close_all(lanes: list[BulkLink]) -> None:
    for lane in lanes:
        lane.close()


def _flushed(lane: BulkLink, timeout: float | None) -> bool:
    try:
        return lane.flush(timeout)
    except PeerLost:
        return True  # nothing more will be sent on it


def _mismatch(key: tuple[int, int, int], got: int, want: int) -> LaneMismatch:
    """Message ``key`` (src, step, tag) of ``got`` bytes for a receive of ``want``."""
    src, step, tag = key
    return LaneMismatch(src, (step, tag, got), (step, tag, want))
