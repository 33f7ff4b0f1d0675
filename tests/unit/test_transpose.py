"""The bounded-time transpose allreduce on the in-memory network: the reference's worked
examples (kadhe_optireduce.md §2.2), the Hadamard toy test (§2.6), stale slices, the safety
valve, the adaptive stage clock, re-sync reporting and falling behind.

Links are cut with ``MemoryNetwork.lose`` (one frame's tag on one link), so each test knows
exactly which contribution is missing. Stages that wait for a lost frame end at a fixed
bound (``D`` per step); the results do not depend on how long that takes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import pytest

from aioreduce.codes import hadamard as hadamard_module
from aioreduce.codes.hadamard import Rotation
from aioreduce.schemes import FellBehind, Result, StragglerError, Transpose
from aioreduce.schemes.links import CommLinks
from aioreduce.schemes.transpose.clock import StageClock
from aioreduce.schemes.transpose.layout import PHASE2_TAG, Layout
from aioreduce.schemes.transpose.stage import Slot, Stage
from aioreduce.transport.memory import MemoryNetwork

from .clockloop import AutoClockLoop

# The tests run on a clock that jumps to the next timer whenever nothing is ready, read by the
# stages as their perf_counter (tests/unit/conftest.py): a stage that waits for a lost frame
# ends at its bound at once, and nothing depends on how busy the machine is.
AUTOJUMP = True
D = 0.5  # a fixed step bound (0.25 s a stage)
X0 = np.array([1.0, 2, 3, 4, 5, 6])


async def test_these_tests_run_on_the_jumping_clock() -> None:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, AutoClockLoop)
    before = time.perf_counter()
    await asyncio.sleep(3600.0)  # at once
    assert time.perf_counter() - before == pytest.approx(3600.0, abs=1e-3)


async def run_step(net: MemoryNetwork, sessions: list, step: int,
                   vectors: list[np.ndarray]) -> list[Result | BaseException]:
    async def one(rank: int) -> Result:
        own: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        own.set_result(vectors[rank])
        return await sessions[rank].step(step, np.zeros_like(vectors[rank]), own)

    tasks = [asyncio.ensure_future(one(r)) for r in range(net.world_size)]
    await asyncio.wait(tasks)
    return [t.exception() or t.result() for t in tasks]


def worked(**options: object) -> tuple[MemoryNetwork, list, list[np.ndarray]]:
    """N = 3, length 6, one slice per shard; x_1 = 10 x_0, x_2 = 100 x_0. OptiReduce's
    ``missing="zero"``, as the reference's worked examples, unless ``options`` say else."""
    net = MemoryNetwork(3)
    scheme = Transpose(hadamard=False, deadline=D, max_loss=1.0,  # type: ignore[arg-type]
                       **{"missing": "zero", **options})
    return net, [scheme.open(c) for c in net.comms], [X0, 10 * X0, 100 * X0]


def valve() -> tuple[MemoryNetwork, list]:
    """N = 3 with the safety valve at 1 %: one missing contribution raises."""
    net = MemoryNetwork(3)
    return net, [Transpose(hadamard=False, deadline=D, max_loss=0.01).open(c)
                 for c in net.comms]


async def test_worked_example_without_a_drop_is_exact_on_every_rank() -> None:
    net, sessions, xs = worked()
    results = await run_step(net, sessions, 0, xs)
    for res in results:
        assert isinstance(res, Result) and res.exact and res.received == 1.0
        assert res.value.tolist() == [111, 222, 333, 444, 555, 666]
        assert res.late == [] and res.stand_in == []
    phases = {tag >= PHASE2_TAG for _s, _d, _step, tag in net.sent}
    assert phases == {False, True}  # both phases ran


async def test_a_phase1_drop_loses_exactly_one_contribution_on_every_rank() -> None:
    net, sessions, xs = worked()
    net.lose(0, 1, 0)  # node 0's copy of shard 1 never reaches its owner
    results = await run_step(net, sessions, 0, xs)
    for rank, res in enumerate(results):
        assert isinstance(res, Result), (rank, res)
        assert res.value.tolist() == [111, 222, 330, 440, 555, 666], rank
        assert not res.exact and res.late == [0] and res.stand_in == []
        assert res.received == pytest.approx(8 / 9)  # 1 of 3 contributions to 1 of 3 shards
        assert res.worst_shard == pytest.approx(2 / 3)


async def test_a_phase2_drop_affects_only_the_receiving_rank() -> None:
    net, sessions, xs = worked()
    net.lose(1, 2, PHASE2_TAG)  # owner 1's reduced shard never reaches node 2
    r0, r1, r2 = await run_step(net, sessions, 0, xs)
    for res in (r0, r1):
        assert isinstance(res, Result) and res.exact
        assert res.value.tolist() == [111, 222, 333, 444, 555, 666]
    assert isinstance(r2, Result) and not r2.exact
    assert r2.value.tolist() == [111, 222, 300, 400, 555, 666]  # its own values stand in
    assert r2.stand_in == [1] and r2.drifted == [2]


async def test_rescale_makes_a_missing_contribution_unbiased() -> None:
    net, sessions, xs = worked(missing="rescale")
    net.lose(0, 1, 0)
    results = await run_step(net, sessions, 0, xs)
    for res in results:
        assert isinstance(res, Result)
        assert res.value.tolist() == pytest.approx([111, 222, 330 * 1.5, 440 * 1.5, 555, 666])


async def test_the_safety_valve_raises_naming_the_missing_rank() -> None:
    net, sessions = valve()
    net.lose(0, 1, 0)
    results = await run_step(net, sessions, 0, [X0, 10 * X0, 100 * X0])
    for res in results:
        assert isinstance(res, StragglerError) and res.missing == [0], res
        assert "more than max_loss 1.0%" in str(res)


async def test_late_slices_are_dropped_and_never_written_into_a_later_step() -> None:
    net, sessions, xs = worked()
    net.hold(0, 1)  # everything rank 0 sends rank 1 in step 0 arrives only after it
    first = await run_step(net, sessions, 0, xs)
    assert isinstance(first[1], Result) and first[1].late == [0]
    net.release(0, 1)  # step 0's frames arrive now, during step 1's time
    assert not any(k[0] == 0 for k in net.comms[1]._peers[0].staged)  # dropped on arrival
    second = await run_step(net, sessions, 1, [2 * x for x in xs])
    for res in second:
        assert isinstance(res, Result) and res.exact
        assert res.value.tolist() == [222, 444, 666, 888, 1110, 1332]


class Lending:
    """Makes the comm's links lend, as lanes do (``Links.release``): each lent array is
    checked, at the release that frees it, to be as it was when it was sent (the session
    may not write into what it lent before then), and the peer gets those bytes.
    ``answered``: in place, the reduced slices land over the lent vector once the peer has
    read (or dropped) what it was lent, before the release: not checked there."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, answered: bool = False) -> None:
        self.lent: list[tuple[int, np.ndarray, np.ndarray]] = []  # (peer, array, as sent)
        self.kept: list[np.ndarray] = []  # what went out not lent: read until it is sent
        self.released = self.sent = 0
        send = CommLinks.send

        def lending_send(links: CommLinks, peer: int, array: np.ndarray, step: int, tag: int,
                         meta: dict, *, lent: bool = False) -> bool:
            if not lent:
                self.kept.append(array)
                return send(links, peer, array, step, tag, meta)
            self.sent += 1
            self.lent.append((peer, array, array.copy()))
            return send(links, peer, self.lent[-1][2], step, tag, meta)

        def release(_links: CommLinks, peers: list[int]) -> None:
            self.released += 1
            for peer, array, as_sent in self.lent:
                if peer in peers and not answered:
                    assert np.array_equal(array, as_sent), "lent memory written before release"
            self.lent = [e for e in self.lent if e[0] not in peers]

        monkeypatch.setattr(CommLinks, "send", lending_send)
        monkeypatch.setattr(CommLinks, "lends", lambda _links, _peer: True)
        monkeypatch.setattr(CommLinks, "release", release)


async def run_step_to(net: MemoryNetwork, sessions: list, step: int,
                      vectors: list[np.ndarray]) -> list[Result | BaseException]:
    """One step on every rank, each result written into the rank's own vector."""
    tasks = [asyncio.ensure_future(s.step_to(step, np.zeros_like(x), _ready(x), x))
             for s, x in zip(sessions, vectors, strict=True)]
    await asyncio.wait(tasks)
    return [t.exception() or t.result() for t in tasks]


@pytest.mark.parametrize("world", [4, 7])
@pytest.mark.parametrize("in_place", [False, True], ids=["result", "into-own-vector"])
@pytest.mark.parametrize("lends", [False, True], ids=["copied", "lent"])
async def test_exact_sums_with_and_without_hadamard(world: int, in_place: bool, lends: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact, with the vector sent as it is (``lent``: links that lend, as lanes) or copied
    first (the comm's links, or the rotation)."""
    lending = Lending(monkeypatch, answered=in_place) if lends else None
    net = MemoryNetwork(world)
    rng = np.random.default_rng(world)
    for hadamard, dtype, tol in [(False, np.float64, 1e-9), (True, np.float32, 1e-6)]:
        # 10 007 entries in 4 KiB slices: with the rotation, the last slices reach into its
        # padding (in place, they land beside the vector and are copied in).
        sessions = [Transpose(hadamard=hadamard, deadline=30.0, slice_bytes=4096).open(c)
                    for c in net.comms]
        xs = [rng.standard_normal(10_007).astype(dtype) for _ in range(world)]
        want = np.sum(np.array(xs, np.float64), axis=0)
        run = run_step_to if in_place else run_step
        for x, res in zip(xs, await run(net, sessions, int(hadamard), xs), strict=True):
            assert isinstance(res, Result) and res.exact and res.value.dtype == dtype
            assert np.shares_memory(res.value, x) == in_place  # where the result landed
            err = np.linalg.norm(res.value - want) / np.linalg.norm(want)
            assert err < tol, (hadamard, err)
        if lending is not None:  # lent without the rotation, apart or in place; released
            assert lending.released == world and lending.sent and not lending.lent
            # A send not lent may still be read after the step returns (a slow peer): never
            # from the caller's vector (in place, the reduced shard is summed there and sent
            # from a copy).
            assert lending.kept and not any(np.shares_memory(k, x)
                                            for k in lending.kept for x in xs)
            lending.kept.clear()
        await asyncio.gather(*(s.close(1.0) for s in sessions))


@pytest.mark.parametrize("missing", ["zero", "rescale"])
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("in_place", [True, False], ids=["into-own-vector", "result"])
@pytest.mark.parametrize("lends", [False, True], ids=["copied", "lent"])
async def test_a_missed_reduced_shard_gets_this_ranks_own_values(
        hadamard: bool, missing: str, in_place: bool, lends: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in is this rank's own contribution (N times it with ``rescale``): also when
    the vector it came from is where the result lands (with the rotation: rotated back from
    what the rank sent), and when the vector went out lent, not copied (over links that
    lend, without the rotation, the result apart from the vector or over it)."""
    lending = Lending(monkeypatch, answered=in_place) if lends else None
    net = MemoryNetwork(3)
    sessions = [Transpose(hadamard=hadamard, deadline=D, max_loss=1.0,
                          missing=missing).open(c)  # type: ignore[arg-type]
                for c in net.comms]
    xs = [X0.copy(), 10 * X0, 100 * X0]
    net.lose(2, 0, PHASE2_TAG)  # owner 2's reduced shard never reaches rank 0
    r0, r1, r2 = await (run_step_to if in_place else run_step)(net, sessions, 0, xs)
    for res in (r1, r2):
        assert isinstance(res, Result) and res.exact
        assert res.value.tolist() == pytest.approx([111, 222, 333, 444, 555, 666])
    assert isinstance(r0, Result) and r0.stand_in == [2]
    assert np.shares_memory(r0.value, xs[0]) == in_place
    weight = 3 if missing == "rescale" else 1
    assert r0.value.tolist() == pytest.approx([111, 222, 333, 444, 5 * weight, 6 * weight])
    if not in_place:
        assert xs[0].tolist() == X0.tolist()  # the caller's vector as it was
    if lending is not None:  # the path under test: lent only without the rotation
        assert bool(lending.sent) != hadamard and lending.released == (0 if hadamard else 3)


@pytest.mark.parametrize("missing", ["zero", "rescale"])
async def test_a_missed_reduced_slice_in_the_rotation_padding_gets_its_own_values(
        missing: str) -> None:
    """With the rotation, the last shard's slices reach past the vector; one that is lost
    leaves this rank's own values (N times them with ``rescale``) in the vector's entries it
    covers, nothing beyond."""
    net = MemoryNetwork(3)
    sessions = [Transpose(deadline=D, max_loss=1.0, slice_bytes=16,
                          missing=missing).open(c)  # type: ignore[arg-type]
                for c in net.comms]
    xs = [np.arange(1.0, 12.0) * 10 ** r for r in range(3)]  # 11 entries, padded to 12
    sessions[0]._rotation_for(11)
    assert sessions[0]._rotation.padded == 12  # shards of 4: the last slice is 10..11
    net.lose(2, 0, PHASE2_TAG + 1)  # rank 0 misses owner 2's slice [10, 12)
    r0, *others = await run_step_to(net, sessions, 0, [x.copy() for x in xs])
    assert isinstance(r0, Result) and r0.stand_in == [2] and r0.value.shape == (11,)
    want = np.sum(xs, axis=0)
    for res in others:  # theirs came, through the buffer beside the vector
        assert isinstance(res, Result) and res.exact
        assert res.value.tolist() == pytest.approx(want.tolist())
    want[10] = xs[0][10] * (3 if missing == "rescale" else 1)
    assert r0.value.tolist() == pytest.approx(want.tolist())


async def test_a_rank_far_behind_jumps_to_the_step_its_peers_are_at() -> None:
    net = MemoryNetwork(3)
    sessions = [Transpose(hadamard=False, deadline=D).open(c) for c in net.comms]
    xs = [X0, 10 * X0, 100 * X0]
    for step in range(3):  # ranks 0 and 1 run on; rank 2 is frozen out of these steps
        tasks = [asyncio.ensure_future(s.step(step, np.zeros(6), _ready(x)))
                 for s, x in zip(sessions[:2], xs[:2], strict=True)]
        await asyncio.wait(tasks)
    with pytest.raises(FellBehind) as err:
        await sessions[2].step(0, np.zeros(6), _ready(xs[2]))
    assert err.value.current_step == 2


async def test_resync_every_k_steps_and_drift_is_reported_until_then() -> None:
    net = MemoryNetwork(3)
    sessions = [Transpose(hadamard=False, deadline=D, max_loss=1.0, resync_every=2).open(c)
                for c in net.comms]
    net.lose(1, 2, PHASE2_TAG)
    xs = [X0, 10 * X0, 100 * X0]
    first = await run_step(net, sessions, 0, xs)
    second = await run_step(net, sessions, 1, xs)
    assert [r.resync for r in first] == [False] * 3  # type: ignore[union-attr]
    assert [r.resync for r in second] == [True] * 3  # type: ignore[union-attr]
    # Rank 2 used a stand-in at step 0; ranks 0 and 1 learn it from its step-1 frames.
    assert [r.drifted for r in second] == [[2], [2], [2]]  # type: ignore[union-attr]
    third = await run_step(net, sessions, 2, xs)
    assert third[0].drifted == []  # type: ignore[union-attr]  (cleared by the re-sync)


def _ready(x: np.ndarray) -> asyncio.Future[np.ndarray]:
    fut: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
    fut.set_result(x)
    return fut


# -- the stage clock ---------------------------------------------------------------------------
def test_the_clock_waits_during_warm_up_then_bounds_by_headroom_times_p95() -> None:
    clock = StageClock(warmup=20, slack=4.0, headroom=2.0, min_deadline=0.001)
    times = [0.010 + 0.001 * i for i in range(20)]
    for t in times:
        assert clock.reliable and clock.deadline() is None and clock.advert() == {}
        clock.observe(t, 1.0)
    assert clock.bound == pytest.approx(2.0 * np.percentile(times, 95))
    assert clock.estimate == pytest.approx(np.mean(times))
    assert clock.deviation == pytest.approx(np.abs(np.array(times) - np.mean(times)).mean())
    # Until a peer's proposal is heard (they come with the first adaptive step's frames),
    # the ceiling; then the median proposal (its own alone here: one peer, the same).
    assert clock.deadline() == pytest.approx(clock.bound)
    clock.heard(1, clock.proposal, clock.bound)
    # (the larger of the slack's and the recent floor's: here the warm-up's longest stage)
    assert clock.deadline() == pytest.approx(max(clock.estimate + 4.0 * clock.deviation,
                                                 clock.recent_margin * max(times)))


@pytest.mark.parametrize("n", [1, 2, 3, 10, 37])
def test_the_ceiling_is_numpys_p95_of_unsorted_samples(n: int) -> None:
    # Computed without numpy (its percentile's first call took 7 ms, at the end of the last
    # warm-up step on every rank), interpolated as numpy's default is.
    times = list(np.random.default_rng(n).exponential(0.01, n))
    clock = StageClock(warmup=n, headroom=3.0)
    for t in times:
        clock.observe(t, 1.0)
    assert clock.bound == pytest.approx(3.0 * np.percentile(times, 95), rel=1e-12)


def test_a_cut_stage_counts_as_needing_more_time_float_ratio() -> None:
    clock = StageClock(warmup=1, gain=1.0, deviation_gain=1.0, min_deadline=0.0)
    clock.observe(0.010, 1.0)
    clock.observe(0.009, 0.75)  # cut at 3/4 of its data: it needed about 12 ms
    assert clock.estimate == pytest.approx(0.012)
    assert clock.deviation == pytest.approx(0.002)


def test_a_stage_cut_for_a_silent_sender_teaches_the_others_time_not_the_deadline() -> None:
    """A straggler that sent nothing is cut at the deadline: ``elapsed / fraction`` would teach
    the estimate the deadline over the fraction (in the tail row the next ten or so bounds
    rose from about 16 ms to 24); it learns how long the senders that did send took."""
    clock = StageClock(warmup=1, gain=1.0, deviation_gain=1.0, min_deadline=0.0)
    clock.observe(0.010, 1.0)
    clock.observe(0.020, 2 / 3, others=0.011)  # cut at 20 ms; the other two were in at 11
    assert clock.estimate == pytest.approx(0.011)
    assert clock.deviation == pytest.approx(0.001)
    assert list(clock.recent) == [0.010]  # a cut stage still raises no floor
    clock.observe(0.020, 2 / 3)  # cut without a silent sender: slow data, the ratio as before
    assert clock.estimate == pytest.approx(0.030)


def test_the_proposal_covers_the_longest_recent_complete_stage_not_a_cut_one() -> None:
    """Calm stages with a tail the deviation misses (emulated hosts: estimate 117 ms, calm
    stages up to 207 ms were cut): the proposal is at least 1.5x the longest of the recent
    complete stages; a cut stage does not raise that floor."""
    clock = StageClock(warmup=2, slack=0.0, headroom=100.0, min_deadline=0.0)
    assert clock.recent_margin == 1.5
    for elapsed in (0.100, 0.100):
        clock.observe(elapsed, 1.0)
    clock.observe(0.160, 1.0)  # complete, late in the calm
    assert clock.proposal == pytest.approx(1.5 * 0.160)
    clock.observe(0.500, 0.5)  # cut at its deadline (a straggler): counted in the estimate
    assert clock.recent[-1] == 0.160
    assert clock.proposal == pytest.approx(max(1.5 * 0.160, clock.estimate))


def test_one_slow_rank_cannot_stretch_the_agreed_deadline() -> None:
    clock = StageClock(warmup=1, slack=0.0, headroom=100.0, min_deadline=0.0,
                       recent_margin=0.0)
    clock.observe(0.010, 1.0)
    clock.heard(1, 0.011, 0.5)
    clock.heard(2, 0.009, 0.5)
    clock.heard(3, 5.0, 9.0)  # a straggler's inflated view
    assert clock.deadline() == pytest.approx(0.0105)
    clock.heard(4, "x", 1)  # garbage from a peer is ignored
    assert 4 not in clock.peers


def test_a_network_that_slows_after_warm_up_raises_the_ceiling_and_a_cut_stage_does_not(
) -> None:
    """Links that fill with other traffic after warm-up (4 emulated hosts, 2 background
    flows: steps from 37 to 95 ms over 200): a ceiling set by warm-up alone cut every stage
    once they took longer (docs/transpose.md "Deadlines"). It follows the complete stages since
    warm-up (headroom x the longest of them), not the cut ones (a straggler's)."""
    clock = StageClock(warmup=4, slack=0.0, headroom=2.0, min_deadline=0.0,
                       recent_margin=0.0, gain=1.0, deviation_gain=1.0)
    for _ in range(4):
        clock.observe(0.040, 1.0)
    assert clock.ceiling == pytest.approx(0.080)
    clock.heard(1, 1.0, 0.080)  # a peer that proposes more than any ceiling
    for elapsed in (0.050, 0.060, 0.070):  # slower, each still complete in its bound
        clock.observe(elapsed, 1.0)
    assert clock.ceiling == pytest.approx(2.0 * 0.070)
    clock.heard(1, 1.0, clock.ceiling)
    assert clock.deadline() == pytest.approx(0.140)  # the median ceiling, not warm-up's
    for _ in range(10):
        clock.observe(0.140, 0.5)  # cut at its deadline: a straggler raises nothing
    assert clock.ceiling == pytest.approx(0.140)
    assert clock.advert() == {"tc": clock.proposal, "tb": pytest.approx(0.140)}


def test_a_straggler_that_completed_raises_neither_the_floor_nor_the_ceiling() -> None:
    """A sender late to start (it had sent nothing when the others were in) whose slices
    still came, in warm-up or under a bound it fitted: the clock learns the others' time.
    Counted, its lateness raised the floor to 1.5x itself for the next stages, every
    straggler there fitted under it and raised it again, and nothing was bounded."""
    clock = StageClock(warmup=4, slack=0.0, headroom=2.0, min_deadline=0.0, gain=1.0,
                       deviation_gain=1.0)
    for _ in range(3):
        clock.observe(0.010, 1.0)
    clock.observe(0.400, 1.0, others=0.011, late=frozenset({3}))  # a spike, in warm-up
    assert clock.bound is not None and clock.bound < 0.03  # not 2 x 0.4
    assert max(clock.recent) == 0.011
    clock.observe(0.300, 1.0, others=0.012, late=frozenset({2}))  # one that fitted, later
    assert max(clock.recent) == 0.012 and max(clock.settled) == 0.012
    assert clock.estimate == pytest.approx(0.012)
    assert clock.proposal is not None and clock.proposal < 0.03


def test_a_sender_a_little_behind_the_others_counts_whole() -> None:
    """The ranks' skew (a sender ready a few milliseconds after the others were in) is the
    stage's own time, which stage 1 absorbs: by at most the others' time again plus
    min_deadline, the stage counts whole."""
    clock = StageClock(warmup=1, min_deadline=0.010)
    clock.observe(0.015, 1.0, others=0.004, late=frozenset({1}))  # 15 <= 2 x 4 + 10
    assert clock.samples == [0.015]
    clock.observe(0.030, 1.0, others=0.004, late=frozenset({1}))  # 30 > 18: a straggler
    assert clock.recent[-1] == 0.004


def test_a_sender_late_in_most_of_the_last_stages_is_slow_not_straggling() -> None:
    """A rank late to start stage after stage (a slower machine) is the stage's pace: the
    bound follows it instead of cutting it every step (from the stage in which it has been
    late in three quarters of the last ones)."""
    clock = StageClock(warmup=2, slack=0.0, headroom=100.0, min_deadline=0.0)
    window = clock.late_history.maxlen
    assert window == 8
    for _ in range(2):
        clock.observe(0.010, 1.0)
    learnt = []
    for _ in range(8):
        clock.observe(0.100, 1.0, others=0.010, late=frozenset({3}))
        learnt.append(clock.recent[-1])
    assert learnt == [0.010] * 6 + [0.100] * 2  # late in 6 of the last 8 from the seventh on
    assert clock.proposal == pytest.approx(1.5 * 0.100)
    # Another rank late once meanwhile is still a straggler.
    clock.observe(0.200, 1.0, others=0.010, late=frozenset({1}))
    assert clock.recent[-1] == 0.010


def test_a_sender_only_a_little_behind_is_not_counted_late_for_the_slow_rule() -> None:
    """Starting last by the skew alone (a millisecond in a quick stage: some sender nearly
    every time) does not go into the history the slow-machine rule reads. Counted, it made a
    rank paused in a few steps "slow" (the straggler soak's pause model, seed 17): its pauses
    counted whole, the floor rose past them and no stage was cut again."""
    clock = StageClock(warmup=2, slack=0.0, headroom=100.0, min_deadline=0.010)
    for _ in range(2):
        clock.observe(0.010, 1.0)
    for _ in range(6):  # rank 3 last, within the skew: counts whole, recorded as on time
        clock.observe(0.012, 1.0, others=0.010, late=frozenset({3}))
        assert clock.recent[-1] == 0.012
    assert all(not late for late in clock.late_history)
    clock.observe(0.400, 1.0, others=0.010, late=frozenset({3}))  # a real pause: a straggler
    assert clock.recent[-1] == 0.010
    assert clock.proposal is not None and clock.proposal < 0.05
    # Late past the skew in 6 of the last 8 stages, it is slow: the bound follows it.
    for _ in range(5):
        clock.observe(0.400, 1.0, others=0.010, late=frozenset({3}))
        assert clock.recent[-1] == 0.010
    clock.observe(0.400, 1.0, others=0.010, late=frozenset({3}))
    assert clock.recent[-1] == 0.400


def test_a_random_rank_late_in_half_of_the_stages_is_still_a_straggler() -> None:
    """One random rank of four paused at every step (the soak's pause model, seed 31: rank
    1 in 4 of 8 stages by chance): at half the stages it was taken for a slower machine, its
    pauses counted whole and the floor rose past every pause. Below three quarters each
    pause counts as the others' time."""
    clock = StageClock(warmup=2, slack=0.0, headroom=100.0, min_deadline=0.010)
    for _ in range(2):
        clock.observe(0.010, 1.0)
    for late in (1, 2, 1, 3, 1, 1, 0, 1, 2):  # rank 1 in 5 of 9
        clock.observe(0.400, 1.0, others=0.010, late=frozenset({late}))
        assert clock.recent[-1] == 0.010
    assert clock.proposal is not None and clock.proposal < 0.05


def test_the_deadline_stays_within_its_floor_and_ceiling() -> None:
    clock = StageClock(warmup=2, headroom=1.0, min_deadline=0.02)
    clock.observe(0.001, 1.0)
    clock.observe(0.001, 1.0)
    clock.heard(1, 0.001, 0.001)
    assert clock.deadline() == 0.02  # a fast stage still gets the floor
    for _ in range(50):
        clock.observe(1.0, 0.5)  # much slower than in warm-up: capped at the ceiling
    assert clock.deadline() == pytest.approx(max(clock.bound, 0.02))  # type: ignore[arg-type]


# -- layout and rotation ----------------------------------------------------------------------
def test_layout_gives_the_extra_elements_to_the_first_shards() -> None:
    lay = Layout(10, 3, 2)
    assert lay.shards == [(0, 4), (4, 7), (7, 10)]
    assert lay.slices_of(1) == [(4, 6), (6, 7)]
    assert lay.tail_index(0) == 1  # float ratio: the last slice of two is a tail slice


def test_hadamard_toy_example() -> None:
    rot = Rotation(4, signs=np.array([1, -1, 1, 1]))
    y = rot.forward(np.array([8.0, 0, 0, 0]))
    np.testing.assert_allclose(y, [4, 4, 4, 4])
    for drop in range(4):  # whichever coordinate is lost, the error is ±2 everywhere
        lost = y.copy()
        lost[drop] = 0
        err = rot.inverse(lost) - np.array([8.0, 0, 0, 0])
        np.testing.assert_allclose(np.abs(err), [2, 2, 2, 2])
    lost = y.copy()
    lost[-1] = 0
    np.testing.assert_allclose(rot.inverse(lost), [6, -2, 2, -2])


@pytest.mark.parametrize("length", [1, 3, 1000, 1024, 5001, 1 << 17])
def test_rotation_round_trip_and_norm(length: int) -> None:
    x = np.random.default_rng(length).standard_normal(length)
    rot = Rotation(length, seed=5)
    y = rot.forward(x)
    assert rot.padded - length < 32  # padding never doubles a long vector
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x))
    np.testing.assert_allclose(rot.inverse(y), x, atol=1e-12)
    assert Rotation(length, seed=5).forward(x).tolist() == y.tolist()  # same seed, same map
    into = np.full(rot.padded, np.nan)  # a reused buffer: every entry written, padding too
    assert rot.forward(x, out=into) is into and into.tolist() == y.tolist()
    with pytest.raises(ValueError, match="out must be"):
        rot.forward(x, out=np.empty(rot.padded, np.float32))


@pytest.mark.parametrize(("length", "parts"), [(1, 3), (10, 4), (5001, 3), (1 << 17, 7)])
def test_a_rotation_in_parts_is_undone_part_by_part(length: int, parts: int) -> None:
    """Each part is mixed on its own, so its owner can rotate just that part back: the parts'
    inverses, put together, are the whole inverse, and each part holds only its own entries."""
    x = np.random.default_rng(length).standard_normal(length)
    rot = Rotation(length, seed=3, parts=parts)
    y = rot.forward(x)
    assert rot.padded == rot.part * parts
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x))
    back = y.copy()
    for k in range(parts):
        rot.inverse_part(k, back[k * rot.part:(k + 1) * rot.part])
    np.testing.assert_allclose(back[:length], x, atol=1e-12)
    np.testing.assert_allclose(back[length:], 0, atol=1e-12)  # the padding stays empty
    np.testing.assert_allclose(rot.inverse(y), x, atol=1e-12)
    only_first = np.where(np.arange(length) < rot.part, x, 0)  # part 0's entries alone
    np.testing.assert_allclose(rot.forward(only_first)[rot.part:], 0, atol=1e-12)
    with pytest.raises(ValueError, match="part"):
        rot.inverse_part(parts, back[: rot.part])
    by_part = np.full(rot.padded, np.nan)
    for k in reversed(range(parts)):  # any order: each part reads only its own entries
        rot.forward_part(k, x, by_part)
    np.testing.assert_array_equal(by_part, y)
    with pytest.raises(ValueError, match="part"):
        rot.forward_part(parts, x, by_part)


def _sylvester(n: int) -> np.ndarray:
    """The orthonormal ``n × n`` Sylvester Hadamard matrix, built the obvious way."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


@pytest.mark.parametrize(("length", "parts"), [(1 << 15, 1), (1 << 15, 4), (30_001, 3)])
def test_the_banded_butterfly_is_the_whole_vector_product(
        length: int, parts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small bands, so these vectors take many: with and without padding (the first case
    # applies the signs as each band is read), forward, inverse and inverse_part.
    monkeypatch.setattr(hadamard_module, "_BAND", 2048)
    x = np.random.default_rng(length).standard_normal(length)
    rot = Rotation(length, seed=9, parts=parts)
    cols = rot.part // rot.a
    assert rot.a == 32 and cols > hadamard_module._BAND // rot.a  # several bands per part
    z = np.zeros(rot.padded)
    z[:length] = x * rot.signs(np.dtype(np.float64))[:length]
    want = _sylvester(rot.a) @ z.reshape(parts, rot.a, cols)
    y = rot.forward(x)
    np.testing.assert_allclose(y, want.reshape(-1), rtol=0, atol=1e-12)
    np.testing.assert_allclose(rot.inverse(y), x, rtol=0, atol=1e-12)
    for k in range(parts):
        part = y[k * rot.part:(k + 1) * rot.part].copy()
        rot.inverse_part(k, part)
        np.testing.assert_allclose(part, np.r_[x, np.zeros(rot.padded - length)][
            k * rot.part:(k + 1) * rot.part], rtol=0, atol=1e-12)


def test_rotation_spreads_a_lost_tail() -> None:
    """The reference's numbers: the last 5 % of x is 30x larger; lose the last 1 % of the
    sent vector. Without rotation that wipes out real entries; with it the error is small
    and spread out, and the decode is about (1 - p) x."""
    x = np.random.default_rng(0).standard_normal(4096)
    x[-205:] *= 30
    rot = Rotation(4096, seed=1)
    y = rot.forward(x)
    cut = y.copy()
    cut[-41:] = 0
    plain = x.copy()
    plain[-41:] = 0
    err_rot = rot.inverse(cut) - x
    err_plain = plain - x
    assert np.abs(err_rot).max() < np.abs(err_plain).max() / 10
    assert float(rot.inverse(cut) @ x / (x @ x)) == pytest.approx(1 - 41 / 4096, abs=0.01)


async def test_integer_vectors_with_the_rotation_are_refused_naming_the_rank() -> None:
    net = MemoryNetwork(3)
    sessions = [Transpose(hadamard=True, deadline=D).open(c) for c in net.comms]
    ints = [np.arange(6) * (r + 1) for r in range(3)]
    for rank, res in enumerate(await run_step(net, sessions, 0, ints)):
        assert isinstance(res, TypeError) and f"rank {rank}:" in str(res)
        assert "hadamard=False" in str(res)
    # Never rotated: the corrected retry works. (Each at a step of its own: the comms' floor
    # is past a step once it ended, and a frame of it that comes before its receive is
    # posted, as sends start at once, is dropped as stale.)
    for step, hadamard in ((1, False), (2, "after_loss")):
        plain = [Transpose(hadamard=hadamard, deadline=D).open(c) for c in net.comms]
        for res in await run_step(net, plain, step, ints):
            assert isinstance(res, Result) and res.value.tolist() == (np.arange(6) * 6).tolist()


async def test_only_steps_after_a_loss_rotate_and_ranks_that_disagree_still_sum_exactly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """hadamard="after_loss" (the default): a calm step rotates nothing; a loss makes the
    next block of rotate_steps steps rotate, on every rank that saw it or heard of it (the
    phase-1 meta tells) before that block began. A rank told too late does not rotate then:
    an owner brings each sender's copy to its own state, so those mixed steps are exact."""
    net = MemoryNetwork(4)
    sessions = [Transpose(deadline=D, max_loss=1.0, slice_bytes=4096, rotate_steps=2).open(c)
                for c in net.comms]
    rotated: list[tuple[int, int]] = []  # (step, rank) of every forward rotation
    forward = hadamard_module.Rotation.forward_part
    step_now = [0]

    def counted(self: Rotation, k: int, x: np.ndarray, out: np.ndarray) -> None:
        rank = next(r for r, s in enumerate(sessions) if s._rotation is self)
        rotated.append((step_now[0], rank))
        forward(self, k, x, out)

    monkeypatch.setattr(hadamard_module.Rotation, "forward_part", counted)
    rng = np.random.default_rng(3)
    for step in range(8):
        step_now[0] = step
        if step in (1, 4):  # owner 2's reduced shard never reaches rank 0: only rank 0 sees it
            net.lose(2, 0, PHASE2_TAG)
        xs = [rng.standard_normal(10_007) for _ in range(4)]
        want = np.sum(xs, axis=0)
        results = await run_step(net, sessions, step, xs)
        if step in (1, 4):
            net._lost_tags.clear()
            assert isinstance(results[0], Result) and results[0].stand_in == [2]
            continue
        for res in results:
            assert isinstance(res, Result) and res.exact
            assert np.abs(res.value - want).max() < 1e-9 * np.abs(want).max()
    # Step 1 is the last of block 0: the others hear of its loss only in block 1 (steps 2
    # and 3), which rank 0 rotates alone. Step 4 begins block 2: all hear of it at step 5,
    # and all rotate in block 3 (steps 6 and 7).
    want = [(2, 0), (3, 0)] + [(s, r) for s in (6, 7) for r in range(4)]
    assert sorted({(s, r) for s, r in rotated}) == sorted(want)


# -- a stage past its deadline -------------------------------------------------------------
async def test_a_stage_waits_past_its_deadline_while_its_missing_sender_delivers() -> None:
    loop = asyncio.get_running_loop()
    done, late = loop.create_future(), loop.create_future()
    done.set_result(None)
    stage = Stage([Slot(1, 0, 10, done), Slot(1, 1, 10, late, tail=True)], 20)
    asked: list[int] = []

    def heard(src: int) -> float:  # asked only once the deadline has passed
        asked.append(src)
        if not late.done():  # rank 1's last slice lands while the stage waits on
            loop.call_soon(late.set_result, None)
        return time.perf_counter()  # its bytes are flowing right now

    await stage.run(0.01, idle=60.0, grace=1000.0, heard=heard)
    assert asked == [1] and stage.extended and stage.reason == "complete"
    assert stage.fraction == 1.0


async def test_a_silent_or_unstarted_sender_gets_no_grace() -> None:
    loop = asyncio.get_running_loop()
    for delivered_before in (True, False):
        first, last = loop.create_future(), loop.create_future()
        slots = [Slot(2, 0, 10, first), Slot(2, 1, 10, last, tail=True)]
        if delivered_before:  # it sent one slice at the start of the stage, then nothing
            first.set_result(None)
        stage = Stage(slots if delivered_before else slots[1:], 20 if delivered_before else 10)
        await stage.run(0.01, idle=0.001, grace=1000.0, heard=lambda _src: 0.0)
        assert stage.reason == "deadline" and not stage.extended, delivered_before
        assert not last.done() or last.cancelled()


# -- early close --------------------------------------------------------------------------
async def test_a_stage_closes_early_once_the_tails_come_in_and_the_senders_go_quiet() -> None:
    """Rank 1 skipped slice 0 (it will not send it now) and its tail lands while the stage
    waits: the stage ends early, long before its deadline, without slice 0."""
    loop = asyncio.get_running_loop()
    skipped, tail = loop.create_future(), loop.create_future()
    stage = Stage([Slot(1, 0, 10, skipped), Slot(1, 1, 10, tail, tail=True)], 20)
    loop.call_soon(tail.set_result, None)
    await asyncio.wait_for(stage.run(600.0, idle=0.001), 60)
    assert stage.reason == "early" and stage.fraction == 0.5
    assert skipped.cancelled()  # withdrawn: its buffer is not written any more


async def test_an_optional_sender_is_not_waited_for_and_a_silent_one_is_named() -> None:
    """Stage 2 lists the owners that sent nothing in stage 1 as optional: once the others'
    tails are in and they go quiet, the stage closes early without the optional one."""
    loop = asyncio.get_running_loop()
    first = Stage([Slot(1, 0, 10, loop.create_future(), tail=True),
                   Slot(2, 0, 10, loop.create_future(), tail=True)], 20)
    first.slots[0].future.set_result(None)
    await first.run(0.001, idle=600.0)
    assert first.reason == "deadline" and first.silent() == {2}
    # Bytes heard from rank 2 since the stage began: it runs, only slowly; not silent.
    assert first.silent(lambda _src: time.perf_counter()) == frozenset()
    from1, from2 = loop.create_future(), loop.create_future()
    second = Stage([Slot(1, 0, 10, from1, tail=True), Slot(2, 0, 10, from2, tail=True)], 20,
                   optional=first.silent())
    loop.call_soon(from1.set_result, None)
    await asyncio.wait_for(second.run(600.0, idle=0.001), 60)
    assert second.reason == "early" and second.fraction == 0.5 and from2.cancelled()


async def test_a_stage_knows_how_long_the_senders_that_did_send_took() -> None:
    loop = asyncio.get_running_loop()
    first, second, never, silent = (loop.create_future() for _ in range(4))
    stage = Stage([Slot(1, 0, 10, first), Slot(1, 1, 10, second, tail=True),
                   Slot(2, 0, 20, silent, tail=True)], 40)
    loop.call_later(0.003, first.set_result, None)
    loop.call_later(0.005, second.set_result, None)
    await stage.run(0.02, idle=600.0)
    assert stage.reason == "deadline" and stage.silent() == {2}
    assert stage.elapsed == pytest.approx(0.02, abs=1e-4)
    assert stage.others_took(stage.silent()) == pytest.approx(0.005, abs=1e-4)
    assert stage.others_took(frozenset({1, 2})) is None  # nobody else to learn from
    # Rank 1 sent one slice of two before it went quiet: its whole would need elapsed / 0.5.
    stage = Stage([Slot(1, 0, 10, first), Slot(1, 1, 10, never, tail=True),
                   Slot(2, 0, 20, loop.create_future(), tail=True)], 40)
    await stage.run(0.02, idle=600.0)
    assert stage.silent() == {2}
    assert stage.others_took(stage.silent()) == pytest.approx(2 * stage.elapsed)


async def test_a_stage_names_the_senders_late_to_start_when_the_others_were_in() -> None:
    """Rank 2 sent nothing until rank 1's slices were all in, then its slice came: the stage
    is complete, names rank 2 and the others' time. One whose bytes were heard before the
    others were in is not late to start (slow data); a stage cut at its deadline has
    ``silent`` instead."""
    loop = asyncio.get_running_loop()
    for bytes_heard in (False, True):
        a, b, late = (loop.create_future() for _ in range(3))
        stage = Stage([Slot(1, 0, 10, a), Slot(1, 1, 10, b, tail=True),
                       Slot(2, 0, 20, late, tail=True)], 40)
        loop.call_later(0.002, a.set_result, None)
        loop.call_later(0.004, b.set_result, None)
        loop.call_later(0.050, late.set_result, None)
        heard = (lambda _src: time.perf_counter()) if bytes_heard else (lambda _src: 0.0)
        await stage.run(1.0, idle=600.0, heard=heard)
        assert stage.reason == "complete" and stage.fraction == 1.0
        if bytes_heard:
            assert stage.late_start() is None
        else:
            got = stage.late_start()
            assert got is not None and got[0] == {2}
            assert got[1] == pytest.approx(0.004, abs=1e-4)
    cut = Stage([Slot(1, 0, 10, loop.create_future())], 10)
    await cut.run(0.001, idle=600.0)
    assert cut.reason == "deadline" and cut.late_start() is None


async def test_a_sender_cut_while_silent_is_told_the_step() -> None:
    """Over lanes a rank far behind would learn of its peers' step only once it had read its
    way there, cut at every step meanwhile: after stage 1 the others tell it (Links.tell)."""
    net = MemoryNetwork(3)
    sessions = [Transpose(hadamard=False, warmup=2, max_loss=1.0).open(c) for c in net.comms]
    told: list[tuple[int, int, int]] = []
    def teller(rank: int) -> Callable[[int, int], None]:
        return lambda peer, step: told.append((rank, peer, step))

    for rank, s in enumerate(sessions):
        s.links.tell = teller(rank)  # type: ignore[method-assign]
    xs = [X0, 10 * X0, 100 * X0]
    for step in range(2):
        await run_step(net, sessions, step, xs)
    assert told == []  # nobody cut
    early = [asyncio.ensure_future(s.step(2, np.zeros(6), _ready(x)))
             for s, x in zip(sessions[:2], xs[:2], strict=True)]
    await asyncio.wait(early)
    assert all(2 in t.result().stand_in for t in early)  # rank 2 was cut: the path meant
    assert sorted(told) == [(0, 2, 2), (1, 2, 2)]
    await sessions[2].step(2, np.zeros(6), _ready(xs[2]))


@pytest.mark.parametrize("told", [False, True])
async def test_a_rank_far_behind_jumps_past_the_step_its_peers_cut_it_at(told: bool) -> None:
    """Steps behind (behind_steps), a rank jumps to its peers' newest step; to the one after,
    where they told it they went on without it at that step (they are past it by the time
    its vector for it is ready: jumping there, it was cut step after step, one behind)."""
    net = MemoryNetwork(3)
    sessions = [Transpose(hadamard=False, warmup=2, max_loss=1.0).open(c) for c in net.comms]
    xs = [X0, 10 * X0, 100 * X0]
    await run_step(net, sessions, 0, xs)
    links = sessions[2].links
    assert isinstance(links, CommLinks) and links.cut_at == -1
    links.newest, links.cut_at = 7, (7 if told else 5)
    with pytest.raises(FellBehind) as info:
        await sessions[2].step(1, np.zeros(6), _ready(xs[2]))
    assert info.value.current_step == (8 if told else 7)


async def test_a_straggler_cut_in_a_step_does_not_raise_the_next_bounds() -> None:
    """Ranks 0 and 1 cut rank 2, which starts step 2 long after them; their stage clocks
    learn how long their own exchange took, not the deadline they waited."""
    net = MemoryNetwork(3)
    sessions = [Transpose(hadamard=False, warmup=2, max_loss=1.0).open(c) for c in net.comms]
    xs = [X0, 10 * X0, 100 * X0]
    for step in range(2):  # warm-up: everything waited for
        assert all(isinstance(r, Result) and r.exact
                   for r in await run_step(net, sessions, step, xs))
    before = [s.clocks[0].estimate for s in sessions[:2]]
    assert max(before) < 0.001
    early = [asyncio.ensure_future(s.step(2, np.zeros(6), _ready(x)))
             for s, x in zip(sessions[:2], xs[:2], strict=True)]
    await asyncio.wait(early)
    for task in early:
        res = task.result()
        assert 2 in res.stand_in and not res.exact  # rank 2 was cut: the path meant
    assert res.deadline >= sessions[0].opts.min_deadline
    for session, was in zip(sessions[:2], before, strict=True):
        # (elapsed / fraction would have taught at least min_deadline x 2 at gain 1/8)
        assert session.clocks[0].estimate < was + 0.001
    late = await sessions[2].step(2, np.zeros(6), _ready(xs[2]))
    assert isinstance(late, Result)


async def test_a_stage_hands_over_each_slice_as_it_arrives_while_it_is_open() -> None:
    """on_arrival (the session adds slices as they come): called with every slot that lands
    before the stage ends, the one already in at the start included, never with one that
    did not come."""
    loop = asyncio.get_running_loop()
    before, during, never = (loop.create_future() for _ in range(3))
    before.set_result(None)
    got: list[int] = []
    stage = Stage([Slot(1, 0, 10, before), Slot(2, 0, 10, during), Slot(3, 0, 10, never)],
                  30, on_arrival=lambda slot: got.append(slot.src))
    loop.call_soon(during.set_result, None)
    await stage.run(0.01, idle=600.0)
    assert stage.reason == "deadline" and sorted(got) == [1, 2] and never.cancelled()


async def test_a_reduced_slice_goes_out_as_soon_as_every_copy_of_it_is_in() -> None:
    """Without the rotation, phase 2 of a slice overlaps the rest of stage 1: owner 0 has
    both copies of its slice 0 at once but never gets rank 1's slice 1, and sends the reduced
    slice 0 to every rank while its stage 1 still waits for slice 1; that slice is exact on
    every rank, marked complete."""
    net = MemoryNetwork(3)
    x0 = np.arange(12.0)
    sessions = [Transpose(hadamard=False, deadline=D, max_loss=1.0, slice_bytes=16).open(c)
                for c in net.comms]  # shards of 4 entries, slices of 2
    net.lose(1, 0, 1)  # rank 1's slice 1 of shard 0 never reaches its owner
    step = asyncio.ensure_future(run_step(net, sessions, 0, [x0, 10 * x0, 100 * x0]))
    await asyncio.wait_for(net.until_sent(0, 1, 0, PHASE2_TAG), 30)
    assert not step.done() and (0, 1, 0, PHASE2_TAG + 1) not in net.sent  # stage 1 waits
    for res in await step:
        assert isinstance(res, Result)
        assert res.value[:2].tolist() == (111 * x0[:2]).tolist()  # the early slice, exact


def test_slices_follow_the_hosts_unless_chosen() -> None:
    from aioreduce.schemes.transpose import HOSTS_SLICE_BYTES, SLICE_BYTES

    assert Transpose().slices(False) == SLICE_BYTES == 4 << 20
    assert Transpose().slices(True) == HOSTS_SLICE_BYTES == 1 << 20
    assert Transpose(slice_bytes=4096).slices(True) == 4096
    with pytest.raises(ValueError, match="slice_bytes"):
        Transpose(slice_bytes=0)


async def test_in_place_a_cut_reduced_slice_keeps_what_landed_and_stands_in_after_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In place without the rotation, over links that lend (lanes), the reduced slices land
    over the lent vector in whole elements; a cut one keeps the elements that landed (the
    owner's sum) and takes this rank's own values, N times, after them only. Here owner 2's
    slice [4, 6) never reaches rank 0 and the links say one element of it landed: entry 4 is
    left as the links wrote it (nothing, in this network: rank 0's own 5), entry 5 is 3 x 6."""
    lending = Lending(monkeypatch, answered=True)
    landed: list[tuple[int, int, int]] = []

    def one_landed(_links: CommLinks, src: int, step: int, tag: int) -> int:
        landed.append((src, step, tag))
        return 8  # bytes: one float64

    monkeypatch.setattr(CommLinks, "landed", one_landed)
    net = MemoryNetwork(3)
    sessions = [Transpose(hadamard=False, deadline=D, max_loss=1.0).open(c) for c in net.comms]
    xs = [X0.copy(), 10 * X0, 100 * X0]
    net.lose(2, 0, PHASE2_TAG)
    r0, r1, r2 = await run_step_to(net, sessions, 0, xs)
    assert landed == [(2, 0, PHASE2_TAG)]  # the path under test: asked for the cut slice
    assert lending.sent and lending.released == 3
    for res in (r1, r2):
        assert isinstance(res, Result) and res.exact
    assert isinstance(r0, Result) and r0.stand_in == [2] and np.shares_memory(r0.value, xs[0])
    assert r0.value.tolist() == pytest.approx([111, 222, 333, 444, 5, 3 * 6])


async def test_the_safety_valve_names_a_rank_whose_links_broke_as_lost() -> None:
    """A rank dead in a step fails it on every live rank with the dead rank named lost, not
    only missing: healing (``aioreduce.heal``) waits for a replacement of ranks known dead,
    and a rank that took a death for a straggler would go on while its peers wait."""
    net, sessions = valve()
    net.kill(2)
    results = await run_step(net, sessions, 0, [X0, 10 * X0, 100 * X0])
    for res in results[:2]:
        assert isinstance(res, StragglerError) and res.missing == [2] and res.lost == [2], res
    # a slice lost on a live link is missing, not lost
    net, sessions = valve()
    net.lose(0, 1, 0)
    results = await run_step(net, sessions, 0, [X0, 10 * X0, 100 * X0])
    assert all(isinstance(r, StragglerError) and r.lost == [] for r in results), results
