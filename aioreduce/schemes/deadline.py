"""A deadline that does not count our own pauses.

A process that was stopped (SIGSTOP, a VM hiccup, swap) finds every timer expired the moment
it runs again, before it has read what its peers sent meanwhile. Judging peers then would
blame them for our pause. So a deadline that fires noticeably late first gives the event loop
a short grace to read what is waiting, and only then expires.
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
        self._handle = self._loop.call_at(self._due, self._fire)

    def _fire(self) -> None:
        late = self._loop.time() - self._due
        if late > LATE and not self.paused:
            self.paused = late
            self._due = self._loop.time() + GRACE
            self._handle = self._loop.call_at(self._due, self._fire)
            return
        if not self.fired.done():
            self.fired.set_result(None)
        if self._callback is not None:
            self._callback()

    def cancel(self) -> None:
        self._handle.cancel()
        if not self.fired.done():
            self.fired.cancel()
