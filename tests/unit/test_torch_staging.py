"""The torch backend's pure pieces, without sockets or a GPU: the host staging pool (reuse,
bound, ordering by events), point-to-point numbering and the inbox's rule for it, and the
owners' reductions (16-bit floats accumulated in float32, rounded once) on the in-memory
network."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping

import numpy as np
import pytest

from aioreduce.schemes.exchange import exchange
from aioreduce.schemes.p2p import PointToPoint
from aioreduce.transport.inbox import Inbox
from aioreduce.transport.memory import MemoryComm, MemoryNetwork
from aioreduce.wire import P2P_TAG, Header, Kind
from aioreduce.wire.decoder import Frame

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from aioreduce.tensors import narrow, widen, wire_view  # noqa: E402
from aioreduce.torch import direct  # noqa: E402
from aioreduce.torch.staging import ALIGN, HostPool, Piece, Staged, Stager  # noqa: E402


class FakeEvent:
    """A copy on a side stream: done once the test says so; synchronize() waits for that."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waited = 0

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.waited += 1
        assert self.done.wait(10)


def _pool(limit: int) -> tuple[HostPool, list[int]]:
    sizes: list[int] = []

    def alloc(n: int) -> torch.Tensor:
        sizes.append(n)
        return torch.empty(n, dtype=torch.uint8)

    return HostPool(alloc, limit), sizes


def test_buffers_are_reused_across_steps_once_warm() -> None:
    pool, sizes = _pool(8 * ALIGN)
    for _step in range(5):  # two buckets a step, as DDP issues them
        a, b = pool.take(3 * ALIGN - 5), pool.take(ALIGN)
        assert a is not b and a.capacity == 3 * ALIGN and b.capacity == ALIGN
        pool.give(a)
        pool.give(b)
    assert sizes == [3 * ALIGN, ALIGN]  # allocated in the first step only
    assert pool.stats.allocated == 2 and pool.stats.reused == 8


def test_a_buffer_is_not_handed_out_before_the_copy_that_reads_it_is_done() -> None:
    pool, _ = _pool(ALIGN)
    block = pool.take(100)
    copy_back = FakeEvent()
    pool.give(block, copy_back)  # returned while its copy back to the GPU still reads it
    got: list[object] = []
    taker = threading.Thread(target=lambda: got.append(pool.take(100)))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive() and not got  # waits on the copy, bounded by the bound
    copy_back.done.set()
    taker.join(10)
    assert got == [block] and copy_back.waited == 1 and pool.stats.waits == 1


def test_the_pool_is_bounded_and_grows_to_the_largest_bucket() -> None:
    pool, sizes = _pool(2 * ALIGN)
    small = pool.take(ALIGN)
    pool.give(small)
    big = pool.take(5 * ALIGN)  # larger than the bound: the bound follows, the small goes
    assert pool.limit == 5 * ALIGN and pool.stats.dropped == 1 and small not in pool.blocks
    assert pool.stats.held_bytes == 5 * ALIGN
    released = threading.Event()
    got: list[object] = []

    def second() -> None:
        got.append(pool.take(ALIGN))  # no room beside the big one: waits for it
        released.set()

    taker = threading.Thread(target=second)
    taker.start()
    assert not released.wait(0.2)
    pool.give(big)
    assert released.wait(10) and got == [big]  # reused, not a new allocation
    assert sizes == [ALIGN, 5 * ALIGN]


class LandsWhenWaited(FakeEvent):
    """A copy in flight that completes as soon as somebody waits for it."""

    def synchronize(self) -> None:
        self.done.set()
        super().synchronize()


def _staged_in_pieces(values: torch.Tensor, bounds: list[tuple[int, int]]
                      ) -> tuple[Staged, list[LandsWhenWaited]]:
    """A tensor staged as a device tensor is, without a device: a host block (the pinned
    buffer), pieces whose copies land when their events are set, no side stream."""
    pool, _sizes = _pool(1 << 20)
    block = pool.take(values.numel() * values.element_size())
    host = block.data[:values.numel() * 4].numpy().view(np.float32)
    events = [LandsWhenWaited() for _ in bounds]
    pieces = tuple(Piece(lo, hi, ev) for (lo, hi), ev in zip(bounds, events, strict=True))
    return Staged(values, host, events[-1], None, block, pool, pieces=pieces), events


def test_a_piece_is_waited_for_only_by_those_who_read_it() -> None:
    staged, events = _staged_in_pieces(torch.zeros(10), [(5, 10), (0, 5)])
    events[0].done.set()  # the first piece issued has landed, the second not yet
    staged.landed(6, 9)
    assert [e.waited for e in events] == [0, 0]  # landed already: not even synchronized
    staged.landed(4, 6)  # spans both: waits for the one still in flight
    assert [e.waited for e in events] == [0, 1]


def test_final_pieces_are_copied_back_once_and_the_whole_copy_is_then_skipped() -> None:
    target = torch.zeros(10)
    staged, _events = _staged_in_pieces(target, [(0, 10)])
    staged.host[:] = np.arange(10)
    staged.final(0, 4)
    assert target.tolist() == [0, 1, 2, 3] + [0] * 6  # that piece, now
    staged.host[:] = -1  # anything written here after the last final() is not copied again
    staged.final(4, 10)
    staged.write_back()
    assert target.tolist() == [0, 1, 2, 3, -1, -1, -1, -1, -1, -1]
    partial, _ = _staged_in_pieces(torch.zeros(4), [(0, 4)])
    partial.host[:] = 7
    partial.final(0, 1)  # a step that failed half way: the whole (partial) result is copied
    partial.write_back()
    assert partial.tensor.tolist() == [7, 7, 7, 7]


def test_cpu_tensors_are_staged_as_their_own_memory_and_bf16_as_its_bits() -> None:
    stager = Stager()
    t = torch.arange(6.0).reshape(2, 3)
    st = stager.stage(t)
    st.host[0] = 42.0
    assert t[0, 0] == 42.0 and st.block is None  # no copy, no pool
    strided = torch.zeros(4, 2)[:, 0]
    st = stager.stage(strided)
    st.host[:] = 7.0
    st.write_back()
    assert strided.tolist() == [7.0] * 4
    half = torch.tensor([1.0, -2.5], dtype=torch.bfloat16)
    bits = stager.stage(half).host
    assert bits.dtype == np.uint16 and widen(bits, torch.bfloat16).tolist() == [1.0, -2.5]


def test_bf16_is_widened_exactly_and_rounded_to_nearest_even_once() -> None:
    values = torch.randn(1000).to(torch.bfloat16)
    wire = wire_view(values)
    np.testing.assert_array_equal(widen(wire, torch.bfloat16), values.float().numpy())
    acc = np.array([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8], np.float32)  # two ties
    out = np.empty(2, np.uint16)
    narrow(acc, torch.bfloat16, out)
    assert widen(out, torch.bfloat16).tolist() == [1.0, 1.0 + 2.0 ** -6]  # to even


def test_point_to_point_keys_count_per_peer_and_tag_in_order() -> None:
    net = MemoryNetwork(3)
    p2p = PointToPoint(net.comms[0])
    assert [p2p.send_key(1), p2p.send_key(1, 5), p2p.send_key(1), p2p.send_key(2)] == [
        (0, P2P_TAG), (0, P2P_TAG + 5), (1, P2P_TAG), (0, P2P_TAG)]
    assert p2p.recv_key(1) == (0, P2P_TAG)  # the other direction counts apart
    with pytest.raises(ValueError, match="rank 0: point-to-point peer 0 is not another"):
        p2p.send_key(0)
    with pytest.raises(ValueError, match="rank 0: point-to-point tag -1 is outside"):
        p2p.recv_key(1, -1)


async def test_a_point_to_point_frame_is_never_stale_and_never_too_far_ahead() -> None:
    inbox = Inbox(5, stage_limit=1 << 20)
    inbox.set_floor(10**6)  # collectives are far along; this pair's first message is seq 0
    header = Header(Kind.DATA, 0, P2P_TAG + 3, 5, "|u1", (4,))
    buf = inbox.choose(object(), header)
    assert isinstance(buf, memoryview)
    buf[:] = b"abcd"
    inbox.delivered(object(), Frame(header, buf))
    inbox.set_floor(10**7)  # a later collective's floor leaves it staged
    far = Header(Kind.DATA, 10**9, P2P_TAG, 5)  # a sequence number is not a step
    inbox.delivered(object(), Frame(far, memoryview(b"")))
    out = np.zeros(4, np.uint8)
    fut = inbox.post((0, P2P_TAG + 3), memoryview(out), "|u1")
    assert fut.done() and bytes(out) == b"abcd"


class _Rank:
    """An in-memory comm with a step count: what the owners' reductions run over."""

    def __init__(self, comm: MemoryComm) -> None:
        self.comm, self.step = comm, 0

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    async def exchange(self, sends: Mapping[int, np.ndarray],
                       recvs: Mapping[int, np.ndarray], *, bulk: bool = False,
                       each: Callable[[int], None] | None = None) -> None:
        self.step += 1
        await exchange(self.comm, self.step, sends, recvs, each=each)


class _ArrivesLate:
    """A comm whose receives complete only when the test says (in any order it likes)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.world_size = rank, 4
        self.posts: dict[int, asyncio.Future[Header]] = {}

    def discard_before(self, step: int, tag: int = 0) -> None:
        pass

    async def send(self, rank: int, array: np.ndarray, *, step: int, tag: int = 0,
                   meta: object = None) -> None:
        pass

    def post_recv(self, rank: int, out: np.ndarray, *, step: int,
                  tag: int = 0) -> asyncio.Future[Header]:
        self.posts[rank] = asyncio.get_running_loop().create_future()
        return self.posts[rank]


async def test_each_part_is_handed_on_in_rank_order_once_it_and_every_lower_one_is_in() -> None:
    comm = _ArrivesLate(rank=1)
    recvs = {r: np.zeros(2) for r in (0, 2, 3)}
    seen: list[int] = []
    task = asyncio.ensure_future(exchange(comm, 5, {r: np.ones(2) for r in recvs}, recvs,
                                          each=seen.append))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    for r in (3, 2):  # they arrive last first: nothing can be handed on before rank 0's
        comm.posts[r].set_result(Header(Kind.DATA, 5, 0, r))
        for _ in range(3):  # loop turns, not time: the exchange may look at what came
            await asyncio.sleep(0)
        assert seen == []
    comm.posts[0].set_result(Header(Kind.DATA, 5, 0, 0))
    await task
    assert seen == [0, 2, 3]


async def test_a_failed_part_withdraws_the_rest_and_hands_on_none_after_it() -> None:
    comm = _ArrivesLate(rank=1)
    recvs = {r: np.zeros(2) for r in (0, 2, 3)}
    seen: list[int] = []
    task = asyncio.ensure_future(exchange(comm, 5, {}, recvs, each=seen.append))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    comm.posts[0].set_result(Header(Kind.DATA, 5, 0, 0))
    comm.posts[2].set_exception(ConnectionError("rank 2 is gone"))
    with pytest.raises(ConnectionError):
        await task
    assert seen == [0] and comm.posts[3].cancelled()


class _Backs:
    """An :class:`~aioreduce.schemes.base.Arrival` that records what is copied back."""

    def __init__(self) -> None:
        self.finals: list[tuple[int, int]] = []

    def landed(self, lo: int, hi: int) -> None:
        pass

    def final(self, lo: int, hi: int) -> None:
        self.finals.append((lo, hi))


async def test_owners_copy_back_their_part_first_then_each_other_as_it_comes() -> None:
    world, length = 4, 10  # parts of 3, 3, 2, 2
    net = MemoryNetwork(world)
    backs = [_Backs() for _ in range(world)]
    wires = [wire_view(torch.full((length,), float(r), dtype=torch.bfloat16))
             for r in range(world)]
    await asyncio.gather(*(direct.allreduce(_Rank(net.comms[r]), wires[r], torch.bfloat16,
                                            dist.ReduceOp.SUM, backs[r])
                           for r in range(world)))
    edges = [(0, 3), (3, 6), (6, 8), (8, 10)]
    for r in range(world):
        assert backs[r].finals == [edges[r]] + [e for i, e in enumerate(edges) if i != r]
        np.testing.assert_array_equal(wires[r], wire_view(torch.full((length,), 6.0,
                                                                     dtype=torch.bfloat16)))


@pytest.mark.parametrize("length", [1, 5, 4099])
async def test_owners_reduce_bf16_in_float32_and_round_once(length: int) -> None:
    world = 4
    net = MemoryNetwork(world)
    gen = torch.Generator().manual_seed(length)
    values = [torch.randn(length, generator=gen).to(torch.bfloat16) for _ in range(world)]
    wires = [wire_view(v.clone()) for v in values]
    await asyncio.gather(*(direct.allreduce(_Rank(net.comms[r]), wires[r], torch.bfloat16,
                                            dist.ReduceOp.SUM) for r in range(world)))
    exact = torch.stack([v.float() for v in values]).sum(0).to(torch.bfloat16)
    for r in range(world):  # the float32 sum, rounded once, the same on every rank
        np.testing.assert_array_equal(wires[r], wire_view(exact))


async def test_owners_reduce_min_max_avg_and_integers_exactly() -> None:
    world = 3
    for op, dtype, want in [(dist.ReduceOp.MAX, torch.float16, [2.0, 4.0]),
                            (dist.ReduceOp.MIN, torch.int64, [0, 0]),
                            (dist.ReduceOp.AVG, torch.float32, [1.0, 2.0]),
                            (dist.ReduceOp.PRODUCT, torch.int32, [0, 0])]:
        net = MemoryNetwork(world)
        wires = [wire_view(torch.tensor([float(r), 2.0 * r], dtype=dtype))
                 for r in range(world)]
        await asyncio.gather(*(direct.allreduce(_Rank(net.comms[r]), wires[r], dtype, op)
                               for r in range(world)))
        for w in wires:
            assert w.tolist() == want, op


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_a_cuda_tensor_is_copied_in_pieces_and_back_piece_by_piece() -> None:
    """The real copies: pieces issued in the order asked, each landed by its own event; the
    result's pieces copied back on the side stream, ordered before the caller's stream once
    it waits for the side stream (what the completing future does)."""
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    order = [(3 << 18, 1 << 20), (0, 1 << 18), (1 << 18, 3 << 18)]
    staged = Stager().stage(t, order=order)
    assert [(p.lo, p.hi) for p in staged.pieces] == order
    for lo, hi in order:
        staged.landed(lo, hi)
        np.testing.assert_array_equal(staged.host[lo:hi], np.arange(lo, hi, dtype=np.float32))
    staged.host *= -1
    for lo, hi in order:
        staged.final(lo, hi)
    staged.write_back()  # all of it went back already: nothing more is queued
    torch.cuda.current_stream().wait_stream(staged.stream)
    staged.release()
    assert torch.equal(t.cpu(), -torch.arange(1 << 20, dtype=torch.float32))
