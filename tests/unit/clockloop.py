"""An event loop whose clock moves only when the test says: timers without sleeps and without
wall-clock thresholds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


class ClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose time moves only when the test says."""

    now = 1000.0

    def time(self) -> float:
        return self.now


def run(test: Callable[[ClockLoop], Coroutine[Any, Any, None]]) -> None:
    """Run ``test(loop)`` on a fresh :class:`ClockLoop`."""
    loop = ClockLoop()
    try:
        loop.run_until_complete(test(loop))
    finally:
        loop.close()


async def advance(loop: ClockLoop, seconds: float) -> None:
    """Move the clock, then let every timer now due run, and what it wakes."""
    loop.now += seconds
    for _ in range(5):
        await asyncio.sleep(0)


async def until(cond: Callable[[], bool]) -> None:
    """Let the loop run what is ready, its clock standing still, until ``cond()`` holds;
    fail if it never does (what the test waited on needed a timer)."""
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("never happened")
