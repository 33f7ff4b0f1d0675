"""Gathering a family's messages chunk by chunk, and decoding the first sufficient set."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from ...codes import GradientCode
from ...errors import PeerLost, VectorMismatch
from ...wire import Header
from ..base import StepOptions
from .report import Report, Verdict


class Gather:
    """Which children delivered each chunk, in arrival order; when a chunk can be decoded.

    ``ready[c]`` resolves with the responders of chunk ``c`` as soon as they form a
    sufficient set, or with whatever arrived when :meth:`settle` is called (deadline) or no
    sufficient set remains possible (children failed).
    """

    def __init__(self, n: int, code: GradientCode | None, nchunks: int) -> None:
        loop = asyncio.get_running_loop()
        self.n = n
        self.code = code
        self.nchunks = nchunks
        self.arrived: list[list[int]] = [[] for _ in range(nchunks)]
        self.failed: dict[int, tuple[int, ...]] = {}  # child index -> ranks it reported missing
        # Which of them died: the children whose link broke (index), and the ranks below that
        # the children's verdicts name as lost. A rank that never talks to a dead one learns
        # it only from these (aioreduce.heal waits for the replacement of a lost rank).
        self.dead: set[int] = set()
        self.lost_below: set[int] = set()
        self.reports: dict[int, Report] = {}
        self.hopeless = False
        # Why the step cannot be decoded whatever arrives: a child's vector did not match
        # ours (child index, detail, None), or a child's verdict says so (index, the message,
        # the two ranks it names).
        self.mismatch: tuple[int, str, tuple[int, ...] | None] | None = None
        self.ready: list[asyncio.Future[list[int]]] = [loop.create_future()
                                                       for _ in range(nchunks)]
        if n == 0:
            self.settle()

    def sufficient(self, members: list[int]) -> bool:
        if self.code is None:
            return len(set(members)) == self.n
        return self.code.is_sufficient(members)

    def arrived_chunk(self, i: int, c: int, header: Header) -> None:
        if c == self.nchunks - 1:
            self.reports[i] = Report.from_meta(header.meta)
        self.arrived[c].append(i)
        if not self.ready[c].done() and self.sufficient(self.arrived[c]):
            self.ready[c].set_result(list(self.arrived[c]))

    def child_failed(self, i: int, missing: tuple[int, ...] = (), *, dead: bool = False,
                     lost: tuple[int, ...] = ()) -> None:
        self.failed.setdefault(i, missing)
        if dead:
            self.dead.add(i)
        self.lost_below.update(lost)
        alive = [j for j in range(self.n) if j not in self.failed]
        if not self.sufficient(alive):
            self.hopeless = True
            self.settle()  # it can never decode: stop waiting now

    def mismatched(self, i: int, text: str, ranks: tuple[int, ...] | None) -> None:
        """Child ``i`` sent a vector of another shape or dtype (or reports one below it): a
        caller's mistake, so the step fails for every rank even if a code could skip it."""
        if self.mismatch is None:
            self.mismatch = (i, text, ranks)
        self.hopeless = True
        self.settle()

    def settle(self) -> None:
        """Deadline (or hopeless): resolve every open chunk with what has arrived."""
        for c, r in enumerate(self.ready):
            if not r.done():
                r.set_result(list(self.arrived[c]))

    # -- future callbacks ---------------------------------------------------------------------
    def chunk_callback(self, i: int, c: int) -> Callable[[asyncio.Future[Header]], None]:
        def done(fut: asyncio.Future[Header]) -> None:
            if fut.cancelled():
                return
            exc = fut.exception()
            if isinstance(exc, VectorMismatch):
                self.mismatched(i, str(exc), None)
            elif exc is not None:
                self.child_failed(i, dead=isinstance(exc, PeerLost))
            else:
                self.arrived_chunk(i, c, fut.result())
        return done

    def verdict_callback(self, i: int) -> Callable[[asyncio.Future[Header]], None]:
        def done(fut: asyncio.Future[Header]) -> None:
            if not fut.cancelled() and fut.exception() is None:
                verdict = Verdict.from_meta(fut.result().meta)
                if verdict.mismatch:
                    self.mismatched(i, verdict.mismatch, verdict.missing)
                else:
                    self.child_failed(i, verdict.missing, lost=verdict.lost)
        return done

    # -- decoding -----------------------------------------------------------------------------
    def coefficients(self, responders: list[int], opts: StepOptions
                     ) -> tuple[np.ndarray | None, bool, float]:
        """Decoding coefficients for one chunk: (a, exact, error factor); a is None when the
        responders cannot decode and no approximation was asked for."""
        if self.sufficient(responders):
            if self.code is None:
                return np.ones(self.n), True, 0.0
            return self.code.decoder(responders), True, 0.0
        if opts.on_insufficient == "approximate" and self.code is not None:
            approx = self.code.approximate(responders)
            return approx.coefficients, False, approx.error_factor
        return None, False, 0.0

    def missing(self, kids: list[int], responders: list[int]) -> list[int]:
        """The ranks to blame: the failed children if they alone make decoding impossible,
        else every child that had not delivered; a child that failed because of ranks below
        it is replaced by those."""
        if self.hopeless:
            missing = {kids[i] for i in self.failed}
        else:
            missing = {kids[i] for i in range(len(kids)) if i not in responders}
        for i, below in self.failed.items():
            if below:
                missing.discard(kids[i])
                missing.update(below)
        return sorted(missing)

    def lost(self, kids: list[int], missing: list[int]) -> tuple[int, ...]:
        """Of ``missing``, the ranks known dead here: a child whose link broke, or a rank a
        child's verdict names as lost."""
        dead = self.lost_below | {kids[i] for i in self.dead}
        return tuple(r for r in missing if r in dead)


def combine(out: np.ndarray, mine: np.ndarray, bufs: list[np.ndarray], a: np.ndarray,
            lo: int, hi: int, msg_len: int, m: int) -> None:
    """out[chunk] = own chunk + sum_i a_i * child_i chunk (per output chunk row when m > 1)."""
    if m == 1:
        seg = out[lo:hi]
        coef = a.tolist()  # (Python floats: a numpy scalar's compare costs more)
        ones = [i for i, ai in enumerate(coef) if ai == 1.0]
        if ones:  # the first plain addition also copies our own term: one pass fewer
            np.add(mine[lo:hi], bufs[ones[0]][lo:hi], out=seg)
        else:
            np.copyto(seg, mine[lo:hi])
        scalar = seg.dtype.type
        for i, ai in enumerate(coef):
            if ai == 1.0 and i != ones[0]:
                seg += bufs[i][lo:hi]
            elif ai not in (0.0, 1.0):
                # In the vector's dtype: a float64 scalar would make a float64 temporary
                # and cast it back (4x the time for float32 vectors).
                seg += scalar(ai) * bufs[i][lo:hi]
        return
    rows = out.reshape(m, msg_len)
    for u in range(m):
        seg = rows[u, lo:hi]
        seg[...] = 0
        for j in np.flatnonzero(a[u]):
            seg += a[u, j] * bufs[j][lo:hi]
