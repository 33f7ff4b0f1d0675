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

A timer found later than its own length (and than :data:`STALL`) lost more time than the
whole bound it keeps: a stall of this process or of its host (a hypervisor's, or every core
taken by something else), not a loop busy for a moment. The peers, stalled with us on a
shared host, or their bytes waiting for our reader threads, had none of that time; so it
waits as long again as it was late (GRACE at most) before it expires (calm transpose steps
cut by such stalls before: docs/transpose.md, "A stall of the whole host").

Our own garbage collector is a pause too: a full collection holds the interpreter for tens of
milliseconds, during which neither the loop nor the threads reading our lanes run, and the
ranks, running the same code, collect at about the same steps. So a deadline is moved by the
time this process spent collecting since it was set (``gc.callbacks``; collections shorter
than :data:`GC_MIN` in all are not worth a new timer). That covers our own pause only: a peer
that collects is late to us, unless every node moves its collections between steps
(``Node(gc_every=N)``, :mod:`aioreduce.stepgc`).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from typing import Any

LATE = 0.1  # a timer this late means the loop did not run (paused or blocked)
GRACE = 0.25  # time to read what arrived while we were not running
STALL = 0.005  # a timer later than this and than its own length: we stalled (see above)
GC_MIN = 0.001  # collecting this long since the deadline was set moves it


class _Collections:
    """Seconds this process has spent in the cyclic garbage collector (counted from the first
    deadline on: the callback is installed then)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._began = 0.0
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            self._installed = True
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._began


COLLECTIONS = _Collections()


class Deadline:
    """Calls ``callback`` ``seconds`` from now, with a grace after a pause (see above).
    ``fired`` is a future that completes at the same moment; ``excused``: seconds it was
    moved by for our own garbage collections."""

    def __init__(self, seconds: float, callback: Callable[[], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._callback = callback
        self.fired: asyncio.Future[None] = self._loop.create_future()
        self.paused = 0.0  # how late the timer was found (seconds we did not run)
        self._span = max(0.0, seconds)
        self.excused = 0.0
        COLLECTIONS.install()
        self._collected = COLLECTIONS.total
        self._due = self._loop.time() + max(0.0, seconds)
        self._looked = False
        self._handle: asyncio.Handle = self._loop.call_at(self._due, self._fire)

    def _fire(self) -> None:
        collected = COLLECTIONS.total - self._collected - self.excused
        if collected >= GC_MIN:  # our own pause: that long later
            self.excused += collected
            self._due += collected
            if self._due > self._loop.time():
                self._handle = self._loop.call_at(self._due, self._fire)
                return
        late = self._loop.time() - self._due
        if not self.paused and (late > LATE or late > max(STALL, self._span)):
            self.paused = late  # (once: the grace is not judged again)
            self._due = self._loop.time() + (GRACE if late > LATE else late)
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
