"""Scheme sessions on the in-memory network: exact sums, decoding from each sufficient set,
every failover transition, stale frames, FellBehind, and switching schemes.

One process, no sockets, deadlines of a few hundredths of a second: scheme logic only (the
network claims are proven by the loopback and cluster tests).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import pytest

import aioreduce as ar
from aioreduce.codes import cyclic_mds, frc, gaussian_mds
from aioreduce.schemes import FellBehind, StragglerError
from aioreduce.schemes.base import Comm, CommWrapper, SumsInPlace
from aioreduce.schemes.reduce import Link, ReduceSession
from aioreduce.schemes.reduce.family import DOWN, REQUEST_TAG
from aioreduce.transport.memory import MemoryNetwork
from aioreduce.wire import Header, tags

from . import clockloop
from .clockloop import ClockLoop, until
from .memjob import DIM, Job

D = 0.25  # deadline (seconds): long enough that a busy machine does not make a rank late
TREE = dict(fanout=3, levels=2, stragglers=1, deadline=D)
KIDS = {1: (4, 5, 6), 2: (7, 8, 9), 3: (10, 11, 12)}


def fo(job: Job, rank: int) -> Link:
    session = job.sessions[rank]
    assert isinstance(session, ReduceSession) and session.failover is not None
    return session.failover.state


# Nothing is held back here, so no deadline should fire: a long one keeps a busy machine (the
# loop starved for a moment) from making a rank late.
NO_WAIT = 30.0


@pytest.mark.parametrize("scheme, world", [
    (ar.CodedTree(**{**TREE, "deadline": NO_WAIT}), 13),
    (ar.GradientCoding(cyclic_mds(4, 1), deadline=NO_WAIT), 5),
    (ar.GradientCoding(gaussian_mds(6, 1, 2), deadline=NO_WAIT), 7),
    (ar.Tree(2, deadline=NO_WAIT), 7),
    (ar.Star(deadline=NO_WAIT), 4),
    (ar.Ring(), 5),
], ids=["coded-tree", "gc-cyclic", "gc-gaussian-m2", "tree", "star", "ring"])
async def test_every_rank_gets_the_exact_sum(scheme: ar.Scheme, world: int) -> None:
    job = Job(scheme, world)
    for step in range(3):
        job.assert_exact(step, await job.run(step))
    await job.close()


async def test_master_decodes_from_each_sufficient_set() -> None:
    job = Job(ar.GradientCoding(cyclic_mds(4, 1), deadline=D), 5)
    for step, missing in enumerate([None, 1, 2, 3, 4]):
        if missing is not None:
            job.net.hold(missing, 0)  # its message arrives only after the step
        res = await job.run(step)
        job.assert_exact(step, res)
        if missing is not None:
            assert missing in res[0].late and missing not in res[0].used
            job.net.release(missing, 0)  # now stale: dropped, never used in a later step


async def test_each_tree_family_decodes_from_any_two_children() -> None:
    # Every step waits out a deadline for the held children; the others must make it in
    # time, so a busy machine (the loop starved for D) must not make a second child late.
    job = Job(ar.CodedTree(**{**TREE, "deadline": 0.3}), 13)
    for step, (a, r) in enumerate(itertools.product(range(3), (1, 2, 3))):
        # The root decodes without child r; every other family without its a-th child.
        held = [(r, 0)] + [(KIDS[f][a], f) for f in (1, 2, 3) if f != r]
        for src, dst in held:
            job.net.hold(src, dst)
        res = await job.run(step)
        job.assert_exact(step, res)
        assert {src for src, _ in held} <= set(res[0].late)
        for src, dst in held:
            job.net.release(src, dst)


async def test_parent_lost_before_sending() -> None:
    job = Job(ar.CodedTree(**TREE), 13)
    job.assert_exact(0, await job.run(0))
    job.net.kill(1)
    alive = [r for r in range(13) if r != 1]
    for step in (1, 2):
        res = await job.run(step, alive)
        job.assert_exact(step, res)
        assert 1 in res[0].late
    assert all(fo(job, k) is Link.LOST for k in KIDS[1])
    assert all(fo(job, k) is Link.HEALTHY for k in KIDS[2])


async def test_parent_lost_after_sending_up() -> None:
    job = Job(ar.CodedTree(**TREE), 13)
    for k in KIDS[1]:
        job.net.hold(1, k)  # rank 1 gets the result but cannot pass it on
    tasks = job.start(0, range(13))
    await tasks[0]  # the root has the result, so rank 1 contributed and got it
    await tasks[1]
    job.net.kill(1)
    await asyncio.wait(tasks.values())
    res = {r: t.result() for r, t in tasks.items()}
    job.assert_exact(0, res)
    assert 1 in res[0].used  # it was lost after its message went up
    assert all(fo(job, k) is Link.LOST for k in KIDS[1])


def test_the_root_lost_fails_the_step_on_every_rank_naming_it_lost() -> None:
    """The root dies while every other rank waits for its result: nobody has that step's
    result. Its children say so to their own (who never talk to it), so every rank raises
    the same StragglerError naming rank 0 as lost, the leaves at once rather than after
    waiting out their parent (``give_up``). The clock does not move (ClockLoop): no deadline
    and no give_up can fire, so every step ends on what its rank was told alone."""

    async def body(_loop: ClockLoop) -> None:
        job = Job(ar.CodedTree(**{**TREE, "deadline": NO_WAIT}), 13)
        job.assert_exact(0, await job.run(0))
        for k in (1, 2, 3):
            job.net.hold(0, k)  # the root's result for step 1 never leaves it
        tasks = job.start(1, range(13))
        await tasks[0]  # the root decoded and "sent": its result is held
        job.net.kill(0)
        others = [tasks[r] for r in range(1, 13)]
        await until(lambda: all(t.done() for t in others))  # no timer was needed
        for r in range(1, 13):
            exc = tasks[r].exception()
            assert isinstance(exc, StragglerError) and exc.missing == [0] and exc.lost == [0], (
                r, exc)
        await job.close()

    clockloop.run(body)


def test_a_dead_leaf_is_named_lost_on_every_rank_even_those_that_never_talk_to_it() -> None:
    """A binary tree of 15 ranks loses leaf 7 (parent 3, grandparent 1): the step cannot be
    decoded, and every rank raises the same StragglerError naming rank 7 as lost, the root
    and the ranks of the other half too, which have no connection to it: only the verdict
    tells them, and healing waits for a replacement only for ranks it knows dead (the trees'
    side of stop 68's failure). The clock does not move: no deadline decides it."""

    async def body(_loop: ClockLoop) -> None:
        job = Job(ar.Tree(2, deadline=NO_WAIT), 15)
        job.assert_exact(0, await job.run(0))
        job.net.kill(7)
        tasks = job.start(1, [r for r in range(15) if r != 7])
        await until(lambda: all(t.done() for t in tasks.values()))  # no timer was needed
        for r, task in tasks.items():
            exc = task.exception()
            assert isinstance(exc, StragglerError) and exc.missing == [7] and exc.lost == [7], (
                r, exc)
        await job.close()

    clockloop.run(body)


def test_a_leaf_whose_parent_came_back_sends_to_it_again() -> None:
    """Leaf 3 saw its parent's connection break (failover LOST), and the parent is back (a
    replacement: connected again) when the next step starts. A leaf sends its vector before
    it waits for the result, so the send itself must see the connection is back; dropped,
    the parent waits for it and the step fails at a deadline (a tree's rank healed
    wrong this way). The clock does not move: the step ends exact only if it was sent."""

    async def body(_loop: ClockLoop) -> None:
        job = Job(ar.Tree(2, deadline=NO_WAIT), 7)
        job.assert_exact(0, await job.run(0))
        session = job.sessions[3]
        assert isinstance(session, ReduceSession) and session.failover is not None
        session.failover.parent_lost(1)
        assert fo(job, 3) is Link.LOST
        tasks = job.start(1, range(7))
        await until(lambda: all(t.done() for t in tasks.values()))  # no timer was needed
        job.assert_exact(1, {r: t.result() for r, t in tasks.items()})
        assert fo(job, 3) is not Link.LOST
        await job.close()

    clockloop.run(body)


def test_a_verdict_names_only_missing_ranks_as_lost() -> None:
    from aioreduce.schemes.reduce import Verdict

    v = Verdict.from_meta({"missing": [3, 7], "lost": [7, 9]})
    assert v.missing == (3, 7) and v.lost == (7,)  # 9 is not missing: not believed
    exc = v.error(4)
    assert isinstance(exc, StragglerError) and exc.lost == [7] and exc.missing == [3, 7]


async def test_parent_frozen_then_resumed_is_used_again() -> None:
    job = Job(ar.CodedTree(**TREE), 13)
    job.assert_exact(0, await job.run(0))
    job.net.freeze(1)
    others = [r for r in range(13) if r != 1]
    for step in (1, 2, 3):
        job.assert_exact(step, await job.run(step, others))
    assert all(fo(job, k) is Link.BYPASSED for k in KIDS[1])
    job.net.thaw(1)
    for step in (1, 2, 3):  # rank 1 catches up on the results it missed
        job.assert_exact(step, await job.run(step, [1]))
    for step in (4, 5, 6):
        res = await job.run(step)
        job.assert_exact(step, res)
    assert 1 in res[0].used
    assert all(fo(job, k) is Link.HEALTHY for k in KIDS[1])
    session = job.sessions[4]
    assert isinstance(session, ReduceSession) and session.failover is not None
    assert [(a.value, b.value) for a, b, _ in session.failover.transitions] == [
        ("healthy", "silent"), ("silent", "bypassed"), ("bypassed", "healthy")]


async def test_a_rank_further_behind_than_the_window_gets_fell_behind() -> None:
    job = Job(ar.CodedTree(**TREE, history_bytes=0), 13)  # keep only the last 2 outcomes
    job.net.freeze(4)
    others = [r for r in range(13) if r != 4]
    for step in range(12):
        job.assert_exact(step, await job.run(step, others))
    job.net.thaw(4)
    got: list[int] = []
    with pytest.raises(FellBehind) as err:
        for step in range(12):
            res = (await job.run(step, [4]))[4]
            if isinstance(res, BaseException):
                raise res
            np.testing.assert_allclose(res.value, job.truth(step), rtol=1e-9)
            got.append(step)
    assert got == list(range(8))  # the parent queued 8 steps, then held back
    assert err.value.current_step == 12 and err.value.step == 8 and err.value.rank == 4
    job.assert_exact(12, await job.run(12))  # it goes on at the current step


async def test_steps_held_back_from_a_rank_that_did_not_read_are_sent_when_it_reads() -> None:
    # Leaf 4 stops reading; its parent queues 8 steps, then holds the rest back. When 4 reads
    # again the parent sends the held-back steps at once: 4 never has to wait out a deadline
    # and ask (with a 30 s deadline, asking would show as requests in the network's log).
    job = Job(ar.CodedTree(**{**TREE, "deadline": 30.0}), 13)
    job.net.freeze(4)
    others = [r for r in range(13) if r != 4]
    for step in range(12):
        job.assert_exact(step, await job.run(step, others))
    job.net.thaw(4)
    for step in range(12):
        res = (await job.run(step, [4]))[4]
        assert isinstance(res, ar.Result), (step, res)
        np.testing.assert_allclose(res.value, job.truth(step), rtol=1e-9)
    requests = [s for s in job.net.sent if s[0] == 4 and s[3] == REQUEST_TAG]
    assert requests == []
    resent = {s[2] for s in job.net.sent if s[:2] == (1, 4) and s[3] >= DOWN}
    assert resent == set(range(12))
    job.assert_exact(12, await job.run(12))
    await job.close()


async def test_two_children_of_one_family_frozen_every_rank_raises() -> None:
    job = Job(ar.CodedTree(**TREE), 13)
    job.net.freeze(1)
    job.net.freeze(2)
    others = [r for r in range(13) if r not in (1, 2)]
    for step in (0, 1):
        res = await job.run(step, others)
        for rank, r in res.items():
            assert isinstance(r, StragglerError), (rank, r)
            assert r.missing == [1, 2], (rank, r.missing)
    job.net.thaw(1)
    job.net.thaw(2)
    for step in (0, 1):  # they learn the same verdict when they catch up
        for rank, r in (await job.run(step, [1, 2])).items():
            assert isinstance(r, StragglerError) and r.missing == [1, 2], (rank, r)
    for step in (2, 3):
        job.assert_exact(step, await job.run(step))


async def test_a_slow_childs_frame_is_never_used_in_a_later_step() -> None:
    job = Job(ar.GradientCoding(frc(6, 1), deadline=D), 7)
    job.net.hold(1, 0)
    res = await job.run(0)
    job.assert_exact(0, res)
    tasks = job.start(1, range(7))
    job.net.release(1, 0)  # step 0's frame arrives while the master is in step 1
    await asyncio.wait(tasks.values())
    job.assert_exact(1, {r: t.result() for r, t in tasks.items()})
    assert (1, 0, 0, 0) in job.net.sent


async def test_switching_schemes_leaves_nothing_behind() -> None:
    job = Job(ar.CodedTree(**TREE), 13)
    for step in (0, 1):
        job.assert_exact(step, await job.run(step))
    await job.close()
    assert all(c.installed() == 0 for c in job.net.comms)
    ring = Job(ar.Ring(), 13, net=job.net)
    for step in (2, 3):
        ring.assert_exact(step, await ring.run(step))
    await ring.close()


async def step_with_a_wrong_vector(job: Job, step: int, wrong: int, how: str
                                   ) -> list[ar.Result | BaseException]:
    """Run ``step`` on every rank, rank ``wrong`` with one element more or as float32."""
    async def one(rank: int) -> ar.Result:
        vec = job.vector(rank, step)
        if rank == wrong:
            vec = np.append(vec, 1.0) if how == "length" else vec.astype(np.float32)
        own: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        own.set_result(vec)
        return await job.sessions[rank].step(step, np.zeros_like(vec), own)

    return await asyncio.gather(*(one(r) for r in range(job.world)), return_exceptions=True)


@pytest.mark.parametrize("scheme, world, wrong", [
    (ar.CodedTree(**{**TREE, "deadline": NO_WAIT}), 13, 5),   # a leaf
    (ar.CodedTree(**{**TREE, "deadline": NO_WAIT}), 13, 2),   # an intermediate rank
    (ar.CodedTree(**{**TREE, "deadline": NO_WAIT}), 13, 0),   # the root
    (ar.GradientCoding(cyclic_mds(4, 1), deadline=NO_WAIT), 5, 3),
    (ar.Tree(2, deadline=NO_WAIT), 7, 6),
])
@pytest.mark.parametrize("how", ["length", "dtype"])
async def test_a_wrong_vector_on_one_rank_is_the_same_error_on_every_rank(
        scheme: ar.Scheme, world: int, wrong: int, how: str) -> None:
    # Even where the code could decode without that rank, a vector of another shape or dtype
    # is a caller's mistake: every rank raises VectorMismatch naming the wrong rank, at once
    # (not after a deadline, not as a straggler).
    job = Job(scheme, world)
    job.assert_exact(0, await job.run(0))
    results = await step_with_a_wrong_vector(job, 1, wrong, how)
    messages = set()
    for rank, res in enumerate(results):
        assert isinstance(res, ar.VectorMismatch), (rank, res)
        assert wrong in res.ranks and f"rank {wrong}" in str(res), (rank, res)
        assert "every rank must pass the same shape and dtype" in str(res)
        messages.add(str(res))
    assert len(messages) == 1, messages  # the same message everywhere
    job.assert_exact(2, await job.run(2))  # and the job goes on
    await job.close()


@pytest.mark.parametrize("how", ["length", "dtype"])
async def test_a_wrong_vector_in_the_ring_is_named_on_every_rank(how: str) -> None:
    world, wrong = 6, 3
    job = Job(ar.Ring(), world)
    job.assert_exact(0, await job.run(0))
    results = await step_with_a_wrong_vector(job, 1, wrong, how)
    for rank, res in enumerate(results):  # no rank waits forever, each names rank 3
        assert isinstance(res, ar.VectorMismatch), (rank, res)
        assert wrong in res.ranks and f"rank {wrong}'s" in str(res), (rank, res)
    job.assert_exact(2, await job.run(2))
    await job.close()


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("world", [1, 2, 5])
async def test_the_ring_sums_into_each_ranks_own_vector(world: int, bidirectional: bool) -> None:
    """``step_into`` with the rank's own vector as destination (what in-place all-reduce and
    the torch backend do): every rank ends with the same bits, the sum (or the mean: each
    rank divides the segment it reduced), in its own array; the result is that array."""
    job = Job(ar.Ring(bidirectional=bidirectional), world)

    async def one(rank: int, step: int, vector: np.ndarray, divisor: float) -> ar.Result:
        own: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        own.set_result(vector)
        session = job.sessions[rank]
        assert isinstance(session, SumsInPlace)
        return await session.step_into(step, np.zeros(DIM), own, vector, divisor)

    for step, divisor in enumerate([1, world, 3]):
        vectors = [job.vector(r, step) for r in range(world)]
        results = await asyncio.gather(*(one(r, step, vectors[r], divisor)
                                         for r in range(world)))
        for rank, res in enumerate(results):
            assert np.shares_memory(res.value, vectors[rank]) and res.value.flags.writeable
            np.testing.assert_allclose(vectors[rank], job.truth(step) / divisor, rtol=1e-12)
            assert vectors[rank].tobytes() == vectors[0].tobytes()
    # Lanes are asked for (the default) but the in-memory network has none: the event loop's
    # path ran, on every rank.
    assert not any(getattr(s, "lanes_open", False) for s in job.sessions)
    await job.close()


@pytest.mark.parametrize("ahead, staged", [("all", 0), ("two", 4)])
async def test_a_ring_predecessor_running_ahead_lands_in_posted_receives(
        ahead: str, staged: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's predecessor is held back only by the socket buffers, so it can send every
    reduce-scatter segment before this rank has added the first. Those frames land in
    receives posted ahead (``POSTED_AHEAD`` of scratch), not in the inbox's staging (a fresh
    buffer and a copy each); with only two posted ahead, the rest are staged."""
    from aioreduce.schemes import ring

    world, me = 7, 3
    if ahead == "two":
        monkeypatch.setattr(ring, "POSTED_AHEAD", 1)  # the floor: two slots
    job = Job(ar.Ring(), world)
    job.net.hold(me - 1, me)
    tasks = job.start(0, range(world))
    # The predecessor's last reduce-scatter frame needs nothing from this rank.
    await job.net.until_sent(me - 1, me, 0, world - 2)
    job.net.release(me - 1, me)
    await asyncio.wait(tasks.values())
    job.assert_exact(0, {r: t.result() for r, t in tasks.items()})
    early = [tag for src, dst, _step, tag in job.net.staged
             if (src, dst) == (me - 1, me) and tag < world - 1]
    assert len(early) == staged, early
    await job.close()


@pytest.mark.parametrize("ahead", [1, 24, 1 << 30])
async def test_the_ring_is_exact_whatever_it_posts_ahead(ahead: int,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    # Two slots, three (segments here are one float64: 24 bytes; a slot is reused while
    # later receives are posted) and every one.
    from aioreduce.schemes import ring

    monkeypatch.setattr(ring, "POSTED_AHEAD", ahead)
    job = Job(ar.Ring(), 7)
    for step in range(3):
        job.assert_exact(step, await job.run(step))
    await job.close()


async def test_a_dead_rank_in_the_ring_stops_every_rank() -> None:
    # The ring has no deadline: without the abort, ranks two hops away would wait forever.
    world = 6
    job = Job(ar.Ring(), world)
    job.assert_exact(0, await job.run(0))
    job.net.kill(3)
    results = await job.run(1, [r for r in range(world) if r != 3])
    for rank, res in results.items():
        assert isinstance(res, ar.PeerLost) and res.rank == 3, (rank, res)
    await job.close()


@pytest.mark.parametrize("scheme, world", [
    (ar.Ring(), 4),
    # A result log of two results (6 float64 each): older results leave it, and can be reused.
    (ar.Tree(2, deadline=NO_WAIT, history_bytes=96), 7),
    (ar.CodedTree(**{**TREE, "deadline": NO_WAIT}, history_bytes=96), 13),
    # Its rotated vector, phase-1 scratch and result (the sends' views keep the first alive).
    (ar.Transpose(deadline=30.0), 4),
])
async def test_memory_is_reused_only_once_nobody_holds_it(scheme: ar.Scheme, world: int
                                                           ) -> None:
    # A result's (or a receive buffer's) memory serves a later step once nothing refers to it
    # any more (fresh memory costs page faults every step); a result someone holds is never
    # written.
    job = Job(scheme, world)
    held: list[tuple[int, object]] = []  # (step, results) of the odd steps, kept to the end
    copies: list[dict[int, np.ndarray]] = []
    dropped: set[int] = set()  # addresses of results nobody holds any more
    held_at: set[int] = set()
    reused = 0
    for step in range(12):
        results = await job.run(step)
        job.assert_exact(step, results)
        at = {res.value.__array_interface__["data"][0]  # type: ignore[union-attr]
              for res in results.values()}
        assert not at & held_at, "a held result's memory was written"
        reused += len(at & dropped)
        if step % 2:
            held.append((step, results))
            copies.append({r: np.array(res.value) for r, res in results.items()})  # type: ignore[union-attr]
            held_at |= at
        else:
            dropped |= at
        del results
        for (_, res_held), copy in zip(held, copies, strict=True):
            for r, res in res_held.items():  # type: ignore[attr-defined]
                np.testing.assert_array_equal(res.value, copy[r])
    assert reused > 0  # the reuse path was taken
    # Small arrays come back at the same address from the allocator anyway: ask the pools.
    assert all(s.pool.reused > 0 for s in job.sessions)  # type: ignore[attr-defined]
    await job.close()


class _Order(CommWrapper):
    """Records, in order, the chunks this rank sends up and the result chunks it receives."""

    def __init__(self, inner: Comm, parent: int) -> None:
        super().__init__(inner)
        self.parent, self.events = parent, list[tuple[str, int]]()

    async def send(self, rank: int, array: np.ndarray, *, step: int, tag: int = 0,
                   meta: dict[str, Any] | None = None) -> None:
        if rank == self.parent and tag < DOWN:
            self.events.append(("up", tag))
        await super().send(rank, array, step=step, tag=tag, meta=meta)

    def post_recv(self, rank: int, out: np.ndarray, *, step: int,
                  tag: int = 0) -> asyncio.Future[Header]:
        fut = super().post_recv(rank, out, step=step, tag=tag)
        if rank == self.parent and DOWN <= tag < tags.VERDICT:
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() is not None
                                  or self.events.append(("result", tag - DOWN)))
        return fut


@pytest.mark.parametrize("scheme, world, leaf, window", [
    (ar.Tree(2, deadline=NO_WAIT, chunk_bytes=64), 7, 5, 4),  # depth 2: 2 hops up, 2 down
    (ar.Star(deadline=NO_WAIT, chunk_bytes=64), 4, 2, 2),
    (ar.CodedTree(**{**TREE, "deadline": D}, chunk_bytes=64), 13, 7, 4),
], ids=["tree", "star", "coded-tree"])
async def test_a_leaf_paces_its_chunks_by_the_result_and_sums_stay_exact(
        scheme: ar.Scheme, world: int, leaf: int, window: int) -> None:
    """A leaf whose vector is many chunks sends chunk c only once result chunk c - window is
    here (a round trip's worth ahead: its chunks would otherwise take its parent's link from
    the result); the sums stay exact, and a held-back sibling (coded tree) stalls nobody."""
    net = MemoryNetwork(world)
    parent = 0 if world == 4 else (leaf - 1) // (2 if world == 7 else 3)
    order = _Order(net.comms[leaf], parent)
    chunks = 12  # of 8 float64 (64 bytes)
    job = Job(scheme, world, net, [order if r == leaf else c for r, c in enumerate(net.comms)],
              dim=chunks * 8)
    for step in range(2):
        order.events.clear()
        if world == 13:
            job.net.hold(8, 2)  # the coded tree decodes without it, at its deadline
        job.assert_exact(step, await job.run(step))
        if world == 13:
            job.net.release(8, 2)
        ups = [c for kind, c in order.events if kind == "up"]
        assert ups == list(range(chunks))
        for c in range(window, chunks):  # chunk c went after result chunk c - window came
            assert order.events.index(("result", c - window)) < order.events.index(("up", c))
    await job.close()


@pytest.mark.parametrize("max_chunks, sent", [(None, 16), (64, 40), (8, 8)])
async def test_max_chunks_sets_how_many_chunks_a_message_travels_in(
        max_chunks: int | None, sent: int) -> None:
    """A vector of 40 chunks' worth goes up in at most ``max_chunks`` chunks (16 unless
    said), larger ones where it caps them; the sums stay exact."""
    extra = {} if max_chunks is None else {"max_chunks": max_chunks}
    world, leaf = 7, 5
    net = MemoryNetwork(world)
    order = _Order(net.comms[leaf], 2)
    job = Job(ar.Tree(2, deadline=NO_WAIT, chunk_bytes=64, **extra), world, net,
              [order if r == leaf else c for r, c in enumerate(net.comms)], dim=40 * 8)
    job.assert_exact(0, await job.run(0))
    assert [c for kind, c in order.events if kind == "up"] == list(range(sent))
    await job.close()
    with pytest.raises(ValueError, match="max_chunks"):
        ar.Tree(2, max_chunks=0).open(net.comms[0])


@pytest.mark.parametrize("when", ["running", "before"])
async def test_a_ring_step_one_rank_fails_without_running_it_fails_on_every_rank(
        when: str) -> None:
    """A rank that fails a step at once, without running it (a group's later steps after a
    death: ``Healer``), tells the others with ``tell_failed``. Ranks already in the step raise
    the error it names, as ranks not there yet do when they get there; none waits for the
    part that rank never sends. The next step, on every rank, is exact."""
    from aioreduce.schemes.base import TellsFailure

    world = 5
    job = Job(ar.Ring(), world)
    job.assert_exact(0, await job.run(0))
    teller = job.sessions[0]
    assert isinstance(teller, TellsFailure)
    error = ar.PeerLost(3, "connection lost")
    if when == "before":
        teller.tell_failed(1, error)
        tasks = job.start(1, range(1, world))
    else:
        tasks = job.start(1, range(1, world))
        await job.net.until_sent(1, 2, 1, 0)  # rank 1 is in step 1: its first segment left
        assert not any(t.done() for t in tasks.values())
        teller.tell_failed(1, error)
    await asyncio.wait(tasks.values())
    for rank, task in tasks.items():
        exc = task.exception()
        assert isinstance(exc, ar.PeerLost) and exc.rank == 3, (rank, exc)
        assert "reported by rank" in str(exc), (rank, exc)
    job.assert_exact(2, await job.run(2))
    await job.close()
