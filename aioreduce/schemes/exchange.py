"""An exact exchange step, point to point: each rank sends some arrays to some ranks and
receives some arrays from some ranks, straight into the caller's buffers.

``all_to_all`` (with split sizes), ``gather``, ``scatter`` and a direct reduce-scatter are each
one exchange: every rank of the job calls it at the same step, and each receiver knows the size
of what it receives (torch's calls always say so), so no sizes travel first.

It goes over the comm (frames on the event loop), or over ``links``: the lanes of every peer
(:class:`~.links.LaneLinks`), where bulk data moves on threads of its own while the loop
computes (the owners' sums of 16-bit floats).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

import numpy as np

from ..wire import tags
from .base import Comm
from .links import LaneLinks

EXCHANGE_TAG = tags.EXCHANGE


Each = Callable[[int], None]


async def exchange(comm: Comm, step: int, sends: Mapping[int, np.ndarray],
                   recvs: Mapping[int, np.ndarray], links: LaneLinks | None = None,
                   each: Each | None = None) -> None:
    """Step ``step``: send ``sends[r]`` to each rank ``r`` and receive from each rank ``r``
    into ``recvs[r]`` (writable, C-contiguous, the sender's dtype and byte size). This rank's
    own entry, if any, is copied locally (``recvs[me][...] = sends[me]``). Empty arrays do
    not travel (both sides know their size). Over ``links``, it returns once what it sent
    is in the kernel too (the arrays may change then).

    ``each(r)``, if given, is called for every rank ``r`` of ``recvs`` in rank order, as soon
    as ``recvs[r]`` and those of every lower rank are filled: a caller reduces or copies out
    each part while later ones are still on the wire, in an order that does not depend on
    which came first (so its float sums are the same on every run)."""
    me = comm.rank
    if links is not None:
        await _over_links(links, me, step, sends, recvs, each)
        return
    comm.discard_before(step)
    try:
        _copy_own(me, sends, recvs)
        posts = {r: comm.post_recv(r, out, step=step, tag=EXCHANGE_TAG)
                 for r, out in recvs.items() if r != me and out.size}
        await asyncio.gather(
            *(comm.send(r, np.ascontiguousarray(a), step=step, tag=EXCHANGE_TAG)
              for r, a in sends.items() if r != me and a.size),
            _in_order(posts, recvs, each))
    finally:
        comm.discard_before(step + 1)


async def _in_order(posts: Mapping[int, Awaitable[object]], recvs: Mapping[int, np.ndarray],
                    each: Each | None) -> None:
    """Wait for ``posts``; with ``each``, call it for every rank of ``recvs`` in rank order
    once that rank's receive (if it has one) is done."""
    if each is None:
        await asyncio.gather(*posts.values())
        return
    try:
        for r in sorted(recvs):
            post = posts.get(r)
            if post is not None:
                await post
            each(r)
    finally:  # on an error, the receives not waited for are withdrawn, their errors taken
        for post in posts.values():
            if isinstance(post, asyncio.Future) and not post.done():
                post.cancel()


async def _over_links(links: LaneLinks, me: int, step: int, sends: Mapping[int, np.ndarray],
                      recvs: Mapping[int, np.ndarray], each: Each | None) -> None:
    links.discard_before(step)
    try:
        _copy_own(me, sends, recvs)
        posts = {r: links.post(r, out, step, EXCHANGE_TAG)
                 for r, out in recvs.items() if r != me and out.size}
        to = [r for r, a in sends.items() if r != me and a.size]
        for r in to:
            links.send(r, np.ascontiguousarray(sends[r]), step, EXCHANGE_TAG, {})
        await _in_order(posts, recvs, each)
        await links.flush(to)
    finally:
        links.discard_before(step + 1)
        links.end_step(step)


def _copy_own(me: int, sends: Mapping[int, np.ndarray], recvs: Mapping[int, np.ndarray]) -> None:
    """This rank's own entry, if it sends and receives one, is copied locally."""
    if me in recvs and me in sends:
        np.copyto(recvs[me].reshape(-1), sends[me].reshape(-1), casting="no")
