"""One bounded stage of a transpose step: the receives it waits for, and when it ends.

A stage ends on the first of:

* **full receipt**: every posted slice arrived (or its sender's connection broke);
* **early close**: every sender's tail slice is in, and nothing arrived for ``idle`` seconds
  (a sender that skipped slices will not send them now). Senders in ``optional`` are not
  waited for here: stage 2 names the owners that sent us nothing in stage 1 (see
  :meth:`Stage.silent`), whose reduced shards would come only after they wake up;
* **the deadline** (pause-aware, see :class:`~aioreduce.schemes.deadline.Deadline`), unless
  every sender it still lacks is delivering: each has sent bytes within the last ``idle``
  seconds. Then it waits on while they do, up to ``grace`` × the deadline more, and ends once
  one of them falls silent for ``idle``. A sender that is late (it has not started, or it
  stopped) gets nothing more; one whose bytes are merely slow on a busy network gets a little.
  On 4 emulated hosts with 1 Gbit/s links, calm stages took p50 120 ms and up to 208 against
  a bound of about 176, and those cut stages raised the safety valve in 3 of 5 runs.
  Under the ``wait`` safety valve a stage whose received fraction is still below ``need``
  keeps waiting past it.

Then every receive still pending is withdrawn: its buffer is never written again, and the
session raises the comm's floor so the slices still on their way are dropped on arrival.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...errors import PeerLost
from ...wire import Header
from ..deadline import Deadline
from ..waiting import first_done


@dataclass(eq=False)
class Slot:
    """One posted receive: slice ``index`` of the shard from ``src`` (``size`` elements)."""

    src: int
    index: int
    size: int
    future: asyncio.Future[Header]
    tail: bool = False
    arrived: bool = False
    header: Header | None = None
    added: bool = False  # the session used it as it came (see Stage.on_arrival)


@dataclass
class Stage:
    """The receives of one stage; :meth:`run` waits until the stage ends."""

    slots: list[Slot]
    total: int  # elements this stage would deliver if nothing were missing
    reason: str = ""  # why it ended: "complete", "early", "deadline"
    received: int = 0
    elapsed: float = 0.0
    extended: bool = False  # it ran past its deadline while its missing senders delivered
    # Senders whose tail slices early close does not wait for (see the module docstring).
    optional: frozenset[int] = frozenset()
    # Called with each slot that arrives while the stage is open (not after it ended): the
    # session reduces slices as they come instead of all at the end.
    on_arrival: Callable[[Slot], None] | None = None
    _closed: bool = field(default=False)
    _last: float = field(default=0.0)
    _t0: float = field(default=0.0)
    _idle: float = field(default=0.0)
    _idle_timer: asyncio.TimerHandle | None = None
    _heard: dict[int, float] = field(default_factory=dict)  # sender -> its last slice's time
    _heard_at: Callable[[int], float] | None = None  # see run's ``heard``
    _open: int = 0
    _open_by: dict[int, int] = field(default_factory=dict)  # sender -> its slots still open
    # When the last sender that had sent anything was in while others had still sent nothing
    # (late to start: stragglers), and those others (see late_start).
    _others_in: float = 0.0
    _late: frozenset[int] = frozenset()
    _tails: int = 0
    _ended: asyncio.Future[str] | None = None

    @property
    def fraction(self) -> float:
        return self.received / self.total if self.total else 1.0

    async def run(self, deadline: float | None, idle: float, need: float = 0.0,
                  cap: float = 3600.0, since: float | None = None, grace: float = 0.0,
                  heard: Callable[[int], float] | None = None) -> None:
        """Wait for this stage (``deadline`` None: wait for everything, up to ``cap``).
        ``since``: the ``time.perf_counter()`` at which the stage's time began, if before now
        (it is then counted in ``elapsed`` and in the deadline). ``grace``, ``heard``: past
        the deadline, wait on up to ``grace`` × it while every missing sender delivers;
        ``heard(src)`` is when bytes last came from ``src`` (finer than whole slices)."""
        loop = asyncio.get_running_loop()
        now = self._last = time.perf_counter()
        t0 = self._t0 = min(now, since) if since is not None else now
        self._ended = loop.create_future()
        self._open = len(self.slots)
        self._heard_at = heard
        for slot in self.slots:
            self._open_by[slot.src] = self._open_by.get(slot.src, 0) + 1
        self._tails = sum(1 for s in self.slots if s.tail and s.src not in self.optional)
        self._idle = idle
        for slot in self.slots:
            slot.future.add_done_callback(functools.partial(self._done, slot))
        if not self._open:
            self._end("complete")
        timer = Deadline((deadline if deadline is not None else cap) - (now - t0))
        excused = 0.0  # seconds the timers were moved by for our own garbage collections
        self._watch_idle()  # now if no tail is awaited; else _done, when the last one lands
        try:
            while True:
                await first_done((self._ended, timer.fired))
                if self._ended.done():
                    self.reason = self._ended.result()
                    break
                if self.fraction < need and deadline is not None and self._open:
                    # The safety valve says wait: keep waiting as a reliable stage would.
                    timer.cancel()
                    timer = Deadline(cap)
                    deadline = None
                    continue
                now = time.perf_counter()
                # (Our own garbage collections moved the deadline: they move its limit too.)
                excused += timer.excused
                until = None if deadline is None else self._flowing_until(
                    t0, idle, heard, t0 + excused + deadline * (1 + grace))
                if until is not None and until > now:
                    self.extended = True
                    timer.cancel()
                    timer = Deadline(until - now)
                    continue
                self.reason = "deadline"
                break
        finally:
            self._closed = True
            timer.cancel()
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            for slot in self.slots:
                if not slot.future.done():
                    slot.future.cancel()
            self.elapsed = time.perf_counter() - t0

    def silent(self, heard: Callable[[int], float] | None = None) -> frozenset[int]:
        """After :meth:`run`: the senders of which not one slice arrived, and (``heard``, see
        :meth:`run`) not one byte since the stage began: paused, or too late to matter."""
        got = {slot.src for slot in self.slots if slot.arrived}
        return frozenset(
            src for src in {slot.src for slot in self.slots} - got
            if heard is None or heard(src) < self._t0)

    def late_start(self) -> tuple[frozenset[int], float] | None:
        """After a stage that completed: the senders that had not sent a byte when every
        other sender's slices were in (late to start: a straggler, a pause), and the seconds
        the others took; None if there were none. A stage cut at its deadline has
        :meth:`silent` and :meth:`others_took` instead."""
        if self.reason != "complete" or not self._late:
            return None
        return self._late, max(0.0, self._others_in - self._t0)

    def others_took(self, silent: frozenset[int]) -> float | None:
        """After :meth:`run`: the seconds the senders not in ``silent`` needed for their
        slices: when their last one arrived, or, if some of theirs are missing too, the
        elapsed time over the fraction of theirs received (as a cut stage counts, see
        :meth:`~.clock.StageClock.observe`). None if every sender is in ``silent``."""
        theirs = [slot for slot in self.slots if slot.src not in silent]
        total = sum(slot.size for slot in theirs)
        if not total:
            return None
        got = sum(slot.size for slot in theirs if slot.arrived)
        if got == total:
            return max(0.0, self._last - self._t0)
        return self.elapsed / max(got / total, 0.05)

    def _flowing_until(self, t0: float, idle: float, heard: Callable[[int], float] | None,
                       limit: float) -> float | None:
        """Until when every sender with slices still missing counts as delivering (it sent
        bytes in this stage, the last within ``idle``), capped at ``limit``; None if one
        does not."""
        until = limit
        for src in {slot.src for slot in self.slots if not slot.future.done()}:
            last = max(self._heard.get(src, t0 - 1), heard(src) if heard is not None else t0 - 1)
            if last < t0:
                return None
            until = min(until, last + idle)
        return until

    def _done(self, slot: Slot, _fut: object) -> None:
        fut = slot.future
        if fut.cancelled():
            return
        self._open -= 1
        exc = fut.exception()
        if exc is None:
            slot.arrived, slot.header = True, fut.result()
            self.received += slot.size
            self._last = self._heard[slot.src] = time.perf_counter()
            if self.on_arrival is not None and not self._closed:
                self.on_arrival(slot)
        elif not isinstance(exc, PeerLost):  # a mismatch or a bug: the step fails
            self._end_with(exc)
            return
        left = self._open_by[slot.src] = self._open_by[slot.src] - 1
        if left == 0 and self._open:
            self._note_late_starters()
        if slot.tail and slot.src not in self.optional:
            self._tails -= 1
        if self._open == 0:
            self._end("complete")
        else:
            self._watch_idle()  # the last tail may be in now: the early close starts counting

    def _note_late_starters(self) -> None:
        """A sender's slices are all in: if every sender still owing slices has sent nothing
        yet (not a slice, not a byte since the stage began), note them and the time."""
        t0, heard = self._t0, self._heard_at
        for src, left in self._open_by.items():  # (a loop: this runs for most senders)
            if left and (src in self._heard or (heard is not None and heard(src) >= t0)):
                return  # this one has started
        waiting = frozenset(src for src, left in self._open_by.items() if left)
        if waiting:
            self._others_in, self._late = time.perf_counter(), waiting

    def _watch_idle(self) -> None:
        """Once every awaited tail is in, check for quiet (early close), once."""
        if (self._tails == 0 and self._open and self._idle_timer is None
                and self._ended is not None and not self._ended.done()):
            self._idle_timer = asyncio.get_running_loop().call_later(self._idle,
                                                                     self._check_idle)

    def _check_idle(self) -> None:
        quiet = time.perf_counter() - self._last
        if quiet >= self._idle:
            self._end("early")
        else:
            self._idle_timer = asyncio.get_running_loop().call_later(self._idle - quiet,
                                                                     self._check_idle)

    def _end(self, reason: str) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(reason)

    def _end_with(self, exc: BaseException) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_exception(exc)
