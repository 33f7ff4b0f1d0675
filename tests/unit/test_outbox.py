"""The outbox starts a send at once and follows it in a task only if it has to wait."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from aioreduce.schemes.outbox import Outbox, _Rest


class _Comm:
    """Records sends; a send waits on ``gate`` while one is set (a full socket)."""

    rank = 0

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []  # (peer, step)
        self.gate: asyncio.Future[None] | None = None
        self.cleaned: list[tuple[int, int]] = []
        self.fail = False

    async def send(self, rank: int, array: np.ndarray, *, step: int, tag: int = 0,
                   meta: dict[str, Any] | None = None) -> None:
        if self.fail:
            raise ConnectionError("gone")
        self.sent.append((rank, step))
        try:
            if self.gate is not None:
                await self.gate
        finally:
            self.cleaned.append((rank, step))


def _outbox() -> tuple[_Comm, Outbox]:
    comm = _Comm()
    return comm, Outbox(comm)  # type: ignore[arg-type]


def _tasks(box: Outbox, peer: int) -> list[asyncio.Task[None]]:
    return [p.task for p in box._pending[peer] if p.task is not None]


async def test_a_send_that_does_not_wait_leaves_nothing_behind() -> None:
    comm, box = _outbox()
    tasks = len(asyncio.all_tasks())
    assert box.send(1, np.zeros(4), step=0, tag=0)
    assert comm.sent == [(1, 0)]  # sent before the call returned, not a turn later
    assert box._pending[1] == [] and len(asyncio.all_tasks()) == tasks


async def test_a_waiting_send_goes_on_in_a_task_and_later_ones_follow_it_in_order() -> None:
    comm, box = _outbox()
    gate = comm.gate = asyncio.get_running_loop().create_future()
    box.send(1, np.zeros(4), step=0, tag=0)
    comm.gate = None
    box.send(1, np.zeros(4), step=1, tag=0)  # behind the waiting one: in a task
    box.send(2, np.zeros(4), step=1, tag=0)  # another peer: at once
    assert comm.sent == [(1, 0), (2, 1)]
    assert [p.step for p in box._pending[1]] == [0, 1] and box._pending[2] == []
    tasks = _tasks(box, 1)
    gate.set_result(None)
    await asyncio.gather(*tasks)  # (their done-callbacks, the outbox's first, ran by now)
    # Peer 1's frames left in the order they were given (step 0's was with the transport,
    # waiting for room, when step 1's went).
    assert comm.sent == [(1, 0), (2, 1), (1, 1)] and box._pending[1] == []


async def test_close_cancels_a_waiting_send_which_cleans_up() -> None:
    comm, box = _outbox()
    comm.gate = asyncio.get_running_loop().create_future()
    box.send(1, np.zeros(4), step=0, tag=0)
    tasks = _tasks(box, 1)
    assert comm.cleaned == [] and len(tasks) == 1
    await box.close(timeout=0)
    await asyncio.gather(*tasks, return_exceptions=True)
    assert tasks[0].cancelled()
    assert comm.cleaned == [(1, 0)]  # the send's own finally ran: cancelled, not lost
    assert box._pending[1] == []


async def test_a_send_that_fails_at_once_is_dropped_as_a_failed_task_was() -> None:
    comm, box = _outbox()
    comm.fail = True
    assert box.send(1, np.zeros(4), step=0, tag=0)
    assert box._pending[1] == []


def test_the_rest_of_a_send_closed_unfinished_closes_its_coroutine() -> None:
    closed = []

    async def send() -> None:
        try:
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        finally:
            closed.append(True)

    coro = send()
    waiting = coro.send(None)  # (the first step, as Outbox.send runs it)
    rest = _Rest(coro, waiting).__await__()
    next(rest)
    rest.close()  # (as a never-finished task's generator is, when it is collected)
    assert closed == [True]
