"""The stepper (aioreduce.stepper): what a failed step leaves behind."""

from __future__ import annotations

import asyncio
import gc
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
    # step's buffers until Python's collector ran: with the collector moved between steps
    # (the transpose), a pool took fresh memory for each next step, whose page faults made
    # it late and cut in turn (4 ranks on 2 cores, 16 MiB: 4 MiB slices read in 35-60 ms).
    was = gc.isenabled()
    gc.disable()
    try:
        steps = Stepper(0, 2, StraggleModel(), None, None)
        session = _FailingSession()
        with pytest.raises(StragglerError):
            await steps.run(session, "failing", np.ones(4))  # type: ignore[arg-type]
        assert session.held is not None and session.held() is None
    finally:
        if was:
            gc.enable()
