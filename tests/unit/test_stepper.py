"""The stepper (aioreduce.stepper): what a failed step leaves behind."""

from __future__ import annotations

import asyncio
import weakref

import numpy as np
import pytest

from aioreduce.schemes import Result, StragglerError
from aioreduce.stepper import Stepper
from aioreduce.straggle import StraggleModel


class _Buffers:
    """Stands in for a step's buffers (numpy arrays take no weak references)."""


class _FailingSession:
    """A session whose step fails while its frame holds the step's buffers."""

    def __init__(self) -> None:
        self.held: weakref.ref[_Buffers] | None = None

    def known(self, step: int) -> bool:
        return False

    async def step(self, step: int, like: np.ndarray, own: asyncio.Future[np.ndarray]
                   ) -> Result:
        buffers = _Buffers()
        self.held = weakref.ref(buffers)
        raise StragglerError(step, [1], "cut")


async def test_a_failed_steps_buffers_are_freed_once_its_error_is_dropped() -> None:
    # Kept by the stepper's frame, the error and its traceback formed a cycle that held the
    # step's buffers until Python's collector ran (off during unit tests: conftest.py), so
    # a pool took fresh memory for the next steps, which ran late and were cut in turn.
    steps = Stepper(0, 2, StraggleModel(), None, None)
    session = _FailingSession()
    with pytest.raises(StragglerError):
        await steps.run(session, "failing", np.ones(4))  # type: ignore[arg-type]
    assert session.held is not None and session.held() is None


async def test_the_step_after_a_raised_transpose_step_reuses_its_buffers() -> None:
    # The consequence measured: with the error kept, the step after a raised one took all
    # its buffers afresh (0 of 3 reused on every rank), as the pool saw them still held.
    from aioreduce.schemes import Transpose
    from aioreduce.transport.memory import MemoryNetwork

    net = MemoryNetwork(3)
    scheme = Transpose(hadamard=False, deadline=0.5, max_loss=0.01, lanes=False)
    sessions = [scheme.open(c) for c in net.comms]
    steppers = [Stepper(r, 3, StraggleModel(), None, None) for r in range(3)]
    x = np.arange(300, dtype=np.float64)

    async def step_all() -> list[object]:
        async def one(r: int) -> object:
            try:
                return await steppers[r].run(sessions[r], "transpose", x.copy())
            except StragglerError as exc:
                return exc.missing
        return list(await asyncio.gather(*(one(r) for r in range(3))))

    for _ in range(2):
        await step_all()
    net.lose(0, 1, 0)  # rank 0's slice of shard 1: 1/9 of the sum missing, > max_loss
    assert await step_all() == [[0], [0], [0]]  # raised on every rank (the path meant)
    before = [s.pool.reused for s in sessions]
    await step_all()
    assert [s.pool.reused - b for s, b in zip(sessions, before, strict=True)] == [3, 3, 3]
