"""The owners' allreduce: rank ``r`` owns part ``r`` of the vector (``N`` nearly equal
consecutive parts). Every rank sends each owner its copy of that owner's part; the owner
reduces it and sends the result to every rank. Each rank sends ``V (N - 1) / N`` bytes each
way, as the ring does per phase, in two rounds instead of ``2 (N - 1)``, and every value is
reduced once, by its owner, with a reduction the caller gives: 16-bit floats accumulated in
float32 and rounded once (the ring would round every partial sum it forwards), integers, min,
max, product.

Pipelined by chunk, over :class:`~.links.Links` (lanes on a real mesh): the owner reduces
chunk ``i`` of its part as soon as every rank's copy of it is in, always in rank order (the
result does not depend on arrival), and sends it on while the next chunks still arrive.
With an :class:`~.base.Arrival` (a GPU tensor staged in pieces), a part is sent once it has
landed on the host, and each chunk of the result is handed back as soon as it is final.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

import numpy as np

from ..wire import Header
from .base import Arrival
from .links import Links

CHUNK_BYTES = 256 << 10  # at least, and at most PIPELINE chunks a part
PIPELINE = 4
RESULT_TAG = 1 << 24  # tag of result chunk i: RESULT_TAG + i (chunk i of the copies: i)

Reduce = Callable[[Sequence[np.ndarray], np.ndarray], None]
"""``reduce(parts, out)``: write the reduction of ``parts`` (every rank's copy, in rank
order) into ``out`` (which may be one of them)."""


def bounds(length: int, parts: int) -> list[int]:
    """Where ``parts`` nearly equal consecutive parts of ``length`` elements start (and the
    end): the first ``length % parts`` parts have one more."""
    q, r = divmod(length, parts)
    return [i * q + min(i, r) for i in range(parts + 1)]


def chunks(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into pieces of ``size`` elements (the last may be shorter; an empty
    range is one empty piece, so every rank agrees on the count)."""
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)] or [(lo, hi)]


def read_order(length: int, rank: int, world: int) -> list[tuple[int, int]]:
    """The parts in the order ``rank`` reads them: the next owners' first (rank + 1, ...,
    so no owner is everyone's first), its own last."""
    edge = bounds(length, world)
    return [(edge[r], edge[r + 1]) for r in ((rank + k) % world for k in range(1, world + 1))]


async def owners_allreduce(links: Links, step: int, rank: int, world: int, flat: np.ndarray,
                           reduce: Reduce, *, arrival: Arrival | None = None,
                           chunk_bytes: int = CHUNK_BYTES) -> None:
    """``flat`` (every rank the same length and dtype, C-contiguous) becomes the reduction
    of every rank's ``flat``, the same on every rank; step ``step`` of ``links``. Returns
    once what it sent is in the kernel (``flat`` may change then)."""
    edge = bounds(flat.size, world)
    # Every rank cuts every part alike: from the length and world size alone. A few chunks
    # a part overlap most of the reduction with the wire; each more costs messages and calls.
    size = max(1, chunk_bytes // max(1, flat.itemsize), -(-edge[1] // PIPELINE))
    others = [(rank + k) % world for k in range(1, world)]
    lo, hi = edge[rank], edge[rank + 1]
    mine = chunks(lo, hi, size)
    copies = {p: np.empty(hi - lo, flat.dtype) for p in others}
    links.discard_before(step)
    sending: asyncio.Task[None] | None = None
    try:
        incoming = [[links.post(p, copies[p][a - lo:b - lo], step, i) for p in others]
                    for i, (a, b) in enumerate(mine)]
        results: list[asyncio.Future[Header]] = []
        for owner in others:
            for i, (a, b) in enumerate(chunks(edge[owner], edge[owner + 1], size)):
                fut = links.post(owner, flat[a:b], step, RESULT_TAG + i)
                if arrival is not None:
                    fut.add_done_callback(_hand_back(arrival, a, b))
                results.append(fut)
        sending = asyncio.ensure_future(_send_copies(links, step, flat, edge, others, size,
                                                    arrival))
        if arrival is not None:
            await asyncio.to_thread(arrival.landed, lo, hi)
        for i, (a, b) in enumerate(mine):
            await asyncio.gather(*incoming[i])
            parts = [flat[a:b] if p == rank else copies[p][a - lo:b - lo]
                     for p in range(world)]
            reduce(parts, flat[a:b])
            if arrival is not None:
                arrival.final(a, b)
            for p in others:
                links.send(p, flat[a:b], step, RESULT_TAG + i, {})
        await sending
        await asyncio.gather(*results)
        await links.flush(others)
    finally:
        if sending is not None and not sending.done():
            sending.cancel()
            with contextlib.suppress(BaseException):
                await sending
        links.discard_before(step + 1)
        links.end_step(step)


async def _send_copies(links: Links, step: int, flat: np.ndarray, edge: list[int],
                       others: list[int], size: int, arrival: Arrival | None) -> None:
    """Send each owner its part of ``flat``, chunk by chunk, once the part is on the host."""
    for owner in others:
        a, b = edge[owner], edge[owner + 1]
        if arrival is not None:
            await asyncio.to_thread(arrival.landed, a, b)
        for i, (c, d) in enumerate(chunks(a, b, size)):
            links.send(owner, flat[c:d], step, i, {})


def _hand_back(arrival: Arrival, lo: int, hi: int) -> Callable[[asyncio.Future[Header]], None]:
    def done(fut: asyncio.Future[Header]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            arrival.final(lo, hi)
    return done
