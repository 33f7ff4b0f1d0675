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
``backlog_steps`` steps unsent is skipped, so a stopped peer holds at most that many steps
of our arrays. While we skip it we tell it (if the scheme gives a ``notice_tag``), over the
mesh (whose frames it reads all at once when it runs again), which step we are at: a
stopped rank that resumes learns at once how far behind it is and jumps (``FellBehind``),
instead of first running through every step its lanes still hold while its peers keep
skipping it because those lanes are full. Once it reads again, ``on_resumed`` lets the
scheme send what was skipped (a tree's results).

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

from ...errors import LaneMismatch, PeerLost
from ...wire import Header, Kind, byte_view
from ...wire.frame import ProtocolError
from ..base import BulkLink, BulkLinks, Comm
from .posts import Post, PostBook, Wait

log = logging.getLogger("aioreduce.schemes")
_NOTHING = np.empty(0, np.uint8)


class LaneLinks:
    """:class:`~.links.Links` over lanes ``outs`` (to each peer) and ``ins`` (from each), which
    this object owns from now on (see the module docstring); ``opened_by``, the comm's bulk
    links they came from, is told what each step moved over them (step telemetry)."""

    def __init__(self, comm: Comm, outs: Mapping[int, BulkLink], ins: Mapping[int, BulkLink],
                 backlog_steps: int, newest: int = -1, *,
                 opened_by: BulkLinks | None = None, notice_tag: int | None = None,
                 on_resumed: Callable[[int, int, int], None] | None = None,
                 early: Callable[[int, int, int], bool] | None = None,
                 on_early: Callable[[int, Header, memoryview], None] | None = None,
                 stage_bytes: int = 0, hear_comm: bool = True,
                 lost: Mapping[int, PeerLost] | None = None) -> None:
        self.comm = comm
        self._opened_by = opened_by
        self._notice_tag = notice_tag
        # (peer, first, last): a peer we skipped reads again; steps first..last were skipped.
        self._on_resumed = on_resumed
        self._early, self._on_early, self._stage_bytes = early, on_early, stage_bytes
        self._staged: dict[tuple[int, int, int], tuple[Header, memoryview]] = {}
        self._staging = 0  # bytes staged or being read into staging buffers
        self._loop = asyncio.get_running_loop()
        self._outs, self._ins = outs, ins
        self._backlog = backlog_steps
        # One lock; on its conditions wait the session for a withdrawn chunk's copy
        # (_cond) and each peer's reader for a post (_posted[src]): see "Waking" above.
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._posted = {src: threading.Condition(lock) for src in ins}
        self._book = PostBook()  # what each incoming slice fills (see .posts)
        self._closed = False
        # peer -> why its lane (either way) ended, or never opened (``lost``)
        self._gone: dict[int, PeerLost] = dict(lost or {})
        self._heard_at: dict[int, float] = {}  # peer -> perf_counter of its last bytes
        self.newest = newest
        # Per peer, the step of every message queued on its lane, oldest first; the lane
        # counts what it sent, in the same order.
        self._queued: dict[int, deque[int]] = {p: deque() for p in outs}
        self._forgotten: dict[int, int] = dict.fromkeys(outs, 0)
        self._skipping: dict[int, list[int]] = {}  # peer -> [first, last] step skipped
        self._sent: dict[int, int] = {}  # step -> bytes queued
        self._got: dict[int, dict[int, list[int]]] = {}  # step -> src -> [bytes, messages]
        self._told: dict[int, int] = {}  # peer -> the step we last told it we are at
        # Which step the peers are at, from their frames on the comm too (a scheme's verdicts
        # and notices); a user of the comm's other frames (exact exchanges) leaves them be.
        self._removers = [comm.on_early(p, 0, self._heard) for p in ins] if hear_comm else []
        self._readers = [threading.Thread(target=self._read, args=(src, lane), daemon=True,
                                          name=f"aioreduce-lane-from-{src}")
                         for src, lane in ins.items()]
        for reader in self._readers:
            reader.start()

    # -- the session's side (event loop) ------------------------------------------------------
    def post(self, src: int, out: np.ndarray, step: int, tag: int) -> asyncio.Future[Header]:
        fut: asyncio.Future[Header] = self._loop.create_future()
        key = (src, step, tag)
        with self._cond:
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
            self._book.post(Post(key, byte_view(out), fut))
            waiting = self._posted.get(src)
            if waiting is not None:
                waiting.notify()
        return fut

    def send(self, peer: int, array: np.ndarray, step: int, tag: int,
             meta: dict[str, Any]) -> None:
        if self.is_lost(peer):
            return
        lane, queued = self._outs[peer], self._queued[peer]
        sent = lane.sent  # once: the lane's thread may count more meanwhile
        for _done in range(sent - self._forgotten[peer]):
            queued.popleft()
        self._forgotten[peer] = sent
        if len(set(queued) - {step}) >= self._backlog:
            self._tell(peer, step)
            skipped = self._skipping.get(peer)
            if skipped is None:
                self._skipping[peer] = [step, step]
                log.warning("rank %d: rank %d is not reading (%d messages unsent); skipping "
                            "its messages until it drains", self.comm.rank, peer, len(queued))
            else:
                skipped[1] = max(skipped[1], step)
            return
        skipped = self._skipping.pop(peer, None)
        if skipped is not None:
            log.warning("rank %d: rank %d reads again", self.comm.rank, peer)
            if self._on_resumed is not None:
                # Before this message: what the scheme re-sends goes out first, in step order.
                self._on_resumed(peer, skipped[0], skipped[1])
        # dtype and shape as on the mesh: an early message is forwarded as what it is.
        head = Header(Kind.DATA, step, tag, self.comm.rank, array.dtype.str, array.shape,
                      meta).to_bytes()
        try:
            lane.send(step, tag, byte_view(array), head)
        except PeerLost as exc:
            self._lost(peer, exc)
            return
        queued.append(step)
        self._sent[step] = self._sent.get(step, 0) + array.nbytes

    async def flush(self, peers: Iterable[int]) -> None:
        """Return once every message queued to ``peers`` is in the kernel, so the arrays sent
        may change (what a lost peer's lane held is dropped: its loss is reported by the
        receives)."""
        lanes = [self._outs[p] for p in peers if p in self._outs]
        if any(not _flushed(lane, 0.0) for lane in lanes):
            await asyncio.to_thread(lambda: [_flushed(lane, None) for lane in lanes])

    def _tell(self, peer: int, step: int) -> None:
        """Tell a peer we skip that we are at ``step`` (once a step, in the background)."""
        if self._notice_tag is None or self._told.get(peer, -1) >= step:
            return
        self._told[peer] = step
        sending = asyncio.ensure_future(self.comm.send(peer, _NOTHING, step=step,
                                                      tag=self._notice_tag))
        sending.add_done_callback(lambda f: f.cancelled() or f.exception())  # lost: no matter

    def _heard(self, header: Header, _payload: memoryview) -> None:
        if header.step > self.newest:
            with self._cond:
                self.newest = max(self.newest, header.step)

    def discard_before(self, step: int, tag: int = 0) -> None:
        self.comm.discard_before(step, tag)
        with self._cond:
            for key in [k for k in self._staged if (k[1], k[2]) < (step, tag)]:
                self._staging -= self._staged.pop(key)[1].nbytes
            writing = self._book.discard_before(step, tag)
            # One chunk's copy at most (the read never blocks). While we wait, readers may
            # complete or lose other posts: the book took these out already.
            while any(p.writing for p in writing):
                self._cond.wait()
            for waiting in self._posted.values():  # a message it waits with may be over now
                waiting.notify()

    def is_lost(self, rank: int) -> bool:
        return rank in self._gone or self.comm.is_lost(rank)

    def heard_at(self, src: int) -> float:
        return self._heard_at.get(src, 0.0)

    def end_step(self, step: int) -> None:
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
        with self._cond:
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

    # -- the readers (one thread per peer) ----------------------------------------------------
    def _read(self, src: int, lane: BulkLink) -> None:
        try:
            while True:
                step, tag, nbytes, meta_bytes = lane.read_head()
                try:
                    header = Header.from_bytes(lane.read_meta(meta_bytes))
                except ProtocolError as exc:
                    raise PeerLost(src, f"lane from rank {src}: {exc}") from None
                if (header.step, header.tag, header.src) != (step, tag, src):
                    raise PeerLost(src, f"lane from rank {src}: header {header} for "
                                   f"(step, slice) {(step, tag)}")
                post = self._claim(src, step, tag, nbytes)
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
        except PeerLost as exc:
            self._lost(src, exc)
        except Exception as exc:  # a bug: end this lane, say why
            self._lost(src, PeerLost(src, f"lane from rank {src}: {exc!r}"))

    def _claim(self, src: int, step: int, tag: int, nbytes: int) -> Post | None:
        """The post this message fills, once there is one (or a staging buffer, for an early
        message the scheme wants at once); None: drop it (below the floor)."""
        with self._cond:
            self.newest = max(self.newest, step)
            while True:
                if self._closed:
                    raise PeerLost(src, "closed")
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
                self._posted[src].wait()

    def _staged_in(self, post: Post, header: Header, latency: float) -> None:
        """An early message is in its buffer: fill the receive posted for it meanwhile, or
        keep it for the one posted later and show it to the scheme's early handler."""
        with self._cond:
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
                    self._loop.call_soon_threadsafe(self._loop.call_later, latency, early)
                else:
                    self._loop.call_soon_threadsafe(early)
            except RuntimeError:  # the loop is closed
                pass

    def _fill(self, lane: BulkLink, post: Post, nbytes: int) -> bool:
        """Read the payload into the post's buffer; False if it was withdrawn meanwhile (the
        rest is read and dropped)."""
        got = 0
        while got < nbytes:
            lane.wait_readable()
            with self._cond:
                if not self._book.begin_write(post):
                    break
            try:
                got += lane.recv_now(post.view[got:])
                self._heard_at[lane.peer] = time.perf_counter()
            finally:
                with self._cond:
                    self._book.end_write(post)
                    if post.withdrawn:  # the session may wait for this copy
                        self._cond.notify_all()
        if got < nbytes:
            lane.skip(nbytes - got)
            return False
        with self._cond:
            self._book.complete(post)
        return True

    def _finish(self, post: Post, header: Header | None, exc: BaseException | None,
                nbytes: int = 0, latency: float = 0.0) -> None:
        def done() -> None:
            assert post.future is not None  # a staging buffer is never finished
            if post.future.done():
                return  # withdrawn: the stage ended without it
            if exc is not None:
                post.future.set_exception(exc)
                return
            assert header is not None
            post.future.set_result(header)
            self._count(header.step, header.src, nbytes)

        try:
            if latency > 0:  # emulated one-way latency: it arrives this much later
                self._loop.call_soon_threadsafe(self._loop.call_later, latency, done)
            else:
                self._loop.call_soon_threadsafe(done)
        except RuntimeError:  # the loop is closed: nobody waits for it any more
            pass

    def _count(self, step: int, src: int, nbytes: int) -> None:
        """A message of ``nbytes`` from ``src`` completed a receive of ``step`` (telemetry)."""
        counts = self._got.setdefault(step, {}).setdefault(src, [0, 0])
        counts[0] += nbytes
        counts[1] += 1

    def _lost(self, peer: int, exc: PeerLost) -> None:
        """``peer``'s lane ended: its posts fail now and later ones at once."""
        with self._cond:
            if self._closed:
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


def _flushed(lane: BulkLink, timeout: float | None) -> bool:
    try:
        return lane.flush(timeout)
    except PeerLost:
        return True  # nothing more will be sent on it


def _mismatch(key: tuple[int, int, int], got: int, want: int) -> LaneMismatch:
    """Message ``key`` (src, step, tag) of ``got`` bytes for a receive of ``want``."""
    src, step, tag = key
    return LaneMismatch(src, (step, tag, got), (step, tag, want))
