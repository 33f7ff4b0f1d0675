"""A kept (dormant) session stays out of the running scheme's frames.

And a session hears the frames of its own steps that peers sent before this rank opened (or
woke) it: ranks switch at the same step, not at the same moment.

A coded tree's session is kept while gradient coding runs on the same 13 ranks: gradient
coding's master (rank 0) sends its results to ranks 1-3, which are also the tree's children of
rank 0, so the tree's early handlers would take those results for their own next step and
forward them down the tree. Gated, the dormant session sends nothing; the test also shows
that ungated it does (so the count checks the path).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aioreduce.codes import default_code
from aioreduce.errors import VectorMismatch
from aioreduce.schemes import CodedTree, GradientCoding, Ring
from aioreduce.schemes.dormant import GatedComm
from aioreduce.transport.memory import MemoryNetwork

from .memjob import Job

WORLD = 13


async def _frames_sent_by_gc_steps(kept_tree: bool, gated: bool) -> int:
    net = MemoryNetwork(WORLD)
    gates = [GatedComm(c) for c in net.comms]
    if kept_tree:
        tree = Job(CodedTree(3, 2, 1), WORLD, net, comms=gates)
        tree.assert_exact(0, await tree.run(0))
        for g in gates:
            if gated:
                g.sleep(1)
    gc = Job(GradientCoding(default_code(WORLD - 1, 1)), WORLD, net)
    before = len(net.sent)
    for step in (1, 2, 3):
        # Rank 1 starts late: the master decodes without it and its result reaches rank 1
        # before rank 1 posts the receive, so it is offered to early handlers there.
        tasks = gc.start(step, [r for r in range(WORLD) if r != 1])
        await tasks[0]
        tasks.update(gc.start(step, [1]))
        await asyncio.wait(tasks.values())
        gc.assert_exact(step, {r: t.result() for r, t in tasks.items()})
    return len(net.sent) - before


@pytest.mark.parametrize("gated", [True, False])
async def test_a_dormant_session_sends_nothing_while_another_scheme_runs(gated: bool) -> None:
    alone = await _frames_sent_by_gc_steps(kept_tree=False, gated=False)
    beside = await _frames_sent_by_gc_steps(kept_tree=True, gated=gated)
    if gated:
        assert beside == alone
    else:  # what the gate prevents: the tree forwarding gradient coding's results
        assert beside > alone


@pytest.mark.parametrize("late", ["opened", "woken"])
async def test_a_rank_that_switches_last_still_hears_that_the_step_failed(late: str) -> None:
    """Ranks 1 and 2 start step 3 of a ring while rank 0 has not switched to it yet; rank 1's
    vector is two elements longer, so rank 2 fails the step and tells everyone. Rank 0's
    session comes after the abort, and must raise the same error rather than wait for ever
    for rank 2's next segment."""
    net = MemoryNetwork(3)
    gates = [GatedComm(c, first_step=0 if late == "woken" else 3) for c in net.comms]
    sessions = [Ring().open(g) for g in gates]
    if late == "woken":  # all three ran the ring, then something else from step 1
        for g in gates:
            g.sleep(1)
        for g in gates[1:]:
            g.wake(3)

    async def step(rank: int) -> object:
        own: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        own.set_result(np.ones(11 if rank == 1 else 9))  # its first segment: 4, not 3
        try:
            return await sessions[rank].step(3, np.zeros(9), own)
        except VectorMismatch as exc:
            return exc

    async with asyncio.timeout(10):
        first = await asyncio.gather(step(1), step(2))
    assert all(isinstance(e, VectorMismatch) and e.ranks == [1, 2] for e in first), first
    await asyncio.gather(*(s.close(1.0) for s in sessions[1:]))  # the aborts are sent
    if late == "woken":
        gates[0].wake(3)
    else:
        sessions[0] = Ring().open(gates[0])
    async with asyncio.timeout(10):  # only a hang takes this long
        last = await step(0)
    assert isinstance(last, VectorMismatch) and last.ranks == [1, 2], last
    assert str(last) == str(first[1])  # rank 2's words, on every rank
