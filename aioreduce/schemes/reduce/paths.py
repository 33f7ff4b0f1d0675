"""The two halves of a step on one rank: gathering and decoding the children's messages (up),
and awaiting the result from the parent or, after failover, the grandparent (down)."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...wire import Header
from ..base import MAX_CHUNKS, FellBehind, StragglerError, chunk_bounds
from ..deadline import Deadline
from ..waiting import first_done
from .failover import Ask, Link, ParentFailover
from .family import DOWN, VERDICT_TAG, Family
from .gather import Gather, combine
from .history import Outcome
from .report import Report, Verdict

if TYPE_CHECKING:
    from .session import ReduceSession

EMPTY = np.zeros(0, np.uint8)
log = logging.getLogger("aioreduce.schemes")


@dataclass(frozen=True)
class Layout:
    """How one step's vectors are cut into chunks."""

    length: int
    dtype: np.dtype
    bounds: tuple[tuple[int, int], ...]  # result chunks
    msg_len: int  # length of each child's message (shorter with m > 1)
    msg_bounds: tuple[tuple[int, int], ...]
    own_len: int  # length of this rank's own message to its parent
    own_bounds: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, like: np.ndarray, family: Family, chunk_bytes: int,
           max_chunks: int = MAX_CHUNKS) -> Layout:
        flat = like.reshape(-1)
        length, dtype = flat.size, flat.dtype
        bounds = tuple(chunk_bounds(length, dtype.itemsize, chunk_bytes, max_chunks))
        m = family.code.m if family.code is not None else 1
        msg_len = math.ceil(length / m)
        msg_bounds = (tuple(chunk_bounds(msg_len, dtype.itemsize, chunk_bytes, max_chunks))
                      if m > 1 else bounds)
        own_len = math.ceil(length / family.parent_m)
        own_bounds = (tuple(chunk_bounds(own_len, dtype.itemsize, chunk_bytes, max_chunks))
                      if family.parent_m > 1 else bounds)
        return cls(length, dtype, bounds, msg_len, msg_bounds, own_len, own_bounds)


class UpPath:
    """Receives from the children (posted at step start), decodes chunk after chunk from the
    first sufficient set, and passes each decoded chunk on at once."""

    def __init__(self, session: ReduceSession, step: int, lay: Layout) -> None:
        self.session, self.step, self.lay = session, step, lay
        fam, comm = session.family, session.comm
        self.gather = Gather(len(fam.children), fam.code, len(lay.msg_bounds))
        self.bufs = [session.pool.take(lay.msg_len, lay.dtype) for _ in fam.children]
        self.posted: list[asyncio.Future[Header]] = []
        for i, child in enumerate(fam.children):
            for c, (lo, hi) in enumerate(lay.msg_bounds):
                f = session.post_data(child, self.bufs[i][lo:hi], step, c)
                f.add_done_callback(self.gather.chunk_callback(i, c))
                self.posted.append(f)
            e = comm.post_recv(child, EMPTY[:0], step=step, tag=VERDICT_TAG)
            e.add_done_callback(self.gather.verdict_callback(i))
            self.posted.append(e)
        self.deadline = Deadline(session.opts.deadline, self.gather.settle)

    async def run(self, mine: np.ndarray) -> Outcome | None:
        """Decode and pass on. At the root, return the outcome (or raise StragglerError after
        telling every rank); elsewhere return None once sent (or the failure reported up)."""
        s, lay, gather = self.session, self.lay, self.gather
        kids = s.family.children
        m = s.family.code.m if s.family.code is not None else 1
        out = s.pool.take(lay.length if m == 1 else m * lay.msg_len, lay.dtype)
        exact, err, used_kids = True, 0.0, set[int]()
        last = len(lay.msg_bounds) - 1
        for c, (lo, hi) in enumerate(lay.msg_bounds):
            responders = await gather.ready[c]
            if gather.mismatch is not None:
                self._mismatched(*gather.mismatch)
                return None
            t = time.perf_counter()
            a, c_exact, c_err = gather.coefficients(responders, s.opts)
            if a is None:
                missing = gather.missing(kids, responders)
                self._failed(missing, lost=gather.lost(kids, missing))
                return None
            exact, err = exact and c_exact, max(err, c_err)
            used_kids.update(np.flatnonzero(a if a.ndim == 1 else a.any(axis=0)).tolist())
            combine(out, mine, self.bufs, a, lo, hi, lay.msg_len, m)
            s.decoded(self.step, time.perf_counter() - t)
            if m == 1:
                report = (Report.combine(s.comm.rank, kids, gather.reports, used_kids, exact,
                                         err) if c == last else None)
                self._emit(c, out[lo:hi], report)
        report = Report.combine(s.comm.rank, kids, gather.reports, used_kids, exact, err)
        if m > 1:  # a star root with short messages finishes every chunk first
            out = np.ascontiguousarray(out[:lay.length] + mine)  # the master's own term
            for c, (lo, hi) in enumerate(lay.bounds):
                self._emit(c, out[lo:hi], report if c == len(lay.bounds) - 1 else None)
        if s.family.parent is not None:
            return None
        return Outcome(self.step, out[:lay.length], lay.bounds, report)

    def _emit(self, c: int, chunk: np.ndarray, report: Report | None) -> None:
        s = self.session
        meta = report.to_meta() if report is not None else None
        if s.family.parent is None:
            s.forward(self.step, DOWN + c, chunk, meta)
        else:
            s.send_up(self.step, c, chunk, meta)

    def _mismatched(self, i: int, text: str, ranks: tuple[int, ...] | None) -> None:
        """Fail the step for every rank with the mismatch a child's frame (or verdict) shows."""
        if ranks is None:
            child, me = self.session.family.children[i], self.session.comm.rank
            text = (f"step {self.step}: rank {child}'s vector differs from rank {me}'s "
                    f"({self.lay.length} {self.lay.dtype}); every rank must pass the same shape "
                    f"and dtype ({text})")
            ranks = tuple(sorted((child, me)))
        self._failed(list(ranks), text)

    def _failed(self, missing: list[int], mismatch: str = "",
                lost: tuple[int, ...] = ()) -> None:
        s = self.session
        verdict = Verdict(tuple(missing), mismatch=mismatch, lost=lost)
        if s.family.parent is not None:  # tell the parent now instead of letting it time out
            s.send_up(self.step, VERDICT_TAG, EMPTY, verdict.to_meta())
            return None
        s.conclude(Outcome(self.step, verdict=verdict), forward=True)
        raise verdict.error(self.step)

    def close(self) -> None:
        self.deadline.cancel()
        for f in self.posted:
            if not f.done():
                f.cancel()


class Source:
    """One rank's delivery of a step's outcome (result chunks, or a verdict) into ``buf``."""

    def __init__(self, session: ReduceSession, rank: int, step: int, lay: Layout) -> None:
        comm = session.comm
        self.rank, self.step = rank, step
        self.buf = session.pool.take(lay.length, lay.dtype)
        self.bounds = lay.bounds
        self.chunks = [session.post_data(rank, self.buf[lo:hi], step, DOWN + c)
                       for c, (lo, hi) in enumerate(lay.bounds)]
        for c, f in enumerate(self.chunks):
            lo, hi = lay.bounds[c]
            f.add_done_callback(functools.partial(session.chunk_arrived, step, c,
                                                  self.buf[lo:hi]))
        self.verdict_f = comm.post_recv(rank, EMPTY[:0], step=step, tag=VERDICT_TAG)

    def complete(self) -> bool:
        for f in self.chunks:  # (loops, not generators: these run several times a step)
            if not f.done() or f.cancelled() or f.exception() is not None:
                return False
        return True

    def verdict(self) -> Verdict | None:
        f = self.verdict_f
        if f.done() and not f.cancelled() and f.exception() is None:
            return Verdict.from_meta(f.result().meta)
        return None

    def broken(self) -> bool:
        for f in (*self.chunks, self.verdict_f):
            if f.done() and not f.cancelled() and f.exception() is not None:
                return True
        return False

    def failure(self) -> BaseException | None:
        """What broke this source (see :meth:`broken`)."""
        for f in (*self.chunks, self.verdict_f):
            if f.done() and not f.cancelled() and f.exception() is not None:
                return f.exception()
        return None

    def pending(self) -> list[asyncio.Future[Header]]:
        return [f for f in (*self.chunks, self.verdict_f) if not f.done()]

    def outcome(self) -> Outcome:
        report = Report.from_meta(self.chunks[-1].result().meta)
        return Outcome(self.step, self.buf, self.bounds, report)

    def cancel(self) -> None:
        for f in (*self.chunks, self.verdict_f):
            if not f.done():
                f.cancel()


class DownPath:
    """Awaits a step's outcome from the parent, asking the grandparent (and the parent again)
    as the failover machine says. Whichever source completes first wins; each has its own
    buffer, so a late source never writes into a returned value."""

    def __init__(self, session: ReduceSession, step: int, lay: Layout,
                 failover: ParentFailover) -> None:
        self.session, self.step, self.lay, self.fo = session, step, lay, failover
        assert session.family.parent is not None
        self.parent = session.family.parent
        self.sources = {self.parent: Source(session, self.parent, step, lay)}
        self.probe: Source | None = None  # the parent's source, kept past a bypassed step

    async def wait(self, elapsed: float) -> Outcome:
        s, fo, step = self.session, self.fo, self.step
        if fo.state is Link.LOST:
            s.parent_back()
        self._act(fo.step_started(step))
        if s.comm.is_lost(self.parent):
            self._act(fo.parent_lost(step))
        began = time.perf_counter() - elapsed
        deadline = Deadline(s.opts.deadline - elapsed)
        # Set once the deadline passed: most steps end before it, and a timer each step that
        # never fires is work for nothing.
        give_up: Deadline | None = None
        behind: int | None = None
        try:
            while True:
                for src in list(self.sources.values()):
                    if src.complete():
                        return self._won(src)
                    verdict = src.verdict()
                    if verdict is not None and verdict.behind is not None:
                        behind = max(behind or 0, verdict.behind)
                        self._drop(src)
                    elif verdict is not None:
                        s.conclude(Outcome(step, verdict=verdict), forward=True)
                        raise verdict.error(step)
                    elif src.broken():
                        log.warning("rank %d step %d: the result from rank %d failed: %s",
                                    s.comm.rank, step, src.rank, src.failure())
                        self._drop(src)
                        if src.rank == self.parent:
                            self._act(fo.parent_lost(step))
                if not self.sources:
                    if behind is not None:
                        raise FellBehind(s.comm.rank, step, behind)
                    if s.comm.is_lost(self.parent) and fo.grandparent is None:
                        # The root died: nobody has this step's result. Say so to the
                        # children, who never talk to it (they would wait out give_up),
                        # so every rank fails the step alike (and, healing, waits for
                        # the root's replacement and runs it again: aioreduce.heal).
                        verdict = Verdict((self.parent,), lost=(self.parent,))
                        s.conclude(Outcome(step, verdict=verdict), forward=True)
                        raise verdict.error(step)
                    raise StragglerError(step, [self.parent], "lost the parent")
                waits: list[asyncio.Future[Any]] = [
                    f for src in self.sources.values() for f in src.pending()]
                waits.append(deadline.fired if give_up is None else give_up.fired)
                await first_done(waits)
                if give_up is None and deadline.fired.done():
                    give_up = Deadline(s.opts.deadline * 4 + 10 - (time.perf_counter() - began))
                    self._act(fo.deadline_passed(step))
                if give_up is not None and give_up.fired.done():
                    raise StragglerError(step, [self.parent], "no result from the parent in "
                                         "time")
        finally:
            deadline.cancel()
            if give_up is not None:
                give_up.cancel()

    def _act(self, asks: list[Ask]) -> None:
        for ask in asks:
            if ask.rank not in self.sources:
                self.sources[ask.rank] = Source(self.session, ask.rank, self.step, self.lay)
            self.session.request(ask.rank, ask.step)

    def _drop(self, src: Source) -> None:
        src.cancel()
        self.sources.pop(src.rank, None)

    def _won(self, src: Source) -> Outcome:
        self.fo.answered(src.rank, self.step)
        parent = self.sources.get(self.parent)
        if src.rank != self.parent and parent is not None:
            self.probe = parent  # does the parent still answer? checked at the next step
            del self.sources[self.parent]
        return src.outcome()

    def close(self) -> None:
        for src in self.sources.values():
            src.cancel()
