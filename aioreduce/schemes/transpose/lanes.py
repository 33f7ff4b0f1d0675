"""The transpose's slices over lanes: one blocking lane to and one from every peer.

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
of our arrays. While we skip it we tell it, over the mesh (whose frames it reads all at once
when it runs again), which step we are at: a stopped rank that resumes learns at once how far
behind it is and jumps (``FellBehind``), instead of first running through every step its
lanes still hold while its peers keep skipping it because those lanes are full.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import LaneMismatch, PeerLost
from ...wire import Header, Kind, byte_view
from ...wire.frame import ProtocolError
from ..base import BulkLink, BulkLinks, Comm
from .layout import NOTICE_TAG
from .posts import Post, PostBook, Wait

log = logging.getLogger("aioreduce.schemes")
_NOTHING = np.empty(0, np.uint8)


class LaneLinks:
    """:class:`~.links.Links` over lanes ``outs`` (to each peer) and ``ins`` (from each), which
    this object owns from now on (see the module docstring); ``opened_by``, the comm's bulk
    links they came from, is told what each step moved over them (step telemetry)."""

    def __init__(self, comm: Comm, outs: Mapping[int, BulkLink], ins: Mapping[int, BulkLink],
                 backlog_steps: int, newest: int = -1, *,
                 opened_by: BulkLinks | None = None) -> None:
        self.comm = comm
        self._opened_by = opened_by
        self._loop = asyncio.get_running_loop()
        self._outs, self._ins = outs, ins
        self._backlog = backlog_steps
        self._cond = threading.Condition()
        self._book = PostBook()  # what each incoming slice fills (see .posts)
        self._closed = False
        self._gone: dict[int, PeerLost] = {}  # peer -> why its lane (either way) ended
        self._heard_at: dict[int, float] = {}  # peer -> perf_counter of its last bytes
        self.newest = newest
        # Per peer, the step of every message queued on its lane, oldest first; the lane
        # counts what it sent, in the same order.
        self._queued: dict[int, deque[int]] = {p: deque() for p in outs}
        self._forgotten: dict[int, int] = dict.fromkeys(outs, 0)
        self._skipping: set[int] = set()
        self._sent: dict[int, int] = {}  # step -> bytes queued
        self._got: dict[int, dict[int, list[int]]] = {}  # step -> src -> [bytes, messages]
        self._told: dict[int, int] = {}  # peer -> the step we last told it we are at
        self._removers = [comm.on_early(p, 0, self._heard) for p in ins]
        self._readers = [threading.Thread(target=self._read, args=(src, lane), daemon=True,
                                          name=f"aioreduce-transpose-from-{src}")
                         for src, lane in ins.items()]
        for reader in self._readers:
            reader.start()

    # -- the session's side (event loop) ------------------------------------------------------
    def post(self, src: int, out: np.ndarray, step: int, tag: int) -> asyncio.Future[Header]:
        fut: asyncio.Future[Header] = self._loop.create_future()
        key = (src, step, tag)
        with self._cond:
            gone = self._gone.get(src)
            if gone is not None:
                fut.set_exception(gone)
                return fut
            self._book.post(Post(key, byte_view(out), fut))
            self._cond.notify_all()
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
            if peer not in self._skipping:
                self._skipping.add(peer)
                log.warning("rank %d: rank %d is not reading (%d messages unsent); skipping "
                            "its slices until it drains", self.comm.rank, peer, len(queued))
            return
        if peer in self._skipping:
            self._skipping.discard(peer)
            log.warning("rank %d: rank %d reads again", self.comm.rank, peer)
        head = Header(Kind.DATA, step, tag, self.comm.rank, meta=meta).to_bytes()
        try:
            lane.send(step, tag, byte_view(array), head)
        except PeerLost as exc:
            self._lost(peer, exc)
            return
        queued.append(step)
        self._sent[step] = self._sent.get(step, 0) + array.nbytes

    def _tell(self, peer: int, step: int) -> None:
        """Tell a peer we skip that we are at ``step`` (once a step, in the background)."""
        if self._told.get(peer, -1) >= step:
            return
        self._told[peer] = step
        sending = asyncio.ensure_future(self.comm.send(peer, _NOTHING, step=step, tag=NOTICE_TAG))
        sending.add_done_callback(lambda f: f.cancelled() or f.exception())  # lost: no matter

    def _heard(self, header: Header, _payload: memoryview) -> None:
        if header.step > self.newest:
            with self._cond:
                self.newest = max(self.newest, header.step)

    def discard_before(self, step: int, tag: int = 0) -> None:
        self.comm.discard_before(step, tag)
        with self._cond:
            writing = self._book.discard_before(step, tag)
            # One chunk's copy at most (the read never blocks). While we wait, readers may
            # complete or lose other posts: the book took these out already.
            while any(p.writing for p in writing):
                self._cond.wait()
            self._cond.notify_all()

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
                post = self._claim(src, step, tag)
                if post is None:
                    lane.skip(nbytes)
                elif post.view.nbytes != nbytes:
                    self._finish(post, None, LaneMismatch(
                        src, (step, tag, nbytes), (step, tag, post.view.nbytes)))
                    lane.skip(nbytes)
                elif self._fill(lane, post, nbytes):
                    self._finish(post, header, None, nbytes, lane.latency)
        except PeerLost as exc:
            self._lost(src, exc)
        except Exception as exc:  # a bug: end this lane, say why
            self._lost(src, PeerLost(src, f"lane from rank {src}: {exc!r}"))

    def _claim(self, src: int, step: int, tag: int) -> Post | None:
        """The post this message fills, once there is one; None: drop it (below the floor)."""
        with self._cond:
            self.newest = max(self.newest, step)
            while True:
                if self._closed:
                    raise PeerLost(src, "closed")
                post = self._book.claim(src, step, tag)
                if not isinstance(post, Wait):
                    return post
                self._cond.wait()

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
            if post.future.done():
                return  # withdrawn: the stage ended without it
            if exc is not None:
                post.future.set_exception(exc)
                return
            assert header is not None
            post.future.set_result(header)
            counts = self._got.setdefault(header.step, {}).setdefault(header.src, [0, 0])
            counts[0] += nbytes
            counts[1] += 1

        try:
            if latency > 0:  # emulated one-way latency: it arrives this much later
                self._loop.call_soon_threadsafe(self._loop.call_later, latency, done)
            else:
                self._loop.call_soon_threadsafe(done)
        except RuntimeError:  # the loop is closed: nobody waits for it any more
            pass

    def _lost(self, peer: int, exc: PeerLost) -> None:
        """``peer``'s lane ended: its posts fail now and later ones at once."""
        with self._cond:
            if self._closed:
                return
            self._gone.setdefault(peer, exc)
            posts = self._book.lose(peer)
        for post in posts:
            self._finish(post, None, exc)
