"""The lane links (``schemes/links/lanes.py``) on real socket pairs: a withdrawn
receive is never written again, even when its sender delivers the rest later; a message ahead
of its receive waits for it; one below the floor is dropped and the stream stays in step; a
wrong size is a mismatch; a lane that ends fails its receives naming the peer; an early
message a scheme asks for is handed on at once and kept for its receive, within a budget.

The bytes cross real sockets; only the comm beside them (rank, floor, losses) is a stub, as
these links use it for nothing else.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from aioreduce.errors import LaneMismatch, PeerLost
from aioreduce.schemes.links.lanes import LaneLinks, Withdrawn
from aioreduce.schemes.transpose.layout import NOTICE_TAG
from aioreduce.transport.lane import HEADER, Lane
from aioreduce.wire import Header, Kind

PEER = 1


class _Comm:
    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.told: list[tuple[int, int, int]] = []  # (peer, step, tag) sent over the "mesh"

    def discard_before(self, step: int, tag: int = 0) -> None:
        pass

    def is_lost(self, rank: int) -> bool:
        return False

    def on_early(self, rank: int, min_tag: int, handler: object) -> object:
        return lambda: None

    async def send(self, rank: int, array: np.ndarray, *, step: int, tag: int = 0) -> None:
        self.told.append((rank, step, tag))


def _message(step: int, tag: int, payload: np.ndarray, meta: dict[str, object]) -> bytes:
    head = Header(Kind.DATA, step, tag, PEER, meta=meta).to_bytes()
    return HEADER.pack(step, tag, payload.nbytes, len(head)) + head + payload.tobytes()


async def _wire(**options: Any) -> AsyncIterator[tuple[LaneLinks, socket.socket]]:
    """Links on rank 0 whose lane from rank 1 is fed by the test through ``peer``."""
    ours, peer = socket.socketpair()
    out_ours, out_peer = socket.socketpair()
    links = LaneLinks(_Comm(), {PEER: Lane(out_ours, PEER)},  # type: ignore[arg-type]
                      {PEER: Lane(ours, PEER)}, **options)
    try:
        yield links, peer
    finally:
        await links.close(1.0)
        peer.close()
        out_peer.close()


@pytest.fixture
async def wired() -> AsyncIterator[tuple[LaneLinks, socket.socket]]:
    async for pair in _wire(backlog_steps=8):
        yield pair


async def _until(done: object, timeout: float = 10.0) -> None:
    """Wait (turning the loop) until ``done()`` is true: the reader thread's progress."""
    limit = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert time.monotonic() < limit, "the lane reader did not get there"
        await asyncio.sleep(0.001)


async def test_a_withdrawn_receive_is_never_written_even_when_the_rest_comes(wired) -> None:
    links, peer = wired
    buf = np.full(1 << 16, -1.0)
    fut = links.post(PEER, buf, 0, 0)
    data = np.arange(buf.size, dtype=float)
    wire = _message(0, 0, data, {"i": 0})
    half = len(wire) - data.nbytes // 2  # header, meta and the first half of the payload
    peer.sendall(wire[:half])
    await _until(lambda: buf[buf.size // 2 - 1] == data[buf.size // 2 - 1])
    links.discard_before(1)  # the stage ended: the post is withdrawn
    fut.cancel()
    nxt = np.zeros(4)
    fut2 = links.post(PEER, nxt, 1, 0)
    peer.sendall(wire[half:] + _message(1, 0, np.array([1.0, 2, 3, 4]), {"i": 1}))
    header = await asyncio.wait_for(fut2, 10)
    # The rest of step 0's slice was read and dropped (the stream stayed in step), and
    # none of it reached the withdrawn buffer.
    assert header.meta == {"i": 1} and nxt.tolist() == [1, 2, 3, 4]
    np.testing.assert_array_equal(buf[: buf.size // 2], data[: buf.size // 2])
    assert (buf[buf.size // 2:] == -1).all()


async def test_a_whole_receive_lands_whole_elements_and_says_how_many(wired) -> None:
    """``whole``: a payload cut inside an element leaves that element as it was (its first
    bytes wait in the lane) until the rest of it comes; once withdrawn, ``landed`` says how
    many bytes landed, all whole elements, and the buffer after them is untouched."""
    links, peer = wired
    buf = np.full(64, -1.0)
    fut = links.post(PEER, buf, 0, 0, whole=True)
    data = np.arange(1.0, 65.0)
    wire = _message(0, 0, data, {"i": 0})
    start = len(wire) - data.nbytes  # where the payload begins
    peer.sendall(wire[:start + 3 * 8 + 5])  # three elements and 5 bytes of the fourth
    lane = links._ins[PEER]
    await _until(lambda: buf[2] == 3.0 and lane.buffered == 5)
    peer.sendall(wire[start + 29:start + 30])  # a sixth byte: still not whole
    await _until(lambda: lane.buffered == 6)  # read, and held back
    assert buf[3] == -1.0 and buf[:3].tolist() == [1, 2, 3]
    peer.sendall(wire[start + 30:start + 4 * 8 + 7])  # the fourth whole, 7 of the fifth
    await _until(lambda: buf[3] == 4.0)
    links.discard_before(1)  # the stage ended: the post is withdrawn
    fut.cancel()
    assert links.landed(PEER, 0, 0) == 4 * 8
    assert buf[:4].tolist() == [1, 2, 3, 4] and (buf[4:] == -1).all()
    nxt = np.zeros(2)
    fut2 = links.post(PEER, nxt, 1, 0, whole=True)
    peer.sendall(wire[start + 39:] + _message(1, 0, np.array([5.0, 6.0]), {"i": 1}))
    header = await asyncio.wait_for(fut2, 10)  # the rest of step 0's was dropped
    assert header.meta == {"i": 1} and nxt.tolist() == [5, 6] and (buf[4:] == -1).all()
    links.end_step(1)
    assert links.landed(PEER, 0, 0) == 0  # forgotten once a later step ended


async def test_ahead_waits_for_its_receive_and_below_the_floor_is_dropped(wired) -> None:
    links, peer = wired
    links.discard_before(3)
    stale = np.array([9.0, 9, 9])
    peer.sendall(_message(2, 0, stale, {}) + _message(5, 1, np.array([5.0, 6, 7]), {"x": 1}))
    await _until(lambda: links.newest == 5)  # read up to the step-5 header, waiting there
    early = np.zeros(3)
    got = await asyncio.wait_for(links.post(PEER, early, 5, 1), 10)
    assert got.step == 5 and got.tag == 1 and got.src == PEER and got.meta == {"x": 1}
    assert early.tolist() == [5, 6, 7]


async def test_a_wrong_size_is_a_mismatch_and_a_lane_that_ends_fails_its_receives(
        wired) -> None:
    links, peer = wired
    small = np.zeros(2)
    fut = links.post(PEER, small, 0, 0)
    peer.sendall(_message(0, 0, np.ones(3), {}))
    with pytest.raises(LaneMismatch, match="expected"):
        await asyncio.wait_for(fut, 10)
    assert small.tolist() == [0, 0]
    waiting = links.post(PEER, np.zeros(2), 0, 1)
    peer.close()  # rank 1 is gone
    with pytest.raises(PeerLost) as lost:
        await asyncio.wait_for(waiting, 10)
    assert lost.value.rank == PEER and links.is_lost(PEER)
    with pytest.raises(PeerLost):  # a receive posted later fails at once
        await asyncio.wait_for(links.post(PEER, np.zeros(2), 1, 0), 10)


async def test_an_early_message_is_handed_on_and_kept_for_its_receive() -> None:
    # What a tree rank needs from its parent's lane: a result it has not asked for yet is
    # read at once (within the staging budget), shown to the early handler, and copied into
    # the receive posted later; over the budget a message waits in the lane as any other;
    # the floor drops what is staged below it and frees its share of the budget.
    ours, peer = socket.socketpair()
    out_ours, out_peer = socket.socketpair()
    seen: asyncio.Queue[tuple[int, int, int, list[float]]] = asyncio.Queue()

    def on_early(src: int, header: Header, payload: memoryview) -> None:
        values = np.frombuffer(payload, dtype=header.dtype).tolist()
        seen.put_nowait((src, header.step, header.tag, values))

    links = LaneLinks(_Comm(), {PEER: Lane(out_ours, PEER)},  # type: ignore[arg-type]
                      {PEER: Lane(ours, PEER)}, backlog_steps=8,
                      early=lambda src, step, tag: tag >= 100, on_early=on_early,
                      stage_bytes=64)
    try:
        peer.sendall(_typed(1, 100, np.array([1.0, 2, 3]), {"last": 1}))
        assert await asyncio.wait_for(seen.get(), 10) == (PEER, 1, 100, [1, 2, 3])
        buf = np.zeros(3)
        fut = links.post(PEER, buf, 1, 100)
        assert fut.done() and fut.result().meta == {"last": 1} and buf.tolist() == [1, 2, 3]

        # 72 bytes: over the 64 of the budget, so it waits for its receive.
        big = np.arange(9, dtype=float)
        peer.sendall(_typed(1, 101, big, {}))
        await _until(lambda: links.newest == 1)
        got = np.zeros(9)
        await asyncio.wait_for(links.post(PEER, got, 1, 101), 10)
        assert got.tolist() == big.tolist() and seen.empty()

        peer.sendall(_typed(2, 100, np.arange(8.0), {}))  # 64 bytes: the whole budget
        assert (await asyncio.wait_for(seen.get(), 10))[1] == 2
        links.discard_before(3)  # never asked for: dropped, and its bytes given back
        peer.sendall(_typed(3, 100, np.arange(8.0), {}))
        assert (await asyncio.wait_for(seen.get(), 10))[1] == 3
    finally:
        await links.close(1.0)
        peer.close()
        out_peer.close()


def _typed(step: int, tag: int, payload: np.ndarray, meta: dict[str, object]) -> bytes:
    """A lane message as LaneLinks.send writes it (dtype and shape in its header)."""
    head = Header(Kind.DATA, step, tag, PEER, payload.dtype.str, payload.shape, meta).to_bytes()
    return HEADER.pack(step, tag, payload.nbytes, len(head)) + head + payload.tobytes()


async def test_a_peer_that_does_not_read_is_skipped_after_backlog_steps(caplog) -> None:
    """A stopped peer holds at most ``backlog_steps`` steps of our arrays; once it reads
    again it gets what was queued and then the current step, not the skipped ones."""
    ours, theirs = socket.socketpair()
    in_ours, in_theirs = socket.socketpair()
    out = Lane(ours, PEER)
    comm = _Comm()
    links = LaneLinks(comm, {PEER: out}, {PEER: Lane(in_ours, PEER)},  # type: ignore[arg-type]
                      backlog_steps=2, notice_tag=NOTICE_TAG)
    try:
        big = np.zeros(1 << 18)  # 2 MiB a message: more than a socket pair holds
        for step in range(5):
            links.send(PEER, big, step, 0, {"s": step})
        assert "is not reading" in caplog.text
        await asyncio.sleep(0)  # the notices go out in the background
        # Over the mesh, the skipped peer is told each step we are at (it reads those at once
        # when it runs again, and knows how far behind it is).
        assert comm.told == [(PEER, 2, NOTICE_TAG), (PEER, 3, NOTICE_TAG), (PEER, 4, NOTICE_TAG)]
        peer = Lane(theirs, 0)

        def read_one() -> int:
            step, _tag, nbytes, meta = peer.read_head()
            peer.read_meta(meta)
            peer.skip(nbytes)
            return step

        got = [await asyncio.to_thread(read_one) for _ in range(2)]
        await asyncio.to_thread(out.flush, 10.0)  # both are out of our queue now
        links.send(PEER, big, 5, 0, {"s": 5})
        got.append(await asyncio.to_thread(read_one))
        assert got == [0, 1, 5]  # steps 2-4 were never queued
        assert "reads again" in caplog.text
    finally:
        await links.close(1.0)
        theirs.close()
        in_theirs.close()


# -- in-order receives by the waiting thread (readers=False: the ring's way) -------------------
def _bare(step: int, tag: int, payload: np.ndarray) -> bytes:
    """A message without a wire header (``send(..., bare=True)``): the lane's head only."""
    return HEADER.pack(step, tag, payload.nbytes, 0) + payload.tobytes()


@pytest.fixture
async def inline() -> AsyncIterator[tuple[LaneLinks, socket.socket]]:
    """:func:`wired` without reader threads."""
    async for pair in _wire(backlog_steps=None, readers=False):
        yield pair


async def test_in_order_receives_drop_stale_messages_and_name_a_mismatch(inline) -> None:
    links, peer = inline
    a, b, c = np.arange(4.0), np.arange(400.0), np.arange(3.0)
    # A failed step's leftover (below the floor), then step 1's two messages, one of them
    # described (a wire header), then one of the wrong size, then the next.
    links.discard_before(1)
    peer.sendall(_bare(0, 5, np.ones(1000)) + _bare(1, 0, a) + _message(1, 1, b, {"x": 1})
                 + _bare(1, 2, np.ones(7)) + _bare(1, 3, c))
    got_a, got_b, got_c = np.empty(4), np.empty(400), np.empty(3)
    await asyncio.to_thread(links.recv, PEER, got_a, 1, 0)
    await asyncio.to_thread(links.recv, PEER, got_b, 1, 1)
    with pytest.raises(LaneMismatch) as info:
        await asyncio.to_thread(links.recv, PEER, np.empty(3), 1, 2)
    assert info.value.peer == PEER and info.value.got == (1, 2, 56)
    await asyncio.to_thread(links.recv, PEER, got_c, 1, 3)  # the lane stayed in step
    assert (got_a == a).all() and (got_b == b).all() and (got_c == c).all()
    links.end_step(1)


async def test_a_discard_releases_a_waiting_receive_and_waits_for_a_payload_coming(
        inline) -> None:
    links, peer = inline
    out = np.full(1 << 13, -1.0)  # 64 KB: half of it fits the socket's buffer
    waiting = asyncio.ensure_future(asyncio.to_thread(links.recv, PEER, out, 3, 0))
    await _until(lambda: links._ins[PEER].buffered == 0 and not waiting.done())
    links.discard_before(4)  # nothing was coming: the thread is woken and gives up
    with pytest.raises(Withdrawn):
        await asyncio.wait_for(waiting, 10)
    assert (out == -1).all()
    # A payload under way when the step ends is read to its end before discard_before
    # returns, then the receive gives up; the next message is received as usual.
    data = np.arange(out.size, dtype=float)
    wire = _bare(4, 0, data)
    peer.sendall(wire[: len(wire) // 2])
    reading = asyncio.ensure_future(asyncio.to_thread(links.recv, PEER, out, 4, 0))
    await _until(lambda: links._reading[PEER] == (4, 0))  # the path under test: mid-payload
    discarding = asyncio.ensure_future(asyncio.to_thread(links.discard_before, 5))
    await asyncio.sleep(0)  # (let it start; it cannot return before the rest came)
    assert not discarding.done()
    peer.sendall(wire[len(wire) // 2:] + _bare(5, 0, np.arange(2.0)))
    await asyncio.wait_for(discarding, 10)
    with pytest.raises(Withdrawn):
        await asyncio.wait_for(reading, 10)
    nxt = np.empty(2)
    await asyncio.to_thread(links.recv, PEER, nxt, 5, 0)
    assert nxt.tolist() == [0.0, 1.0]


async def test_an_in_order_receive_from_an_ended_lane_names_the_peer(inline) -> None:
    links, peer = inline
    peer.close()
    with pytest.raises(PeerLost) as info:
        await asyncio.to_thread(links.recv, PEER, np.empty(2), 0, 0)
    assert info.value.rank == PEER and links.is_lost(PEER)


async def test_lanes_added_for_a_replaced_peer_deliver_and_the_old_lane_never_does(
        wired) -> None:
    """A peer's process died with a message ahead of our receives in its lane (the reader
    holds it, waiting for the post); its replacement's lanes are added (``add``): the receive
    posted after that is filled from the new lane, never from the old one's held message, and
    the old lane ending later does not fail the peer."""
    links, old_peer = wired
    stale = np.array([9.0, 9, 9])
    old_peer.sendall(_message(7, 0, stale, {"from": "dead"}))
    await _until(lambda: links.newest == 7)  # read its head; waits for a post of step 7
    ours, new_peer = socket.socketpair()
    out_ours, out_new = socket.socketpair()
    links.add({PEER: Lane(out_ours, PEER)}, {PEER: Lane(ours, PEER)})
    old_peer.close()  # the old lane ends now: too late to matter
    buf = np.zeros(3)
    fut = links.post(PEER, buf, 7, 0)
    new_peer.sendall(_message(7, 0, np.array([1.0, 2, 3]), {"from": "new"}))
    header = await asyncio.wait_for(fut, 10)
    assert header.meta == {"from": "new"} and buf.tolist() == [1, 2, 3]
    assert links.lost(PEER) is None
    assert links.send(PEER, np.array([4.0]), 8, 0, {})  # and the new lane carries ours
    got = out_new.recv(1024)
    assert got.endswith(np.array([4.0]).tobytes())
    # The new lane's reader, ahead of our receives, waits for its post and is woken by it
    # (a post notifies only the readers counted as waiting: the old one left that count).
    new_peer.sendall(_message(8, 0, np.array([5.0, 6, 7]), {}))
    await _until(lambda: links.newest == 8 and links._waiting.get(PEER) == 1)
    later = np.zeros(3)
    await asyncio.wait_for(links.post(PEER, later, 8, 0), 10)
    assert later.tolist() == [5, 6, 7] and not links._waiting
    new_peer.close()
    out_new.close()


def _count_expected(links: LaneLinks) -> list[bool | None]:
    """What each of the in-order receives' one-call reads (``read_expected``) answered."""
    lane = links._ins[PEER]
    answers: list[bool | None] = []
    read = lane.read_expected

    def counted(step: int, index: int, view: memoryview) -> bool | None:
        answers.append(got := read(step, index, view))
        return got

    lane.read_expected = counted  # type: ignore[method-assign]
    return answers


async def test_a_stream_of_large_messages_is_read_a_call_each_and_stays_in_step(
        inline) -> None:
    """After a large message, the next one's head and payload are read in one call, the
    payload straight into the receive's array; a failed step's message, a described one
    and one of another size in the stream are read the general way from what that call read
    (more than the read-ahead buffer holds: it grows for them), and the stream stays in
    step."""
    links, peer = inline
    answers = _count_expected(links)
    big = [np.arange(2000.0) + k for k in range(6)]  # 16 KB each: above the read-ahead
    links.discard_before(1)
    peer.sendall(_bare(1, 0, big[0]) + _bare(1, 1, big[1]) + _bare(0, 9, big[2])
                 + _bare(1, 2, big[3]) + _message(1, 3, big[4], {"x": 1})
                 + _bare(1, 4, np.ones(7)) + _bare(1, 5, big[5]))
    got = [np.empty(2000) for _ in range(6)]
    for index, k in ((0, 0), (1, 1), (2, 3), (3, 4)):
        await asyncio.to_thread(links.recv, PEER, got[k], 1, index)
    with pytest.raises(LaneMismatch) as info:
        await asyncio.to_thread(links.recv, PEER, np.empty(2000), 1, 4)
    assert info.value.got == (1, 4, 56)
    await asyncio.to_thread(links.recv, PEER, got[5], 1, 5)
    for k in (0, 1, 3, 4, 5):
        assert (got[k] == big[k]).all()
    # (1, 1) in one call; (1, 2) after the stale message read from what the call read;
    # the described (1, 3) and the wrong size (1, 4) read the general way.
    assert answers == [True, False, True, False, False]
    assert len(links._ins[PEER]._rbuf) > 8 << 10  # the path under test: the buffer grew
    links.end_step(1)


async def test_a_discard_waits_for_a_streamed_payload_coming(inline) -> None:
    """A payload read in one call with its head (a stream) is read to its end before
    discard_before returns, then the receive gives up; the stream goes on."""
    links, peer = inline
    answers = _count_expected(links)
    first = np.arange(4000.0)
    peer.sendall(_bare(3, 0, first))
    out = np.empty_like(first)
    await asyncio.to_thread(links.recv, PEER, out, 3, 0)
    assert (out == first).all() and links._ins[PEER].streaming
    wire = _bare(4, 0, first + 1)
    peer.sendall(wire[: len(wire) // 2])
    reading = asyncio.ensure_future(asyncio.to_thread(links.recv, PEER, out, 4, 0))
    await _until(lambda: links._reading[PEER] == (4, 0))
    discarding = asyncio.ensure_future(asyncio.to_thread(links.discard_before, 5))
    await asyncio.sleep(0)  # (let it start; it cannot return before the rest came)
    assert not discarding.done()
    peer.sendall(wire[len(wire) // 2:] + _bare(5, 0, first + 2))
    await asyncio.wait_for(discarding, 10)
    with pytest.raises(Withdrawn):
        await asyncio.wait_for(reading, 10)
    await asyncio.to_thread(links.recv, PEER, out, 5, 0)
    assert (out == first + 2).all()
    assert answers == [True, True]  # the path under test: both read with their heads
    lane = links._ins[PEER]
    assert lane.streaming and lane.read_expected(6, 0, memoryview(out).cast("B")) is None


async def test_a_peer_we_cut_is_told_our_step_over_the_mesh_once_a_step() -> None:
    """A lane is read in order: a rank steps behind us learns of our newer steps only from
    the mesh. The transpose tells a sender it cut (see Links.tell), once a step."""
    async for links, _peer in _wire(backlog_steps=8, notice_tag=NOTICE_TAG):
        comm = links.comm
        assert isinstance(comm, _Comm)
        links.tell(PEER, 7)
        links.tell(PEER, 7)  # (stage 1 and an earlier notice of the same step: one frame)
        links.tell(PEER, 9)
        await asyncio.sleep(0)  # the notices go out in the background
        assert comm.told == [(PEER, 7, NOTICE_TAG), (PEER, 9, NOTICE_TAG)]
        # The other side: a notice heard over the mesh says where a peer went on without us.
        assert links.cut_at == -1
        links._heard(Header(Kind.DATA, 12, NOTICE_TAG, PEER), memoryview(b""))
        links._heard(Header(Kind.DATA, 14, 0, PEER), memoryview(b""))  # not a notice
        assert links.cut_at == 12 and links.newest == 14
