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
from collections.abc import Mapping

import numpy as np

from ..wire import tags
from .base import Comm
from .links import LaneLinks

EXCHANGE_TAG = tags.EXCHANGE


async def exchange(comm: Comm, step: int, sends: Mapping[int, np.ndarray],
                   recvs: Mapping[int, np.ndarray], links: LaneLinks | None = None) -> None:
    """Step ``step``: send ``sends[r]`` to each rank ``r`` and receive from each rank ``r``
    into ``recvs[r]`` (writable, C-contiguous, the sender's dtype and byte size). This rank's
    own entry, if any, is copied locally (``recvs[me][...] = sends[me]``). Empty arrays do
    not travel (both sides know their size). Over ``links``, it returns once what it sent
    is in the kernel too (the arrays may change then)."""
    me = comm.rank
    if links is not None:
        await _over_links(links, me, step, sends, recvs)
        return
    comm.discard_before(step)
    try:
        _copy_own(me, sends, recvs)
        await asyncio.gather(
            *(comm.send(r, np.ascontiguousarray(a), step=step, tag=EXCHANGE_TAG)
              for r, a in sends.items() if r != me and a.size),
            *(comm.post_recv(r, out, step=step, tag=EXCHANGE_TAG)
              for r, out in recvs.items() if r != me and out.size))
    finally:
        comm.discard_before(step + 1)


async def _over_links(links: LaneLinks, me: int, step: int, sends: Mapping[int, np.ndarray],
                      recvs: Mapping[int, np.ndarray]) -> None:
    links.discard_before(step)
    try:
        _copy_own(me, sends, recvs)
        posts = [links.post(r, out, step, EXCHANGE_TAG)
                 for r, out in recvs.items() if r != me and out.size]
        to = [r for r, a in sends.items() if r != me and a.size]
        for r in to:
            links.send(r, np.ascontiguousarray(sends[r]), step, EXCHANGE_TAG, {})
        await asyncio.gather(*posts)
        await links.flush(to)
    finally:
        links.discard_before(step + 1)
        links.end_step(step)


def _copy_own(me: int, sends: Mapping[int, np.ndarray], recvs: Mapping[int, np.ndarray]) -> None:
    """This rank's own entry, if it sends and receives one, is copied locally."""
    if me in recvs and me in sends:
        np.copyto(recvs[me].reshape(-1), sends[me].reshape(-1), casting="no")
