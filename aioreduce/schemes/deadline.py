"""A deadline that does not count our own pauses.

A process that was stopped (SIGSTOP, a VM hiccup, swap) finds every timer expired the moment
it runs again, before it has read what its peers sent meanwhile. Judging peers then would
blame them for our pause. So a deadline that fires noticeably late first gives the event loop
a short grace to read what is waiting, and only then expires.

A process that was merely starved (more busy processes than cores: the scheduler can keep a
runnable process off the CPU for tens of milliseconds) has the same problem on a smaller
scale, and the event loop makes it worse: it runs due timers before it polls the sockets, so
a late deadline would expire with data already in our socket buffers. So every deadline
takes a last look first: it lets the loop poll once (two hops through the ready queue: the
first runs before the poll in uvloop's loop iteration, the second after it in both loops)
and expires only then. That costs microseconds and bounds nothing further.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

LATE = 0.1  # a timer this late means the loop did not run (paused or blocked)
GRACE = 0.25  # time to read what arrived while we were not running


class Deadline:
    """Calls ``callback`` ``seconds`` from now, with a grace after a pause (see above).
    ``fired`` is a future that completes at the same moment."""

    def __init__(self, seconds: float, callback: Callable[[], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._callback = callback
        self.fired: asyncio.Future[None] = self._loop.create_future()
        self.paused = 0.0  # how late the timer was found (seconds we did not run)
        self._due = self._loop.time() + max(0.0, seconds)
        self._looked = False
        self._handle: asyncio.Handle = self._loop.call_at(self._due, self._fire)

    def _fire(self) -> None:
        late = self._loop.time() - self._due
        if late > LATE and not self.paused:
            self.paused = late
            self._due = self._loop.time() + GRACE
            self._handle = self._loop.call_at(self._due, self._fire)
            return
        if not self._looked:  # read what already arrived before judging (see above)
            self._looked = True
            self._handle = self._loop.call_soon(self._look)
            return
        if not self.fired.done():
            self.fired.set_result(None)
        if self._callback is not None:
            self._callback()

    def _look(self) -> None:
        self._handle = self._loop.call_soon(self._fire)

    def cancel(self) -> None:
        self._handle.cancel()
        if not self.fired.done():
            self.fired.cancel()
