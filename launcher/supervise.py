"""Watching a job's ranks: a failure beyond the tolerance stops everyone, Ctrl-C stops everyone.

Policy (the same for local and remote ranks; which deaths count is :mod:`.policy`):

* a rank that exits non-zero dies; up to ``restart`` deaths in all (``--restart N``) are
  answered with a new process for that rank (``restarter``), which rejoins the running job;
  past those, up to ``tolerate`` deaths (``--tolerate K``) leave the job
  running, one more terminates every other rank; the culprit (the first death that was not
  just a lost peer) decides the exit code, and a summary names every death and how it ended;
* while every death beyond the tolerance only reports a lost peer, the launcher waits up to
  ``cause_wait`` seconds for the rank that caused it (it may exit just after its victims)
  before it terminates the others; the first death that is not a victim ends the wait;
* termination is SIGTERM to each rank's process group, then SIGKILL after ``kill_timeout``;
* SIGINT/SIGTERM to the launcher start the same termination; a second one escalates to SIGKILL
  at once;
* when the job is over, every rank's process group gets a final SIGKILL, so nothing a rank
  started in the background outlives the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from .output import RankOutput
from .policy import FailurePolicy, how_it_ended
from .tracebacks import rank_ranges, same_error


class RankHandle(Protocol):
    """What the supervisor needs from a running rank, wherever it runs."""

    rank: int
    host: str
    outputs: tuple[RankOutput, RankOutput]

    async def wait(self) -> int: ...

    async def close(self) -> None: ...

    def signal(self, sig: int) -> None: ...


def _say(msg: str) -> None:
    sys.stderr.write(f"aioreduce-launch: {msg}\n")
    sys.stderr.flush()


class Supervisor:
    """Runs the failure and interrupt policy over a set of started ranks."""

    def __init__(self, ranks: list[RankHandle], kill_timeout: float = 10.0,
                 tolerate: int = 0, cause_wait: float = 3.0, restart: int = 0,
                 restarter: Callable[[RankHandle], Awaitable[RankHandle]] | None = None
                 ) -> None:
        self.ranks = ranks
        self.kill_timeout = kill_timeout
        self.cause_wait = cause_wait
        self._cause_handle: asyncio.TimerHandle | None = None
        self.policy = FailurePolicy(tolerate, restart=restart if restarter else 0)
        self._restarter = restarter
        self._restarting = 0  # restarts in flight
        self._waits: dict[asyncio.Future[int], RankHandle] = {}
        self.interrupted: int | None = None  # signal number
        self._stopping = False
        self._kill_handle: asyncio.TimerHandle | None = None
        self._late_handle: asyncio.TimerHandle | None = None  # see _stop_late
        self._wake = asyncio.Event()

    def interrupt(self, signum: int) -> None:
        """SIGINT/SIGTERM: terminate; a second one kills."""
        if self.interrupted is not None or self._stopping:
            _say("second interrupt: killing all ranks now")
            self._signal_all(signal.SIGKILL)
        else:
            _say(f"got {signal.Signals(signum).name}; terminating all ranks "
                 f"(again to kill at once)")
            self.interrupted = signum
            self.stop()
        self._wake.set()

    def stop(self) -> None:
        """SIGTERM every rank now and SIGKILL them after the kill timeout."""
        if self._stopping:
            return
        self._stopping = True
        self.policy.stop()
        if self._cause_handle is not None:
            self._cause_handle.cancel()
        self._signal_all(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        self._kill_handle = loop.call_later(self.kill_timeout, self._signal_all, signal.SIGKILL)

    def _signal_all(self, sig: int) -> None:
        for r in self.ranks:
            r.signal(sig)

    async def run(self) -> int:
        """Wait for the job; return the launcher's exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.interrupt, sig)
        self._waits = {asyncio.ensure_future(r.wait()): r for r in self.ranks}
        handled: set[asyncio.Future[int]] = set()
        try:
            while True:
                pending = set(self._waits) - handled  # restarted ranks join it
                if not pending and not self._restarting:
                    break
                wake = asyncio.ensure_future(self._wake.wait())
                waiting: list[asyncio.Future[Any]] = [*pending, wake]
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                wake.cancel()
                self._wake.clear()
                for fut in pending:
                    if fut.done():
                        handled.add(fut)
                        self._exited(self._waits[fut], fut.result())
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
            for handle in (self._kill_handle, self._cause_handle, self._late_handle):
                if handle is not None:
                    handle.cancel()
            self._signal_all(signal.SIGKILL)  # reap whatever a rank left in its group
            await asyncio.gather(*(r.close() for r in self.ranks))
        for line in [*self.policy.summary(), *self._held_errors()]:
            _say(line)
        return self.policy.exit_code(self.interrupted)

    def _held_errors(self) -> list[str]:
        """Tracebacks held back from the ranks' output (see .tracebacks): a death's is in
        the summary already; one printed by a rank the launcher stopped is said once per
        distinct error; any other is written as it was."""
        dead = {d.rank for d in self.policy.deaths}
        culprit = self.policy.culprit
        said = same_error(culprit.error, culprit.rank) if culprit is not None else None
        first = self._held_block(culprit.rank) if culprit is not None else []
        stopped: dict[str, tuple[str, list[int]]] = {}
        for r in self.ranks:
            out = r.outputs[1]
            if out.held is None or not out.held.block:
                continue
            if r.rank in dead:
                out.held.release()
            elif self._stopping:
                error, key = out.held.error, same_error(out.held.error, r.rank)
                if not out.held.ended and said is not None \
                        and out.held.generic(r.rank) == first[:len(out.held.block)]:
                    key = said  # stopped while printing the culprit's traceback: cut short
                stopped.setdefault(key, (error, []))[1].append(r.rank)
                out.held.release()
            else:
                out.release()
        return [f"{'ranks' if len(ranks) > 1 else 'rank'} {rank_ranges(ranks)}, stopped, had "
                + ("printed the culprit's error" if key == said else f"printed: {error}")
                for key, (error, ranks) in stopped.items()]

    def _held_block(self, rank: int) -> list[str]:
        """The traceback held back from ``rank``'s stderr, its own rank number made generic
        (empty if none is held)."""
        for r in self.ranks:
            held = r.outputs[1].held
            if r.rank == rank and held is not None and held.block:
                return held.generic(rank)
        return []

    def _exited(self, rank: RankHandle, code: int) -> None:
        if self._stopping:  # the launcher's own SIGTERM/SIGKILL: not a death
            return
        if rank.rank == 0 and code == 0 and self.policy.restarted:
            # The job is over. A replacement still running once the others have had their
            # time to finish has nobody left to heal from: it would wait out its timeout.
            self.policy.finished = True
            self._late_handle = asyncio.get_running_loop().call_later(self.kill_timeout,
                                                                      self._stop_late)
        tail = list(rank.outputs[1].last_lines) or list(rank.outputs[0].last_lines)
        if self.policy.restarts(rank.rank, rank.host, code, tail):
            _say(f"rank {rank.rank} on {rank.host} {how_it_ended(code)}; restarting it "
                 f"({len(self.policy.restarted)} of at most {self.policy.restart})")
            self._restarting += 1
            task = asyncio.ensure_future(self._restart(rank))
            task.add_done_callback(lambda _t: self._wake.set())
            return
        if not self.policy.exited(rank.rank, rank.host, code, tail):
            if code != 0 and self.policy.late[-1:] == [rank.rank]:
                _say(f"rank {rank.rank}'s replacement on {rank.host} {how_it_ended(code)}: "
                     "the job had finished")
            elif code != 0:
                _say(f"rank {rank.rank} on {rank.host} {how_it_ended(code)}; tolerated "
                     f"({len(self.policy.deaths)} of at most {self.policy.tolerate}), "
                     "the job goes on")
            return
        if self.policy.waiting_for_cause and self.cause_wait > 0:
            if self._cause_handle is None:  # wait, bounded, for the rank that caused it
                self._cause_handle = asyncio.get_running_loop().call_later(
                    self.cause_wait, self._stop_for, rank, code)
            return
        self._stop_for(rank, code)

    def _stop_late(self) -> None:
        """Terminate the replacements still running after the job finished."""
        running = {r for fut, r in self._waits.items() if not fut.done()}
        for r in running:
            if self.policy.replaced(r.rank):
                r.signal(signal.SIGTERM)

    async def _restart(self, old: RankHandle) -> None:
        """A new process for ``old``'s rank, watched like the others."""
        try:
            old.signal(signal.SIGKILL)  # whatever the dead process left in its group
            await old.close()
            assert self._restarter is not None
            new = await self._restarter(old)
        except Exception as exc:  # it cannot come back: a death like any other
            _say(f"cannot restart rank {old.rank} on {old.host}: {exc}")
            if self.policy.exited(old.rank, old.host, 1, [str(exc)]):
                self._stop_for(old, 1)
            return
        finally:
            self._restarting -= 1
        if self._stopping:
            new.signal(signal.SIGKILL)
        self.ranks[self.ranks.index(old)] = new
        self._waits[asyncio.ensure_future(new.wait())] = new

    def _stop_for(self, rank: RankHandle, code: int) -> None:
        culprit = self.policy.culprit
        who = (culprit.describe() if culprit is not None
               else f"rank {rank.rank} on {rank.host} {how_it_ended(code)}")
        _say(f"{who}; terminating the other ranks")
        self.stop()
