"""A kept (dormant) session stays out of the running scheme's frames.

A coded tree's session is kept while gradient coding runs on the same 13 ranks: gradient
coding's master (rank 0) sends its results to ranks 1-3, which are also the tree's children of
rank 0, so the tree's early handlers would take those results for their own next step and
forward them down the tree. Gated, the dormant session sends nothing; the test also shows
that ungated it does (so the count checks the path).
"""

from __future__ import annotations

import asyncio

import pytest

from aioreduce.codes import default_code
from aioreduce.schemes import CodedTree, GradientCoding
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
            g.dormant_from = 1 if gated else None
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
