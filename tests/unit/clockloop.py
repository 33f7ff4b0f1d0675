"""An event loop whose clock moves only when the test says: timers without sleeps and without
wall-clock thresholds."""

from __future__ import annotations

import asyncio
import time
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


class AutoClockLoop(ClockLoop):
    """A :class:`ClockLoop` whose clock, whenever nothing is ready to run, jumps to its next
    timer (trio's "autojump" clock): a test's deadlines pass at once, in order, and the same on
    any machine, however loaded, with nothing to wait for. Only for code that makes progress
    on the loop alone (no threads, no sockets: the in-memory network); ``time.perf_counter``
    reads this clock while one runs (:func:`loop_perf_counter`)."""

    def __init__(self) -> None:
        super().__init__()
        self._selector = _Jumping(self._selector, self)  # type: ignore[has-type]


class _Jumping:
    """The loop's selector, polled without blocking; where the loop would block until a
    timer, the clock moves to it instead."""

    def __init__(self, real: Any, loop: ClockLoop) -> None:
        self._real, self._loop = real, loop

    def select(self, timeout: float | None = None) -> list[Any]:
        events: list[Any] = self._real.select(0)
        if events:
            return events
        if timeout is None:  # no timer: only IO (none here) could wake the loop
            return self._real.select(None)  # type: ignore[no-any-return]
        # A microsecond at least per turn of the loop, as a real clock moves while code runs:
        # code that re-arms a timer for the sliver a float's rounding left (now - then just
        # under its interval) would otherwise re-arm it forever at a clock that stood still.
        self._loop.now += max(timeout, 1e-6)
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


_REAL_PERF_COUNTER = time.perf_counter


def loop_perf_counter() -> float:
    """``time.perf_counter`` for code under test: the running :class:`AutoClockLoop`'s clock
    where one runs, else the real one."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return _REAL_PERF_COUNTER()
    return loop.now if isinstance(loop, AutoClockLoop) else _REAL_PERF_COUNTER()
