"""Background sends, bounded per peer by what that peer has not read yet.

A tree rank passes results on without waiting for slow children, so its sends run in the
background. A child that stopped reading (a paused process) must not make us queue results
without end: once a peer has ``max_steps`` steps unsent, further sends to it are skipped
(and logged once) until its backlog drains; then ``on_drained(peer, first, last)`` (the
steps skipped) lets the session send what was skipped (a peer that comes back also asks).
"Stopped reading" is judged only by that peer's unsent frames, never by wall time, so our
own pause cannot make a healthy peer look dead. (Our own catch-up burst can: uvloop writes
queued frames only when the loop turns, so a rank that runs many steps without yielding sees
its sends pending. That is why skipped steps are re-sent as soon as the peer drains.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import Comm

log = logging.getLogger("aioreduce.schemes")


@dataclass(eq=False)
class _Pending:
    step: int
    nbytes: int
    task: asyncio.Task[None] | None = None
    started: bool = False  # handed to the transport, waiting for the peer to take it


class _Rest:
    """The rest of a coroutine whose first step ran by hand, as an awaitable for a task:
    ``waiting`` is what that step yielded (the future it waits on), handed on to the task,
    which resumes us when it is done, as it would have resumed the coroutine itself."""

    __slots__ = ("coro", "waiting")

    def __init__(self, coro: Coroutine[Any, Any, None], waiting: object) -> None:
        self.coro, self.waiting = coro, waiting

    def __await__(self) -> Generator[Any, None, None]:
        coro, waiting = self.coro, self.waiting
        while True:
            try:
                yield waiting
            except GeneratorExit:  # (we are being closed, not resumed: close it too)
                coro.close()
                raise
            except BaseException as exc:  # (cancelled: the coroutine gets to clean up)
                try:
                    waiting = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    waiting = coro.send(None)
                except StopIteration:
                    return


class Outbox:
    """Sends to peers in the background; see the module docstring."""

    def __init__(self, comm: Comm, max_steps: int = 8,
                 on_drained: Callable[[int, int, int], None] | None = None) -> None:
        self.comm = comm
        self.max_steps = max_steps
        self.on_drained = on_drained
        self._pending: dict[int, list[_Pending]] = {}
        self._skipping: dict[int, tuple[int, int]] = {}  # peer -> (first, last) step skipped
        self._closed = False

    def send(self, peer: int, array: np.ndarray, *, step: int, tag: int,
             meta: dict[str, Any] | None = None) -> bool:
        """Queue a send; False if it was skipped (closed, or the peer is not reading)."""
        if self._closed:
            return False
        pending = self._pending.setdefault(peer, [])
        # Only frames already handed to the transport count: a send whose task has not run
        # yet says nothing about the peer (we may be catching up through several steps
        # without yielding to the event loop).
        behind = {p.step for p in pending if p.started and p.step != step} if pending else ()
        if len(behind) >= self.max_steps:
            if peer not in self._skipping:
                log.warning("rank %d: rank %d is not reading (%d steps, %d bytes unsent); "
                            "holding frames back until it drains", self.comm.rank, peer,
                            len(behind), sum(p.nbytes for p in pending))
            first, last = self._skipping.get(peer, (step, step))
            self._skipping[peer] = (min(first, step), max(last, step))
            return False
        entry = _Pending(step, array.nbytes)
        if not pending:
            # Started here, not in a task: most sends hand their frame to the kernel at once
            # and never suspend, and a task (made, scheduled, run a loop turn later, followed
            # to its end) cost a small frame more than its send. A send that has to wait (a
            # full socket, a connection to make) goes on in a task. With a send to this peer
            # still waiting, in a task too, after it: frames to a peer leave in order.
            coro = self.comm.send(peer, array, step=step, tag=tag, meta=meta)
            try:
                waiting = coro.send(None)
            except StopIteration:
                return True  # every byte is with the kernel
            except Exception as exc:  # (a task's failure would be logged alike)
                log.debug("rank %d: send to rank %d failed: %s", self.comm.rank, peer, exc)
                return True
            entry.started = True
            entry.task = asyncio.ensure_future(_Rest(coro, waiting))
        else:
            # (The send is made when the task starts: one cancelled before that leaves no
            # coroutine unawaited.)
            async def run() -> None:
                entry.started = True
                await self.comm.send(peer, array, step=step, tag=tag, meta=meta)

            entry.task = asyncio.ensure_future(run())
        pending.append(entry)
        entry.task.add_done_callback(lambda t: self._done(peer, entry))
        return True

    def _done(self, peer: int, entry: _Pending) -> None:
        pending = self._pending.get(peer, [])
        if entry in pending:
            pending.remove(entry)
        task = entry.task
        assert task is not None
        if not task.cancelled() and task.exception() is not None:
            log.debug("rank %d: send to rank %d failed: %s", self.comm.rank, peer,
                      task.exception())
        if not pending and peer in self._skipping:
            first, last = self._skipping.pop(peer)
            log.warning("rank %d: rank %d reads again; resending steps %d to %d",
                        self.comm.rank, peer, first, last)
            if self.on_drained is not None and not self._closed:
                self.on_drained(peer, first, last)

    async def close(self, timeout: float) -> None:
        """Let queued sends finish for up to ``timeout`` seconds, then cancel the rest."""
        self._closed = True
        tasks = [p.task for ps in self._pending.values() for p in ps if p.task is not None]
        if tasks:
            _done, late = await asyncio.wait(tasks, timeout=timeout)
            for t in late:
                t.cancel()
