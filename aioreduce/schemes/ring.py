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

``lanes=True`` moves the segments off the event loop: each rank opens a blocking TCP lane to
its successor and one from its predecessor (:mod:`aioreduce.transport.lane`, authenticated
with the job's secret) and runs the step's sends and receives on a thread of the session's,
the sends on the lane's own thread. A frame through the event loop costs tens of
microseconds of interpreter time; where ranks share cores that is the step's time (13 ranks
x 8 MiB on 2 cores: see the lane module). Lanes are opened at the first step and again at
the step after a failed one (a failure drops them on every rank, with the abort below);
the step telemetry counts their bytes once per step. Without a mesh (the in-memory network)
the ring runs on the event loop.

The ring waits for every rank: it is the baseline that stragglers hurt. A step that fails on
one rank (a lost neighbour, a vector of another shape) would leave the ranks further round
the ring waiting forever, so the rank that sees the failure tells every rank (an abort frame,
payload-less, on a tag of its own) and they all raise the same error.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import AioreduceError, LaneMismatch, PeerLost, VectorMismatch
from ..topology import ring_neighbours
from ..wire import Header, byte_view, tags
from ..wire.control import StepFailed, decode_failed, failed_meta
from .base import Arrival, BulkLink, BulkLinks, Comm, Result
from .pool import BufferPool

ABORT_TAG = tags.ABORT  # above every data tag of a step
MAX_AHEAD = 4
POSTED_AHEAD = 4 << 20  # bytes of reduce-scatter scratch posted ahead (see _depth)
EMPTY = np.empty(0, np.uint8)
LANE_GRACE_S = 10.0  # how long a closed lane waits for the reason over the mesh


@functools.lru_cache(maxsize=32)
def _segments(length: int, n: int) -> tuple[tuple[int, int], ...]:
    """The ``n`` segments' (start, end) of a vector of ``length`` (a step's vector usually has
    the length of the last one: computed once)."""
    edges = np.linspace(0, length, n + 1).astype(int)
    return tuple((int(edges[i]), int(edges[i + 1])) for i in range(n))


async def _ring(comm: Comm, mine: np.ndarray, acc: np.ndarray, pool: BufferPool, send_to: int,
                recv_from: int, pos: int, step: int, tag: int, divisor: float = 1) -> None:
    """One directional ring: ``acc`` (a view, uninitialised) becomes the sum over the ring of
    ``mine`` (a view of the same size), divided by ``divisor``; this rank is at position
    ``pos``. ``acc`` may be ``mine`` itself (an in-place sum); otherwise ``mine`` is only read.
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
    n = comm.world_size
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


def _lane_ring(out: BulkLink, into: BulkLink, mine: np.ndarray, acc: np.ndarray,
               scratch: np.ndarray, seg: tuple[tuple[int, int], ...], pos: int, step: int,
               divisor: float, arrival: Arrival | None = None) -> tuple[int, int]:
    """:func:`_ring` over lanes, on a worker thread: the same segments (``seg``) in the same
    order, each send queued to ``out``'s thread while this one receives from ``into``. The
    hazards are those of :func:`_ring`: a segment is written only after the send that reads
    it was received further round the ring (every byte this rank receives depends on it), and
    the step returns only once every send is in the kernel (``flush``). Returns the bytes
    sent and received.

    With ``arrival`` (a staged device tensor), a segment of ``mine`` is read only once it has
    landed (the segments land in :func:`read_order`, so the first send waits for 1/N of the
    copy), and each segment of the result is handed back as soon as it is final: this rank's
    own once reduced, the others as the all-gather brings them."""
    n, sent, got = len(seg), 0, 0
    for i in range(n - 1):  # reduce-scatter
        s_lo, s_hi = seg[(pos - i) % n]
        if i == 0 and arrival is not None:
            arrival.landed(s_lo, s_hi)
        view = byte_view((mine if i == 0 else acc)[s_lo:s_hi])
        out.send(step, i, view)
        r_lo, r_hi = seg[(pos - i - 1) % n]
        buf = byte_view(scratch[: r_hi - r_lo])
        into.recv_into(step, i, buf)
        if arrival is not None:
            arrival.landed(r_lo, r_hi)
        np.add(mine[r_lo:r_hi], scratch[: r_hi - r_lo], out=acc[r_lo:r_hi])
        sent, got = sent + view.nbytes, got + buf.nbytes
    lo, hi = seg[(pos + 1) % n]
    if divisor != 1:
        np.divide(acc[lo:hi], divisor, out=acc[lo:hi])
    if arrival is not None:
        arrival.final(lo, hi)
    for i in range(n - 1):  # all-gather
        s_lo, s_hi = seg[(pos + 1 - i) % n]
        view = byte_view(acc[s_lo:s_hi])
        out.send(step, n + i, view)
        r_lo, r_hi = seg[(pos - i) % n]
        buf = byte_view(acc[r_lo:r_hi])
        into.recv_into(step, n + i, buf)
        if arrival is not None:
            arrival.final(r_lo, r_hi)
        sent, got = sent + view.nbytes, got + buf.nbytes
    out.flush()
    return sent, got


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
        self._want_lanes = lanes and not bidirectional and comm.world_size > 1
        self._lanes: tuple[BulkLink, BulkLink] | None = None
        self._links: BulkLinks | None = None  # the comm's, which the lanes came from
        # a failed step's, closed after the abort
        self._dropped: tuple[BulkLink, BulkLink] | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._step = -1
        self._aborted: asyncio.Future[AioreduceError] | None = None
        # Aborts of steps this rank has not begun (it is behind): a few, newest kept.
        self._ahead: dict[int, AioreduceError] = {}
        self._sends: set[asyncio.Task[None]] = set()
        # Results and scratch reused once nobody holds them (fresh memory costs page faults
        # every step, which on a 4-rank 64 MiB ring was as much CPU as the additions): a
        # step's worth spare (a result and a scratch array per direction, and one more).
        self.pool = BufferPool(spare=5)
        self._removers: list[Callable[[], None]] = [
            comm.on_early(peer, ABORT_TAG, functools.partial(self._abort_heard, peer))
            for peer in range(comm.world_size) if peer != comm.rank]

    async def close(self, timeout: float) -> None:
        for remove in self._removers:
            remove()
        self._removers.clear()
        for lanes in (self._lanes, self._dropped):
            if lanes is not None:
                await asyncio.to_thread(_close_lanes, lanes)
        self._lanes = self._dropped = None
        if self._thread is not None:
            self._thread.shutdown(wait=False)
        if self._sends:
            await asyncio.wait(self._sends, timeout=timeout)

    def _abort_heard(self, peer: int, header: Header, _payload: memoryview) -> None:
        if header.tag != ABORT_TAG or header.step < self._step:
            return  # a stale abort: that step is over here
        error = _abort_error(peer, header.meta)
        if header.step > self._step:
            self._ahead.setdefault(header.step, error)
            while len(self._ahead) > MAX_AHEAD:
                del self._ahead[max(self._ahead)]
        elif self._aborted is not None and not self._aborted.done():
            self._aborted.set_result(error)
            if self._lanes is not None:
                # Pass it on to our lane successor before we close our lanes on it: its
                # lane thread will see them end, and it must know why (the abort names the
                # culprit; "lane closed" would name us).
                nxt = ring_neighbours(self.comm.rank, self.comm.world_size)[1]
                if nxt != peer and not self.comm.is_lost(nxt):
                    self._spawn_send(self._send_abort(nxt, header.step, dict(header.meta)))

    def _tell_everyone(self, step: int, exc: BaseException) -> list[asyncio.Task[None]]:
        """Send every other rank this step's failure (in the background, best effort);
        returns the sends."""
        if isinstance(exc, VectorMismatch):
            meta = failed_meta(StepFailed("mismatch", str(exc), tuple(exc.ranks)))
        elif isinstance(exc, PeerLost):
            meta = failed_meta(StepFailed("lost", exc.reason, rank=exc.rank))
        else:
            return []
        return [self._spawn_send(self._send_abort(peer, step, meta))
                for peer in range(self.comm.world_size)
                if peer != self.comm.rank and not self.comm.is_lost(peer)]

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
        return self._lanes is not None

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
        if not self._want_lanes or size < self.comm.world_size:
            return ((0, size),)
        return read_order(size, self.comm.rank, self.comm.world_size)

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
            self._aborted.set_result(early)
        mine = (await own).reshape(-1)
        if comm.world_size > 1:
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
                await self._close_dropped([])
                raise self._aborted.result()
            exc = work.exception()
            if isinstance(exc, VectorMismatch):
                exc = _mismatch(step, exc, comm.rank, mine)
            if exc is not None:
                told: list[asyncio.Task[None]] = []
                if not (self._aborted.done() and exc is self._aborted.result()):
                    told = self._tell_everyone(step, exc)  # (not an abort heard elsewhere)
                await self._close_dropped(told)
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
        return Result(value, step, list(range(comm.world_size)), [], True, 0.0,
                      time.perf_counter() - t0)

    async def _exchange(self, mine: np.ndarray, acc: np.ndarray, step: int, divisor: float,
                        arrival: Arrival | None) -> None:
        comm = self.comm
        n, rank = comm.world_size, comm.rank
        prev, nxt = ring_neighbours(rank, n)
        if self._want_lanes:
            if self._lanes is None:
                self._links = comm.bulk_links()
                if self._links is None:
                    self._want_lanes = False  # no mesh under this comm: the event loop's way
                else:
                    outs, ins = await self._links.open_links([nxt], [prev], step)
                    self._lanes = (outs[nxt], ins[prev])
            if self._lanes is not None:
                await self._lane_exchange(self._lanes, mine, acc, step, divisor, arrival)
                return
        if arrival is not None:  # the event loop's ring reads every segment at once
            await asyncio.to_thread(arrival.landed, 0, mine.size)
        if self.bidirectional and acc.size >= 2 * n:
            half = acc.size // 2
            # Position on the reversed ring (0 -> N-1 -> ... -> 1 -> 0) is -rank mod n.
            await asyncio.gather(
                _ring(comm, mine[:half], acc[:half], self.pool, nxt, prev, rank, step, 0,
                      divisor),
                _ring(comm, mine[half:], acc[half:], self.pool, prev, nxt, (-rank) % n, step,
                      tags.SECOND, divisor))
        else:
            await _ring(comm, mine, acc, self.pool, nxt, prev, rank, step, 0, divisor)

    async def _lane_exchange(self, lanes: tuple[BulkLink, BulkLink], mine: np.ndarray,
                             acc: np.ndarray, step: int, divisor: float,
                             arrival: Arrival | None) -> None:
        """The step on the session's thread over ``lanes``. If it fails here, or is cancelled
        because it failed elsewhere, the lanes are interrupted (which releases the thread),
        the thread is waited for (it must not touch the vectors after the step), and they are
        dropped: the next step opens new ones, on every rank."""
        comm = self.comm
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="aioreduce-ring")
        seg = _segments(acc.size, comm.world_size)
        scratch = self.pool.take(max(hi - lo for lo, hi in seg), acc.dtype)
        job = asyncio.get_running_loop().run_in_executor(
            self._thread, _lane_ring, lanes[0], lanes[1], mine, acc, scratch, seg, comm.rank,
            step, divisor, arrival)
        try:
            sent, got = await asyncio.shield(job)
            assert self._links is not None  # the lanes came from them
            self._links.count_moved(step, sent, ring_neighbours(comm.rank, comm.world_size)[0],
                                    got, 2 * (comm.world_size - 1))
        except BaseException as exc:
            self._lanes = None
            if job.done():
                # Failed here: the lanes stay up until every rank was sent the abort (see
                # _close_dropped), so a neighbour learns why before its lane ends.
                self._dropped = lanes
            else:  # cancelled: the step failed elsewhere; release the thread now
                for lane in lanes:
                    lane.interrupt()
                with contextlib.suppress(BaseException):
                    await job
                await asyncio.to_thread(_close_lanes, lanes)
            if isinstance(exc, PeerLost) and not self.comm.is_lost(exc.rank):
                # A lane closed under us while the peer's mesh connection is up: the peer
                # dropped it because its step failed, and its abort (the error every rank
                # must raise) is on its way over the mesh. Wait for that, or for the peer
                # to be lost after all.
                await self._abort_or_loss(exc.rank)
            if isinstance(exc, PeerLost) and self._aborted is not None and self._aborted.done():
                # Heard meanwhile: the step failed elsewhere first (a neighbour that exited
                # after its own abort closes its lanes and its connections too).
                raise self._aborted.result() from None
            if isinstance(exc, LaneMismatch):
                if exc.got[:2] == exc.want[:2]:  # the right segment, of another size
                    raise VectorMismatch(f"rank {exc.peer} sent a segment of {exc.got[2]} "
                                         f"bytes where {exc.want[2]} were expected",
                                         [exc.peer]) from None
                raise PeerLost(exc.peer, f"lane out of step: {exc}") from None
            raise

    async def _close_dropped(self, told: list[asyncio.Task[None]]) -> None:
        """Close the lanes a failed step left, once the aborts in ``told`` are sent."""
        lanes, self._dropped = self._dropped, None
        if lanes is None:
            return
        if told:
            await asyncio.wait(told, timeout=LANE_GRACE_S)
        await asyncio.to_thread(_close_lanes, lanes)

    async def _abort_or_loss(self, peer: int) -> None:
        """Return once this step's abort is heard, ``peer`` is lost, or LANE_GRACE_S."""
        aborted = self._aborted
        if aborted is None:
            return
        lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def heard(rank: int) -> None:
            if rank == peer and not lost.done():
                lost.set_result(None)

        remove = self.comm.on_peer_lost(heard)
        try:
            waits: set[asyncio.Future[Any]] = {asyncio.shield(aborted), lost}
            await asyncio.wait(waits, timeout=LANE_GRACE_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            remove()


def _close_lanes(lanes: tuple[BulkLink, BulkLink]) -> None:
    for lane in lanes:
        lane.close()


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
    return PeerLost(failed.rank, f"{failed.text} (reported by rank {peer}, its ring neighbour)")
