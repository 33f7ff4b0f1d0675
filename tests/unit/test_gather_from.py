"""``rendezvous._gather_from``, the wait under rendezvous and every barrier: one control event
from each rank, woken once a round by whatever can change the answer (a receive that ends,
``stop``, a misconfiguration that excuses ranks), over a mesh stand-in in one process."""

from __future__ import annotations

import asyncio
import time

import pytest

from aioreduce.errors import RendezvousError
from aioreduce.transport.rendezvous import _gather_from
from aioreduce.wire.control import Arrive, Control, Register


class _Mesh:
    """What ``_gather_from`` uses of a mesh: per-rank control queues and the
    ``misconfigured`` event."""

    def __init__(self, ranks: list[int]) -> None:
        self.queues: dict[int, asyncio.Queue[Control]] = {r: asyncio.Queue() for r in ranks}
        self.misconfigured = asyncio.Event()
        self.rank = 0
        self.receives = 0

    async def recv_control(self, rank: int) -> Control:
        self.receives += 1
        return await self.queues[rank].get()


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_every_rank_gathered_as_they_come_one_receive_each() -> None:
    mesh = _Mesh([1, 2, 3])
    task = asyncio.ensure_future(_gather_from(mesh, [1, 2, 3], Arrive,  # type: ignore[arg-type]
                                              time.monotonic() + 60))
    for r in (3, 1, 2):  # one at a time: a round each
        await _turns()
        assert not task.done()
        mesh.queues[r].put_nowait(Arrive(7))
    got = await task
    assert got == {1: Arrive(7), 2: Arrive(7), 3: Arrive(7)}
    assert mesh.receives == 3


async def test_a_rank_excused_by_a_misconfiguration_is_not_waited_for() -> None:
    mesh = _Mesh([1, 2])
    excused: dict[int, str] = {}
    task = asyncio.ensure_future(_gather_from(mesh, [1, 2], Register,  # type: ignore[arg-type]
                                              time.monotonic() + 60, excused=excused))
    mesh.queues[1].put_nowait(Register("h", 1, 3))
    await _turns()
    assert not task.done()
    excused[2] = "other-job"  # what the mesh records before it sets the event
    mesh.misconfigured.set()
    got = await task
    assert list(got) == [1]


async def test_stop_returns_what_came_so_far() -> None:
    mesh = _Mesh([1, 2])
    stop: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(_gather_from(mesh, [1, 2], Arrive,  # type: ignore[arg-type]
                                              time.monotonic() + 60,
                                              stop=stop))  # type: ignore[arg-type]
    mesh.queues[2].put_nowait(Arrive(0))
    await _turns()
    stop.set_result(None)
    assert await task == {2: Arrive(0)}


async def test_past_the_deadline_the_missing_ranks_are_named() -> None:
    mesh = _Mesh([1, 2])
    mesh.queues[1].put_nowait(Arrive(0))
    with pytest.raises(RendezvousError) as err:  # (the deadline's own timer ends the wait)
        await _gather_from(mesh, [1, 2], Arrive,  # type: ignore[arg-type]
                           time.monotonic() + 0.05)
    assert err.value.missing == [2] and "did not reach barrier" in str(err.value)
