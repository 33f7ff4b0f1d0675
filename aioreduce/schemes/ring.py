"""Ring-AllReduce: reduce-scatter then all-gather.

The vector is cut into N segments; in N-1 reduce-scatter steps every rank ends with one fully
reduced segment, and in N-1 all-gather steps every segment reaches every rank. Every rank sends
2(N-1)/N of the vector: the bandwidth optimum. All-gather receives land directly in the
result; reduce-scatter receives go to scratch and are added to the rank's own segment straight
into the result, so the rank's vector is never copied. Result and scratch come from a
:class:`~.pool.BufferPool`: memory nobody holds any more is reused. A segment is only modified
after the send that reads it has drained (``send`` returns then), which zero-copy sends require.

Not pipelined within a segment: cutting segments into 1 MiB frames forwarded as they arrive
was measured 1.3-1.6x slower on 4 ranks of one 2-core host (per-frame cost and wake-ups
outweigh the overlap there); on real links the gain would be the add of one segment per step.

``bidirectional=True`` splits the vector in two halves that travel the ring in opposite
directions at once (each rank sends to both neighbours). On full-duplex links it adds no
bandwidth (a unidirectional ring already keeps every host's sending and receiving busy) but
doubles the flows and halves the segments; measured on one 2-core host it was no faster on 4
ranks and 1.3-1.6x slower on 13 (9 MiB: 213 ms against 160 ms), so it is off by default.

``lanes=True`` moves the segments off the event loop: each rank opens a lane to its
successor and one from its predecessor (the comm's bulk links, authenticated with the job's
secret) and runs the step's sends and receives on a thread of the session's, through the
lane links every scheme's lanes go through (:class:`~.links.lanes.LaneLinks`, without reader
threads: the step's thread reads its predecessor's lane itself, in order, and its segments
go bare, without a wire header). A frame through the event loop costs tens of microseconds
of interpreter time; where ranks share cores that is the step's time (13 ranks x 8 MiB on
2 cores: see the lane module). Lanes are opened at the first step and again at the step
after a failed one; the step telemetry counts their bytes. Without a mesh (the in-memory
network) the ring runs on the event loop.

The ring waits for every rank: it is the baseline that stragglers hurt. A step that fails on
one rank (a lost neighbour, a vector of another shape) would leave the ranks further round
the ring waiting forever, so the rank that sees the failure tells every rank (an abort frame,
payload-less, on a tag of its own) and they all raise the same error. The step's work, its
abort and its lanes' part in it end together (:meth:`RingSession._lane_exchange`): an abort
heard withdraws the step's receives, which releases its thread, and a lane that ends while
its peer's connection is up waits for that connection's word (the abort, or the loss), which
comes in order behind everything the peer sent before, so no timer decides what went wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import AioreduceError, LaneClosed, LaneMismatch, PeerLost, VectorMismatch
from ..topology import ring_neighbours
from ..wire import Header, tags
from ..wire.control import StepFailed, decode_failed, failed_meta
from .base import Arrival, Comm, Result
from .links.lanes import LaneLinks
from .pool import BufferPool

ABORT_TAG = tags.ABORT  # above every data tag of a step
MAX_AHEAD = 4
POSTED_AHEAD = 4 << 20  # bytes of reduce-scatter scratch posted ahead (see _depth)
EMPTY = np.empty(0, np.uint8)
# How long a rank whose lane to a live peer did not open waits for that peer's abort (the
# peer gave the step up, for a reason every rank must name alike).
ABORT_WAIT_S = 5.0
_NO_META: dict[str, Any] = {}


@functools.lru_cache(maxsize=32)
def _segments(length: int, n: int) -> tuple[tuple[int, int], ...]:
    """The ``n`` segments' (start, end) of a vector of ``length`` (a step's vector usually has
    the length of the last one: computed once)."""
    edges = np.linspace(0, length, n + 1).astype(int)
    return tuple((int(edges[i]), int(edges[i + 1])) for i in range(n))


async def _ring(comm: Comm, mine: np.ndarray, acc: np.ndarray, pool: BufferPool, send_to: int,
                recv_from: int, pos: int, n: int, step: int, tag: int, divisor: float = 1
                ) -> None:
    """One directional ring: ``acc`` (a view, uninitialised) becomes the sum over the ring of
    ``mine`` (a view of the same size), divided by ``divisor``; this rank is at position
    ``pos`` of a ring of ``n`` ranks. ``acc`` may be ``mine`` itself (an in-place sum);
    otherwise ``mine`` is only read.
    The division costs a pass over 1/N of the vector: each rank divides the segment it
    reduced, before the all-gather spreads it.

    ``acc`` needs no copy of ``mine`` first: the first send reads ``mine``, each reduced
    segment is written as ``mine + received`` straight into ``acc``, and the all-gather
    overwrites the rest. In place, segment ``r`` of ``mine`` is read once, by the add that
    overwrites it; the own segment is sent first and only overwritten by the all-gather.

    Receives are posted before their frames can arrive wherever memory allows, so a frame
    lands in its destination instead of being staged by the inbox (a fresh buffer and a
    copy) or held back in the kernel (a stall): a rank's predecessor is only held back by the
    socket buffers, so it runs sub-steps ahead. Reduce-scatter receives go to ``depth``
    scratch slots posted ahead (see :func:`_depth`); the all-gather receive of segment
    ``pos - i`` is posted as soon as reduce-scatter sub-step ``i`` has sent that segment, the
    last time the reduce-scatter reads it (a segment is only sent after it was received, so
    an early arrival never overwrites what is still to be sent). On 13 ranks of one 2-core
    host with 8 MiB, one frame in five was staged when only the next receive was posted.
    """
    seg = _segments(acc.size, n)
    width = max(hi - lo for lo, hi in seg)
    depth = _depth(n, width * acc.itemsize)
    # The session's pool: the previous step's scratch, unless something still holds it.
    scratch = pool.take(depth * width, acc.dtype)
    slots = [scratch[k * width:(k + 1) * width] for k in range(depth)]
    reduce_recvs: list[asyncio.Future[Header]] = []
    gathered: list[asyncio.Future[Header]] = []

    def post_reduce(i: int) -> None:
        lo, hi = seg[(pos - i - 1) % n]
        reduce_recvs.append(comm.post_recv(recv_from, slots[i % depth][: hi - lo], step=step,
                                           tag=tag + i))

    def post_gather(i: int) -> None:
        lo, hi = seg[(pos - i) % n]
        gathered.append(comm.post_recv(recv_from, acc[lo:hi], step=step, tag=tag + n + i))

    try:
        for i in range(min(depth, n - 1)):
            post_reduce(i)
        for i in range(n - 1):  # reduce-scatter
            s_lo, s_hi = seg[(pos - i) % n]
            r_lo, r_hi = seg[(pos - i - 1) % n]
            src = mine if i == 0 else acc  # segment pos - i was reduced at step i - 1
            # Send, then wait for the receive: it fills meanwhile (posted, so the neighbour's
            # bytes land as they come). Not gather(): a task per send cost more than the rest
            # of a small segment's handling.
            await comm.send(send_to, src[s_lo:s_hi], step=step, tag=tag + i)
            post_gather(i)  # segment pos - i is not read again before the all-gather
            await reduce_recvs[i]
            np.add(mine[r_lo:r_hi], slots[i % depth][: r_hi - r_lo], out=acc[r_lo:r_hi])
            if i + depth < n - 1:
                post_reduce(i + depth)  # into the slot just added
        if divisor != 1:  # this rank's reduced segment, the first the all-gather sends
            lo, hi = seg[(pos + 1) % n]
            np.divide(acc[lo:hi], divisor, out=acc[lo:hi])
        for i in range(n - 1):  # all-gather: every receive is posted by now
            s_lo, s_hi = seg[(pos + 1 - i) % n]
            await comm.send(send_to, acc[s_lo:s_hi], step=step, tag=tag + n + i)
            await gathered[i]
    finally:
        for fut in reduce_recvs + gathered:  # a failed step withdraws what it posted
            if not fut.done():
                fut.cancel()


def _depth(n: int, width_bytes: int) -> int:
    """Reduce-scatter receives posted ahead: as many as ``POSTED_AHEAD`` bytes of scratch
    hold, at least two (one lands while the other is added), at most all ``n - 1``. Deeper
    only pays for segments the inbox would stage (larger ones are held in the kernel, no
    copy), and those are small."""
    return min(n - 1, max(2, POSTED_AHEAD // max(1, width_bytes)))


def _lane_ring(links: LaneLinks, prev: int, nxt: int, mine: np.ndarray, acc: np.ndarray,
               scratch: np.ndarray, seg: tuple[tuple[int, int], ...], pos: int, step: int,
               divisor: float, arrival: Arrival | None = None) -> None:
    """:func:`_ring` over lanes, on a worker thread: the same segments (``seg``) in the same
    order, each send queued to the successor ``nxt`` while this thread receives from the
    predecessor ``prev`` (reading its lane itself, in order: :meth:`LaneLinks.recv`). The
    hazards are those of :func:`_ring`: a segment is written only after the send that reads
    it was received further round the ring (every byte this rank receives depends on it), and
    the step returns only once every send is in the kernel. If the session ends the step
    (it failed elsewhere), the receive in progress raises ``Withdrawn``.

    With ``arrival`` (a staged device tensor), a segment of ``mine`` is read only once it has
    landed (the segments land in :func:`read_order`, so the first send waits for 1/N of the
    copy), and each segment of the result is handed back as soon as it is final: this rank's
    own once reduced, the others as the all-gather brings them."""
    n = len(seg)

    def send(array: np.ndarray, index: int) -> None:
        if not links.send(nxt, array, step, index, _NO_META, bare=True):
            raise links.lost(nxt) or PeerLost(nxt, "lane lost")

    for i in range(n - 1):  # reduce-scatter
        s_lo, s_hi = seg[(pos - i) % n]
        if i == 0 and arrival is not None:
            arrival.landed(s_lo, s_hi)
        send((mine if i == 0 else acc)[s_lo:s_hi], i)
        r_lo, r_hi = seg[(pos - i - 1) % n]
        links.recv(prev, scratch[: r_hi - r_lo], step, i)
        if arrival is not None:
            arrival.landed(r_lo, r_hi)
        np.add(mine[r_lo:r_hi], scratch[: r_hi - r_lo], out=acc[r_lo:r_hi])
    lo, hi = seg[(pos + 1) % n]
    if divisor != 1:
        np.divide(acc[lo:hi], divisor, out=acc[lo:hi])
    if arrival is not None:
        arrival.final(lo, hi)
    for i in range(n - 1):  # all-gather
        s_lo, s_hi = seg[(pos + 1 - i) % n]
        send(acc[s_lo:s_hi], n + i)
        r_lo, r_hi = seg[(pos - i) % n]
        links.recv(prev, acc[r_lo:r_hi], step, n + i)
        if arrival is not None:
            arrival.final(r_lo, r_hi)
    links.wait_sent([nxt])


def read_order(size: int, pos: int, n: int) -> tuple[tuple[int, int], ...]:
    """The segments of a ``size``-element vector in the order a lane ring at position ``pos``
    of ``n`` first reads them: its own (the first send), then each one it adds to."""
    seg = _segments(size, n)
    return tuple(seg[(pos - i) % n] for i in range(n))


@dataclass(frozen=True)
class Ring:
    """Ring-AllReduce (the bandwidth-optimal, straggler-sensitive baseline); see the module
    docstring for ``bidirectional`` and ``lanes`` (on by default)."""

    bidirectional: bool = False
    lanes: bool = True
    coded: bool = field(default=False, init=False)

    def validate(self, world_size: int) -> None:
        pass

    def neighbours(self, rank: int, world_size: int) -> list[int]:
        return sorted(set(ring_neighbours(rank, world_size)) - {rank})

    def open(self, comm: Comm) -> RingSession:
        return RingSession(comm, self.bidirectional, self.lanes)


class RingSession:
    """A ring keeps nothing across steps but the way to hear that a step failed elsewhere."""

    def __init__(self, comm: Comm, bidirectional: bool, lanes: bool) -> None:
        self.comm, self.bidirectional = comm, bidirectional
        # Lanes: wanted (and not refused by the comm), the open pair (to the successor, from
        # the predecessor), and the thread the steps run on.
        self._lanes = lanes and not bidirectional
        self._want_lanes = self._lanes and comm.world_size > 1
        self._links: LaneLinks | None = None  # to the successor and from the predecessor
        self._reopen = False  # a step failed: every rank opens new lanes at the next one
        self._thread: ThreadPoolExecutor | None = None
        self._step = -1
        self._aborted: asyncio.Future[AioreduceError] | None = None
        # Aborts of steps this rank has not begun (it is behind): a few, newest kept; with
        # what they said and who said it, to pass them on (see _adopt).
        self._ahead: dict[int, tuple[AioreduceError, dict[str, object], int]] = {}
        self._sends: set[asyncio.Task[None]] = set()
        # Results and scratch reused once nobody holds them (fresh memory costs page faults
        # every step, which on a 4-rank 64 MiB ring was as much CPU as the additions): a
        # step's worth spare (a result and a scratch array per direction, and one more).
        self.pool = BufferPool(spare=5)
        self._removers: list[Callable[[], None]] = [
            comm.on_early(peer, ABORT_TAG, functools.partial(self._abort_heard, peer))
            for peer in range(comm.world_size) if peer != comm.rank]
        # The ranks the ring runs over, in ring order: every rank, until a lost one that was
        # not replaced in time is left out (see reform and aioreduce.heal).
        self.members: tuple[int, ...] = tuple(range(comm.world_size))
        self._left_out: list[int] = []  # the others

    def reform(self, members: Sequence[int], *, joined: bool = False) -> None:
        """See :class:`~.base.Reforms`: the steps from the next one run over ``members``
        (this rank among them), on new lanes (a ring opens them at every change, and a
        replacement's at its first step, ``joined`` or not)."""
        if self.comm.rank not in members:
            raise ValueError(f"rank {self.comm.rank}: a ring re-formed without this rank")
        self.members = tuple(sorted(set(members)))
        self._left_out = [r for r in range(self.comm.world_size) if r not in self.members]
        self._want_lanes = self._lanes and len(self.members) > 1
        self._reopen = True

    def _place(self) -> tuple[int, int, int, int]:
        """This rank's position in the ring, the ring's size, its predecessor and successor."""
        members = self.members
        n = len(members)
        pos = members.index(self.comm.rank)
        return pos, n, members[(pos - 1) % n], members[(pos + 1) % n]

    async def close(self, timeout: float) -> None:
        for remove in self._removers:
            remove()
        self._removers.clear()
        if self._links is not None:
            await self._links.close(timeout)
            self._links = None
        if self._thread is not None:
            self._thread.shutdown(wait=False)
        if self._sends:
            await asyncio.wait(self._sends, timeout=timeout)

    def _abort_heard(self, peer: int, header: Header, _payload: memoryview) -> None:
        if header.tag != ABORT_TAG or header.step < self._step:
            return  # a stale abort: that step is over here
        error = (_abort_error(peer, header.meta), dict(header.meta), peer)
        if header.step > self._step:
            self._ahead.setdefault(header.step, error)
            while len(self._ahead) > MAX_AHEAD:
                del self._ahead[max(self._ahead)]
        elif self._aborted is not None and not self._aborted.done():
            self._adopt(header.step, *error)

    def _adopt(self, step: int, error: AioreduceError, meta: dict[str, object],
               heard_from: int) -> None:
        """This step failed elsewhere (``error``, told by ``heard_from``): raise it here, and
        pass it on to every other rank first. A rank that raises it may exit, and a rank
        that has not heard it yet would see that exit as the step's failure, naming the
        wrong rank; passed on, the abort reaches it over the exiting rank's connection ahead
        of that connection's end."""
        assert self._aborted is not None
        self._aborted.set_result(error)
        for peer in range(self.comm.world_size):
            if peer not in (self.comm.rank, heard_from) and not self.comm.is_lost(peer):
                self._spawn_send(self._send_abort(peer, step, meta))

    def _tell_everyone(self, step: int, exc: BaseException) -> None:
        """Send every other rank this step's failure (in the background, best effort)."""
        if isinstance(exc, VectorMismatch):
            meta = failed_meta(StepFailed("mismatch", str(exc), tuple(exc.ranks)))
        elif isinstance(exc, PeerLost):
            meta = failed_meta(StepFailed("lost", exc.reason, rank=exc.rank))
        else:
            return
        for peer in range(self.comm.world_size):
            if peer != self.comm.rank and not self.comm.is_lost(peer):
                self._spawn_send(self._send_abort(peer, step, meta))

    def tell_failed(self, step: int, error: BaseException) -> None:
        """See :class:`~.base.TellsFailure`: the abort this rank would send had it run
        ``step`` and seen ``error``; a peer in that step raises it, one not there yet raises
        it when it gets there."""
        self._tell_everyone(step, error)

    def _spawn_send(self, send: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(send)
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
        return task

    async def _send_abort(self, peer: int, step: int, meta: dict[str, object]) -> None:
        with contextlib.suppress(Exception):  # a peer that is gone cannot be told
            await self.comm.send(peer, EMPTY, step=step, tag=ABORT_TAG, meta=meta)

    @property
    def lanes_open(self) -> bool:
        """Whether the steps run over lanes (opened by the first step and after a failed one)."""
        return self._links is not None

    def known(self, step: int) -> bool:
        return False  # a ring's result needs everyone's vector

    async def step(self, step: int, like: np.ndarray, own: Awaitable[np.ndarray]) -> Result:
        return await self._run_step(step, like, own, None, 1, None)

    async def step_into(self, step: int, like: np.ndarray, own: Awaitable[np.ndarray],
                        into: np.ndarray, divisor: float, arrival: Arrival | None = None
                        ) -> Result:
        """The step's sum divided by ``divisor`` written into ``into`` (see
        :class:`~.base.SumsInPlace`); ``into`` may be the vector itself."""
        return await self._run_step(step, like, own, into, divisor, arrival)

    def read_order(self, size: int) -> tuple[tuple[int, int], ...]:
        """See :class:`~.base.ReadsInOrder`: segment by segment over lanes, else at once."""
        pos, n, _prev, _nxt = self._place()
        if not self._want_lanes or size < n:
            return ((0, size),)
        return read_order(size, pos, n)

    async def _run_step(self, step: int, like: np.ndarray, own: Awaitable[np.ndarray],
                        into: np.ndarray | None, divisor: float, arrival: Arrival | None
                        ) -> Result:
        comm = self.comm
        t0 = time.perf_counter()
        comm.discard_before(step)
        self._step = step
        self._aborted = asyncio.get_running_loop().create_future()
        early = self._ahead.pop(step, None)
        self._ahead = {s: e for s, e in self._ahead.items() if s > step}
        if early is not None:
            self._adopt(step, *early)
        mine = (await own).reshape(-1)
        if len(self.members) > 1:
            acc = (self.pool.take(mine.size, mine.dtype) if into is None
                   else into.reshape(-1))
            work = asyncio.ensure_future(self._exchange(mine, acc, step, divisor, arrival))
            waits: set[asyncio.Future[Any]] = {work, self._aborted}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not work.done():
                    work.cancel()
            if not work.done() or work.cancelled():
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                self._failed(step)
                raise self._aborted.result()
            exc = work.exception()
            if isinstance(exc, PeerLost) and self._aborted.done():
                # The step failed elsewhere first: a rank that raised it and exited is seen
                # lost here (its abort came ahead of that, over the same connection).
                exc = self._aborted.result()
            if isinstance(exc, VectorMismatch):
                exc = _mismatch(step, exc, comm.rank, mine)
            if exc is not None:
                if not (self._aborted.done() and exc is self._aborted.result()):
                    self._tell_everyone(step, exc)  # (not an abort heard elsewhere)
                self._failed(step)
                raise exc
        elif into is not None:
            acc = into.reshape(-1)
            if arrival is not None:
                await asyncio.to_thread(arrival.landed, 0, mine.size)
            np.divide(mine, divisor, out=acc)
        else:
            acc = mine.copy()
        comm.discard_before(step + 1)
        value = acc.reshape(like.shape)
        if into is None:  # ours, and reused by the pool: the caller must not write to it
            value.setflags(write=False)
        return Result(value, step, list(self.members), list(self._left_out), True, 0.0,
                      time.perf_counter() - t0)

    async def _exchange(self, mine: np.ndarray, acc: np.ndarray, step: int, divisor: float,
                        arrival: Arrival | None) -> None:
        comm = self.comm
        rank, n, prev, nxt = self._place()  # (rank: the position in the ring)
        if self._want_lanes:
            if self._reopen and self._links is not None:
                await self._links.close(0.0)  # (what a failed step left in them is stale)
                self._links = None
            self._reopen = False
            if self._links is None:
                bulk = comm.bulk_links()
                if bulk is None:
                    self._want_lanes = False  # no mesh under this comm: the event loop's way
                else:
                    try:
                        outs, ins = await bulk.open_links([nxt], [prev], step)
                    except PeerLost as exc:
                        if not comm.is_lost(exc.rank):  # it gave up the step: hear why
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(self._abort_or_loss(exc.rank),
                                                       ABORT_WAIT_S)
                        raise
                    # The step's thread reads its lane itself (readers=False): a reader
                    # thread handing each segment over cost a 13-rank 40 KB ring three
                    # times its CPU on 2 cores.
                    self._links = LaneLinks(comm, outs, ins, None, opened_by=bulk,
                                            hear_comm=False, readers=False)
            if self._links is not None:
                await self._lane_exchange(self._links, mine, acc, step, divisor, arrival)
                return
        if arrival is not None:  # the event loop's ring reads every segment at once
            await asyncio.to_thread(arrival.landed, 0, mine.size)
        if self.bidirectional and acc.size >= 2 * n:
            half = acc.size // 2
            # Position on the reversed ring (0 -> N-1 -> ... -> 1 -> 0) is -rank mod n.
            await asyncio.gather(
                _ring(comm, mine[:half], acc[:half], self.pool, nxt, prev, rank, n, step, 0,
                      divisor),
                _ring(comm, mine[half:], acc[half:], self.pool, prev, nxt, (-rank) % n, n,
                      step, tags.SECOND, divisor))
        else:
            await _ring(comm, mine, acc, self.pool, nxt, prev, rank, n, step, 0, divisor)

    async def _lane_exchange(self, links: LaneLinks, mine: np.ndarray, acc: np.ndarray,
                             step: int, divisor: float, arrival: Arrival | None) -> None:
        """The step on the session's thread over ``links``, in one scope: whatever ends it
        (done, failed here, or cancelled because it failed elsewhere), the thread has let go
        of the vectors when this returns. Cancelled, the step's receives are withdrawn, which
        releases the thread at its next wait."""
        comm = self.comm
        rank, n, prev, nxt = self._place()  # (rank: the position in the ring)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="aioreduce-ring")
        seg = _segments(acc.size, n)
        width = max(hi - lo for lo, hi in seg)
        scratch = self.pool.take(width, acc.dtype)
        job = asyncio.get_running_loop().run_in_executor(
            self._thread, _lane_ring, links, prev, nxt, mine, acc, scratch, seg, rank, step,
            divisor, arrival)
        try:
            await asyncio.shield(job)
        except BaseException as exc:
            if not job.done():  # cancelled: the step failed elsewhere
                links.discard_before(step + 1)
                with contextlib.suppress(BaseException):
                    await job
                raise
            if isinstance(exc, LaneClosed) and not comm.is_lost(exc.rank):
                # A lane ended while the peer's connection is up: the peer is closing, or
                # it opens new lanes after a step that failed there, and its abort (the
                # error every rank must raise) comes over that connection before it closes.
                # Wait for either: both come over the one connection, in order. (Anything
                # else on a lane, such as a message out of order, fails the step at once.)
                await self._abort_or_loss(exc.rank)
                if self._aborted is not None and self._aborted.done():
                    raise self._aborted.result() from None
            if isinstance(exc, LaneClosed):  # the peer is lost: the error every rank raises
                raise PeerLost(exc.rank, exc.reason) from None
            if isinstance(exc, LaneMismatch):
                if exc.got[:2] == exc.want[:2]:  # the right segment, of another size
                    raise VectorMismatch(f"rank {exc.peer} sent a segment of {exc.got[2]} "
                                         f"bytes where {exc.want[2]} were expected",
                                         [exc.peer]) from None
                raise PeerLost(exc.peer, f"lane out of step: {exc}") from None
            raise
        finally:
            links.end_step(step)

    def _failed(self, step: int) -> None:
        """A step failed on this rank: its messages still on the way are stale, and every
        rank opens new lanes at the next step (a lane may have ended with it)."""
        if self._links is not None:
            self._links.discard_before(step + 1)
            self._reopen = True

    async def _abort_or_loss(self, peer: int) -> None:
        """Return once this step's abort is heard or ``peer`` is lost."""
        aborted = self._aborted
        if aborted is None:
            return
        lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def heard(rank: int) -> None:
            if rank == peer and not lost.done():
                lost.set_result(None)

        remove = self.comm.on_peer_lost(heard)
        try:
            if not self.comm.is_lost(peer):
                waits: set[asyncio.Future[Any]] = {asyncio.shield(aborted), lost}
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            remove()


def _mismatch(step: int, exc: VectorMismatch, me: int, mine: np.ndarray) -> VectorMismatch:
    """The message every rank raises: which two ranks' vectors differ, and how."""
    other = exc.ranks[0] if exc.ranks else -1
    return VectorMismatch(f"step {step}: rank {other}'s vector differs from rank {me}'s "
                          f"({mine.size} {mine.dtype}); every rank must pass the same shape and "
                          f"dtype ({exc})", sorted([other, me]))


def _abort_error(peer: int, meta: dict[str, object]) -> AioreduceError:
    """The error a rank raises when ``peer`` says the step failed there."""
    failed = decode_failed(meta, peer)
    if failed.kind == "mismatch":
        return VectorMismatch(failed.text, list(failed.ranks))
    assert failed.rank is not None
    return PeerLost(failed.rank, f"{failed.text} (reported by rank {peer})")
