"""Emulated latency to tens of microseconds, on an event loop whose timers tick in milliseconds.

uvloop's timers (libuv's) and ``loop.time()`` count whole milliseconds: ``call_later(0.0002)``
fires at the loop's next turn, about 15 us later, and ``call_later(0.001)`` after about
1.14 ms (measured here). A link latency below a millisecond (``AIOREDUCE_LATENCY``; 200 us in
the 13-host benchmarks) was therefore not emulated at all on the event loop's path, while the
lanes' reader, which sleeps in its thread, did add it. A :class:`DelayLine` keeps what is due
on one daemon thread per process that sleeps on the precise clock (``time.monotonic``) until
the earliest moment due and then hands each callback to its loop (``call_soon_threadsafe``),
in the order it was due. Waking a thread and then the loop takes about 100 us of this
machine's time, so the line aims that much early: its lead follows how late the callbacks
ran (an average, bounded), and the moment a callback runs is the moment due give or take
tens of microseconds, not one early or late by the handoff every time. It exists only where
latency is emulated: a job without it never starts the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

_PR_SET_TIMERSLACK = 29
_SLACK_NS = 1000  # Linux lets a sleeping thread wake up to 50 us late unless told otherwise
_MAX_LEAD = 0.0005  # the most the line aims early: the handoff, not the latency, is learned
_GAIN = 0.1  # weight of the newest callback's error in the lead


class Timer(Protocol):
    """A clock and callbacks at its moments: what emulated latency is timed by."""

    def now(self) -> float:
        """The clock's time, seconds."""

    def at(self, due: float, loop: asyncio.AbstractEventLoop, callback: Callable[..., Any],
           *args: Any) -> None:
        """Run ``callback(*args)`` on ``loop`` once :meth:`now` reaches ``due``."""


class LoopTimer:
    """The loop's own clock and timers (millisecond steps under uvloop): for a loop whose
    clock a test moves (``ClockLoop``)."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def at(self, due: float, loop: asyncio.AbstractEventLoop, callback: Callable[..., Any],
           *args: Any) -> None:
        loop.call_at(due, callback, *args)


class DelayLine:
    """Callbacks run on their event loops at a moment of ``time.monotonic()`` (a
    :class:`Timer`)."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, asyncio.AbstractEventLoop, Callable[..., Any],
                              tuple[Any, ...]]] = []
        self._order = itertools.count()  # equal moments keep the order they were given in
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.lead = 0.0  # seconds the thread wakes before a moment due (see the docstring)
        # A forked child has no thread (only the forking one survives a fork): it starts its
        # own, with nothing due (what was due belonged to the parent's loops).
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._due, self._cond, self._thread = [], threading.Condition(), None

    def now(self) -> float:
        return time.monotonic()

    def at(self, due: float, loop: asyncio.AbstractEventLoop, callback: Callable[..., Any],
           *args: Any) -> None:
        """Run ``callback(*args)`` on ``loop`` once ``time.monotonic()`` reaches ``due``."""
        entry = (due, next(self._order), loop, callback, args)
        with self._cond:
            heapq.heappush(self._due, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="aioreduce-delay-line")
                self._thread.start()
            elif self._due[0] is entry:
                self._cond.notify()  # the new one is the earliest: wake the sleeper

    def _run(self) -> None:
        _tight_timer_slack()
        while True:
            with self._cond:
                while True:
                    if not self._due:
                        self._cond.wait()
                        continue
                    wait = self._due[0][0] - self.lead - time.monotonic()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                ready = []
                now = time.monotonic() + self.lead
                while self._due and self._due[0][0] <= now:
                    ready.append(heapq.heappop(self._due))
            for due, _n, loop, callback, args in ready:
                # (A loop that is closed has nobody waiting for the callback any more.)
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._fire, due, callback, args)

    def _fire(self, due: float, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """On the loop: run ``callback``, and move the lead by how late it ran."""
        error = time.monotonic() - due
        self.lead = min(max(self.lead + _GAIN * error, 0.0), _MAX_LEAD)
        callback(*args)


def _tight_timer_slack() -> None:
    """Ask Linux to wake this thread on time (its default slack is 50 us); elsewhere it
    sleeps with the default."""
    with contextlib.suppress(OSError, AttributeError):  # no prctl in its C library: not Linux
        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, _SLACK_NS, 0, 0, 0)


LINE = DelayLine()
"""The process's delay line (its thread starts with the first delayed callback)."""
