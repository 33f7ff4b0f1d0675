"""Reduce to a root through families that decode, then broadcast the result: pipelined.

This one engine runs CodedReduce (a tree whose families use gradient codes), gradient coding
on a star (one family), and the uncoded tree and star (families that need every child).

Per step, on every rank (``step`` tags every frame, so nothing mixes across steps):

1. post the receives for every chunk from every child, the result chunks from the parent, and
   the error frames, *before* the rank's own compute is awaited;
2. per chunk, wait until the children that delivered it form a sufficient set for the family's
   code (first arrivals win; each chunk may use a different set), or until the deadline;
3. decode: own chunk + sum of a_i * child chunk; send it up at once, so levels overlap;
4. the root's decoded chunks are the result; every rank forwards result chunks to its children
   as they arrive, in the background, so a slow child never holds up a fast parent.

A family that cannot decode by the deadline either fails the step (an error travels up to the
root, which broadcasts it, so every rank raises the same :class:`StragglerError`) or, with
``on_insufficient="approximate"``, decodes the least-squares optimum and flags the result.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..codes import GradientCode
from ..errors import PeerLost
from ..wire import Header
from .base import (
    ADOPT_TAG,
    DOWN,
    ERROR_TAG,
    Comm,
    Result,
    StepOptions,
    StragglerError,
    chunk_bounds,
)

log = logging.getLogger("aioreduce.schemes")

Spawn = Callable[[int, int, Coroutine[Any, Any, None]], None]
_EMPTY = np.zeros(0, np.uint8)


@dataclass(frozen=True)
class Family:
    """One rank's place in the reduction: its parent, its children and their code."""

    parent: int | None
    children: list[int]
    code: GradientCode | None  # None: every child is needed and contributions are summed
    parent_m: int = 1  # the parent's message reduction: a leaf sends ceil(length / m) entries
    grandparent: int | None = None  # sends us the result if our parent is lost
    grandchildren: dict[int, list[int]] = field(default_factory=dict)  # child -> its children


class _Gather:
    """Which children delivered each chunk, in arrival order; when a chunk can be decoded."""

    def __init__(self, family: Family, nchunks: int) -> None:
        loop = asyncio.get_running_loop()
        self.n = len(family.children)
        self.code = family.code
        self.nchunks = nchunks
        self.arrived: list[list[int]] = [[] for _ in range(nchunks)]
        self.failed: dict[int, list[int]] = {}  # child index -> ranks it reported missing
        self.meta: dict[int, dict[str, Any]] = {}
        self.hopeless = False  # enough children failed that no set can decode
        self.ready: list[asyncio.Future[list[int]]] = [loop.create_future()
                                                       for _ in range(nchunks)]
        if self.n == 0:
            self.settle()  # a leaf decodes nothing
    def sufficient(self, members: list[int]) -> bool:
        if self.code is None:
            return len(set(members)) == self.n
        return self.code.is_sufficient(members)

    def chunk_done(self, i: int, c: int, fut: asyncio.Future[Header]) -> None:
        if fut.cancelled():
            return
        if fut.exception() is not None:
            self.child_failed(i, [])
            return
        if c == self.nchunks - 1:
            self.meta[i] = fut.result().meta
        self.arrived[c].append(i)
        if not self.ready[c].done() and self.sufficient(self.arrived[c]):
            self.ready[c].set_result(list(self.arrived[c]))

    def child_failed(self, i: int, missing: list[int]) -> None:
        self.failed.setdefault(i, missing)
        alive = [j for j in range(self.n) if j not in self.failed]
        if not self.sufficient(alive):
            self.hopeless = True
            self.settle()  # it can never decode: stop waiting now

    def settle(self) -> None:
        """Deadline (or hopeless): resolve every open chunk with what has arrived."""
        for c, r in enumerate(self.ready):
            if not r.done():
                r.set_result(list(self.arrived[c]))


class _Memory:
    """What a parent keeps for its grandchildren.

    The last results it passed down, re-sent to the children of a child that dies (a result
    sent to it just before its death would otherwise strand them); and the children that are
    alive but not passing results on (a stopped process), whose children asked to be adopted:
    from then on they get every result from this rank directly.
    """

    KEEP = 2

    def __init__(self, comm: Comm, spawn: Spawn) -> None:
        self.comm, self.spawn = comm, spawn
        self.family: Family | None = None
        self.recent: dict[int, tuple[np.ndarray, list[tuple[int, int]], dict[str, Any]]] = {}
        self.frozen: set[int] = set()
        self._listening: set[int] = set()
        comm.on_peer_lost(self.lost)

    @classmethod
    def of(cls, comm: Comm, spawn: Spawn, family: Family) -> _Memory:
        mem = comm.scheme_state.get("tree-memory")
        if not isinstance(mem, cls):
            mem = comm.scheme_state["tree-memory"] = cls(comm, spawn)
        mem.family = family
        for child, grandkids in family.grandchildren.items():
            for g in grandkids:
                if g not in mem._listening:
                    comm.relay_from(g, ADOPT_TAG, functools.partial(mem.adopt, child))
                    mem._listening.add(g)
        return mem

    def skips(self, child: int) -> bool:
        """Must results bypass ``child`` (dead, or not passing them on)?"""
        return child in self.frozen or self.comm.is_lost(child)

    def adopt(self, child: int, header: Header, payload: memoryview) -> None:
        """A child of ``child`` got no result from it: serve it (and its siblings) directly."""
        if self.comm.closing:
            return
        if child not in self.frozen:
            log.warning("rank %d: rank %d passes no results on; sending them to its children "
                        "directly", self.comm.rank, child)
            self.frozen.add(child)
        if header.step not in self.recent and header.step < min(self.recent, default=0):
            # Too old to serve: say so at once rather than let the grandchild wait it out.
            self.spawn(header.src, header.step, self.comm.send(
                header.src, _EMPTY, step=header.step, tag=ERROR_TAG,
                meta={"missing": [child]}))
            return
        self._resend(header.step, [header.src])

    def lost(self, rank: int) -> None:
        fam = self.family
        if fam is None or rank not in fam.children or self.comm.closing:
            return  # peers leaving at the end of the job are not failures
        for step in sorted(self.recent):
            self._resend(step, fam.grandchildren.get(rank, []))

    def _resend(self, step: int, targets: list[int]) -> None:
        if step not in self.recent:
            return  # not decoded yet: it will go to them directly when it is
        value, bounds, meta = self.recent[step]
        for target in targets:
            for c, (lo, hi) in enumerate(bounds):
                last = meta if c == len(bounds) - 1 else None
                self.spawn(target, step, self.comm.send(target, value[lo:hi], step=step,
                                                        tag=DOWN + c, meta=last))

    def remember(self, step: int, value: np.ndarray, bounds: list[tuple[int, int]],
                 meta: dict[str, Any]) -> None:
        self.recent[step] = (value, bounds, meta)
        for old in sorted(self.recent)[:-self.KEEP]:
            del self.recent[old]


async def reduce_broadcast(comm: Comm, family: Family, like: np.ndarray,
                           own: Awaitable[np.ndarray], step: int, opts: StepOptions,
                           spawn: Spawn) -> Result:
    """Run one step on this rank; see the module docstring. ``like`` fixes shape and dtype."""
    t0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    comm.discard_before(step)
    flat_like = like.reshape(-1)
    length, dtype = flat_like.size, flat_like.dtype
    bounds = chunk_bounds(length, dtype.itemsize, opts.chunk_bytes)
    K = len(bounds)
    kids, parent, code = family.children, family.parent, family.code
    m = code.m if code is not None else 1
    msg_len = -(-length // m)  # children's messages are m times shorter
    msg_bounds = chunk_bounds(msg_len, dtype.itemsize, opts.chunk_bytes) if m > 1 else bounds

    # 1. Post every receive of this step first.
    gather = _Gather(family, len(msg_bounds))
    bufs = [np.empty(msg_len, dtype) for _ in kids]
    posted: list[asyncio.Future[Header]] = []
    for i, child in enumerate(kids):
        for c, (lo, hi) in enumerate(msg_bounds):
            f = comm.post_recv(child, bufs[i][lo:hi], step=step, tag=c)
            f.add_done_callback(functools.partial(gather.chunk_done, i, c))
            posted.append(f)
        e = comm.post_recv(child, _EMPTY[:0], step=step, tag=ERROR_TAG)
        e.add_done_callback(functools.partial(_child_error, gather, i))
        posted.append(e)
    result = np.empty(length, dtype)
    down: list[asyncio.Future[Header]] = []
    down_err: asyncio.Future[Header] | None = None
    if parent is not None:
        for c, (lo, hi) in enumerate(bounds):
            f = comm.post_recv(parent, result[lo:hi], step=step, tag=DOWN + c)
            f.add_done_callback(functools.partial(_forward, comm, family, result, bounds, c,
                                                  step, spawn))
            down.append(f)
        down_err = comm.post_recv(parent, _EMPTY[:0], step=step, tag=ERROR_TAG)
        posted += [*down, down_err]
    memory = _Memory.of(comm, spawn, family) if kids else None
    if parent is not None and kids:
        # Results (and the root's errors) go on to our children the moment they arrive, even
        # while this rank is still busy with an earlier step: a slow parent must not pace its
        # whole subtree.
        comm.relay_from(parent, DOWN, functools.partial(_relay, comm, family, spawn))
    deadline = loop.call_later(opts.deadline, gather.settle)

    try:
        mine = (await own).reshape(-1)
        own_len = -(-length // family.parent_m)
        if mine.size != own_len or mine.dtype != dtype:
            raise ValueError(f"step {step}: vector of {mine.size} {mine.dtype} differs from "
                             f"the {own_len} {dtype} this step was posted for")
        if not kids:  # a leaf: its own vector is its message, sent without a copy
            assert parent is not None and down_err is not None
            up = chunk_bounds(own_len, dtype.itemsize, opts.chunk_bytes)
            leaf_meta = _report(comm.rank, kids, gather, set(), True, 0.0)
            leaf_sends = [loop.create_task(comm.send(
                parent, mine[lo:hi], step=step, tag=c,
                meta=leaf_meta if c == len(up) - 1 else None)) for c, (lo, hi) in enumerate(up)]
            return await _await_result(comm, family, down, down_err, result, bounds, step,
                                       opts, leaf_sends, spawn, t0, None)
        # 2-3. Decode chunk after chunk and pass each one on at once.
        out = np.empty(length if m == 1 else m * msg_len, dtype)
        exact, err = True, 0.0
        used_kids: set[int] = set()
        failure: StragglerError | None = None
        meta: dict[str, Any] | None = None
        sends: list[asyncio.Task[None]] = []
        for c, (lo, hi) in enumerate(msg_bounds):
            responders = await gather.ready[c]
            a, c_exact, c_err = _coefficients(gather, responders, opts, len(kids))
            if a is None:
                failure = StragglerError(step, _missing(gather, kids, responders))
                break
            exact, err = exact and c_exact, max(err, c_err)
            used_kids.update(i for i in range(len(kids)) if np.any(a[..., i]))
            _combine(out, mine, bufs, a, lo, hi, msg_len, m)
            if m > 1:
                continue  # a star root with short messages finishes all chunks first
            meta = None
            if c == K - 1:
                meta = _report(comm.rank, kids, gather, used_kids, exact, err)
            if parent is not None:
                sends.append(loop.create_task(comm.send(parent, out[lo:hi], step=step, tag=c,
                                                        meta=meta)))
            else:
                _send_down(comm, family, out[lo:hi], step, DOWN + c, meta, spawn)
        if m > 1 and failure is None:
            meta = _report(comm.rank, kids, gather, used_kids, exact, err)
            out = np.ascontiguousarray(out[:length] + mine)  # the master's own term (zero)
            for c, (lo, hi) in enumerate(bounds):
                _send_down(comm, family, out[lo:hi], step, DOWN + c,
                           meta if c == K - 1 else None, spawn)

        if parent is None:
            if failure is not None:
                _send_down(comm, family, _EMPTY, step, ERROR_TAG,
                           {"missing": failure.missing}, spawn)
                raise failure
            assert meta is not None
            if memory is not None:
                memory.remember(step, out[:length], bounds, meta)
            return _result(out[:length], step, meta, t0)

        if failure is not None:  # tell the parent now instead of letting it time out
            sends.append(loop.create_task(comm.send(parent, _EMPTY, step=step, tag=ERROR_TAG,
                                                    meta={"missing": failure.missing})))
        # 4. The result (or the root's verdict) comes down from the parent.
        assert down_err is not None
        return await _await_result(comm, family, down, down_err, result, bounds, step, opts,
                                   sends, spawn, t0, memory)
    finally:
        deadline.cancel()
        for f in posted:
            if not f.done():
                f.cancel()
        comm.discard_before(step + 1)


def _child_error(gather: _Gather, i: int, fut: asyncio.Future[Header]) -> None:
    if fut.cancelled() or fut.exception() is not None:
        return
    missing = fut.result().meta.get("missing", [])
    gather.child_failed(i, [int(r) for r in missing] if isinstance(missing, list) else [])


def _coefficients(gather: _Gather, responders: list[int], opts: StepOptions,
                  n: int) -> tuple[np.ndarray | None, bool, float]:
    """Decoding coefficients for one chunk: (a, exact, error factor), a is None on failure."""
    if gather.sufficient(responders):
        if gather.code is None:
            return np.ones(n), True, 0.0
        return gather.code.decoder(responders), True, 0.0
    if opts.on_insufficient == "approximate" and gather.code is not None:
        approx = gather.code.approximate(responders)
        return approx.coefficients, False, approx.error_factor
    return None, False, 0.0


def _missing(gather: _Gather, kids: list[int], responders: list[int]) -> list[int]:
    """The ranks to blame: the failed children if they alone make decoding impossible, else
    every child that had not delivered by the deadline."""
    if gather.hopeless:
        missing = {kids[i] for i in gather.failed}
    else:
        missing = {kids[i] for i in range(len(kids)) if i not in responders}
    for i, below in gather.failed.items():
        if below:  # the child failed because of ranks below it: name those
            missing.discard(kids[i])
            missing.update(below)
    return sorted(missing)


def _combine(out: np.ndarray, mine: np.ndarray, bufs: list[np.ndarray], a: np.ndarray,
             lo: int, hi: int, msg_len: int, m: int) -> None:
    """out[chunk] = own chunk + sum_i a_i * child_i chunk (per output chunk row when m > 1)."""
    if m == 1:
        seg = out[lo:hi]
        ones = [i for i, ai in enumerate(a) if ai == 1.0]
        if ones:  # the first plain addition also copies our own term: one pass fewer
            np.add(mine[lo:hi], bufs[ones[0]][lo:hi], out=seg)
        else:
            np.copyto(seg, mine[lo:hi])
        for i, ai in enumerate(a):
            if ai == 1.0 and i != ones[0]:
                seg += bufs[i][lo:hi]
            elif ai not in (0.0, 1.0):
                seg += ai * bufs[i][lo:hi]
        return
    rows = out.reshape(m, msg_len)
    for u in range(m):
        seg = rows[u, lo:hi]
        seg[...] = 0
        for j in np.flatnonzero(a[u]):
            seg += a[u, j] * bufs[j][lo:hi]


def _report(rank: int, kids: list[int], gather: _Gather, used_kids: set[int], exact: bool,
            err: float) -> dict[str, Any]:
    """Which ranks this subtree's message used and skipped, and whether it is exact."""
    used, late = [rank], []
    for i, child in enumerate(kids):
        meta = gather.meta.get(i, {})
        if i in used_kids:
            used += meta.get("used", [child])
            late += meta.get("late", [])
            exact = exact and bool(meta.get("exact", True))
            err = max(err, float(meta.get("err", 0.0)))
        else:
            late += [child]
    return {"used": sorted(used), "late": sorted(late), "exact": exact, "err": err}


def _send_down(comm: Comm, family: Family, chunk: np.ndarray, step: int, tag: int,
               meta: dict[str, Any] | None, spawn: Spawn) -> None:
    """Pass a result chunk (or the error frame) to every child; the children of a child whose
    connection broke, or that passes nothing on, get it from us directly."""
    memory = comm.scheme_state.get("tree-memory")
    for child in family.children:
        targets = [child]
        if memory.skips(child) if isinstance(memory, _Memory) else comm.is_lost(child):
            targets = family.grandchildren.get(child, [])
        for target in targets:
            spawn(target, step, comm.send(target, chunk, step=step, tag=tag, meta=meta))


def _forward(comm: Comm, family: Family, result: np.ndarray, bounds: list[tuple[int, int]],
             c: int, step: int, spawn: Spawn, fut: asyncio.Future[Header]) -> None:
    if (family.children and not fut.cancelled() and fut.exception() is None
            and comm.claim_forward(step, DOWN + c)):
        lo, hi = bounds[c]
        meta = fut.result().meta or None
        _send_down(comm, family, result[lo:hi], step, DOWN + c, meta, spawn)


def _relay(comm: Comm, family: Family, spawn: Spawn, header: Header,
           payload: memoryview) -> None:
    """A result chunk or error frame arrived before its receive was posted: pass it on."""
    if comm.claim_forward(header.step, header.tag):
        data = np.frombuffer(payload, dtype=header.dtype or np.uint8)
        _send_down(comm, family, data, header.step, header.tag, header.meta or None, spawn)


def _result(value: np.ndarray, step: int, meta: dict[str, Any], t0: float) -> Result:
    value.setflags(write=False)  # it may still be on its way to slower ranks
    return Result(value, step, list(meta.get("used", [])), list(meta.get("late", [])),
                  bool(meta.get("exact", True)), float(meta.get("err", 0.0)),
                  time.perf_counter() - t0)


async def _await_result(comm: Comm, family: Family, down: list[asyncio.Future[Header]],
                        down_err: asyncio.Future[Header], result: np.ndarray,
                        bounds: list[tuple[int, int]], step: int, opts: StepOptions,
                        sends: list[asyncio.Task[None]], spawn: Spawn, t0: float,
                        memory: _Memory | None) -> Result:
    """Wait for the result (or the root's error) from the parent, forwarding as it comes.

    If the parent's connection breaks, or it stays silent for a whole deadline (a stopped
    process), we also listen to our grandparent: it adopts the children of a child it lost or
    cut off, so a dead or frozen intermediate rank does not strand its subtree. Whichever
    source completes first wins; both carry the same result, into the same buffer.
    """
    assert family.parent is not None
    loop = asyncio.get_running_loop()
    sources: dict[int, tuple[list[asyncio.Future[Header]], asyncio.Future[Header]]] = {
        family.parent: (down, down_err)}
    fallback = family.grandparent
    # A parent that failed us before is not waited on again: the grandparent is asked at once.
    eager = comm.scheme_state.get("bypassed-parent") == family.parent
    extra: list[asyncio.Future[Header]] = []
    # Generous: the root itself may wait a whole deadline per level below it.
    give_up = loop.time() + opts.deadline * 4 + 10
    try:
        while True:
            winner = next((src for src, (fs, _e) in sources.items() if _complete(fs)), None)
            if winner is not None:
                headers = [f.result() for f in sources[winner][0]]
                if winner == family.parent:
                    comm.scheme_state.pop("bypassed-parent", None)  # it is back
                break
            for _fs, err in sources.values():
                if err.done() and not err.cancelled() and err.exception() is None:
                    missing = [int(r) for r in err.result().meta.get("missing", [])]
                    if comm.claim_forward(step, ERROR_TAG):
                        _send_down(comm, family, _EMPTY, step, ERROR_TAG,
                                   {"missing": missing}, spawn)
                    raise StragglerError(step, missing)
            lost = [src for src, (fs, _e) in sources.items() if _broken(fs)]
            for src in lost:
                reason = _reason(sources.pop(src)[0])
                log.info("rank %d: lost %d (%s) while waiting for step %d's result",
                         comm.rank, src, reason, step)
            pending = {f for fs, e in sources.values() for f in (*fs, e) if not f.done()}
            now = loop.time()
            patience = give_up - now
            if fallback is not None and not lost and not eager:
                patience = min(patience, max(0.0, t0 + opts.deadline - time.perf_counter()))
            if (lost or eager or patience <= 0) and fallback is not None:
                comm.scheme_state["bypassed-parent"] = family.parent
                log.info("rank %d: also taking step %d's result from rank %d", comm.rank,
                         step, fallback)
                fs = [comm.post_recv(fallback, result[lo:hi], step=step, tag=DOWN + c)
                      for c, (lo, hi) in enumerate(bounds)]
                for c, f in enumerate(fs):
                    f.add_done_callback(functools.partial(_forward, comm, family, result,
                                                          bounds, c, step, spawn))
                e = comm.post_recv(fallback, _EMPTY[:0], step=step, tag=ERROR_TAG)
                sources[fallback] = (fs, e)
                # Ask for adoption: the grandparent may not know our parent is gone or frozen.
                spawn(fallback, step, comm.send(fallback, _EMPTY, step=step, tag=ADOPT_TAG))
                extra += [*fs, e]
                fallback = None
                continue
            if not sources or now >= give_up:
                detail = "lost the parent" if lost else "no result from the parent in time"
                raise StragglerError(step, lost or [family.parent], detail)
            await asyncio.wait(pending, timeout=max(0.0, patience),
                               return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f in extra:
            if not f.done():
                f.cancel()
        await _finish_sends(comm, family.parent, sends)
    if memory is not None:
        memory.remember(step, result, bounds, headers[-1].meta)
    return _result(result, step, headers[-1].meta, t0)


def _complete(futs: list[asyncio.Future[Header]]) -> bool:
    return all(f.done() and not f.cancelled() and f.exception() is None for f in futs)


def _broken(futs: list[asyncio.Future[Header]]) -> bool:
    return any(f.done() and not f.cancelled() and f.exception() is not None for f in futs)


def _reason(futs: list[asyncio.Future[Header]]) -> str:
    exc = next(f.exception() for f in futs if f.done() and not f.cancelled()
               and f.exception() is not None)
    return exc.reason if isinstance(exc, PeerLost) else str(exc)


async def _finish_sends(comm: Comm, parent: int, sends: list[asyncio.Task[None]]) -> None:
    """Our messages must be out of our buffers before we return (the caller may reuse its
    vector). The parent has answered, so they drain; a parent that stopped reading is cut."""
    if not sends:
        return
    done, pending = await asyncio.wait(sends, timeout=5.0)
    for t in done:
        if not t.cancelled() and t.exception() is not None:
            log.debug("send to parent %d failed: %s", parent, t.exception())
    if pending:
        comm.abort_peer(parent, "our messages to it did not drain")
        for t in pending:
            t.cancel()
