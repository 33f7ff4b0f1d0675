"""An exact exchange step, point to point: each rank sends some arrays to some ranks and
receives some arrays from some ranks, straight into the caller's buffers.

``all_to_all`` (with split sizes), ``gather``, ``scatter`` and a direct reduce-scatter are each
one exchange: every rank of the job calls it at the same step, and each receiver knows the size
of what it receives (torch's calls always say so), so no sizes travel first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import numpy as np

from ..wire import tags
from .base import Comm

EXCHANGE_TAG = tags.EXCHANGE


async def exchange(comm: Comm, step: int, sends: Mapping[int, np.ndarray],
                   recvs: Mapping[int, np.ndarray]) -> None:
    """Step ``step``: send ``sends[r]`` to each rank ``r`` and receive from each rank ``r``
    into ``recvs[r]`` (writable, C-contiguous, the sender's dtype and byte size). This rank's
    own entry, if any, is copied locally (``recvs[me][...] = sends[me]``). Empty arrays do
    not travel (both sides know their size)."""
    me = comm.rank
    comm.discard_before(step)
    try:
        if me in recvs and me in sends:
            np.copyto(recvs[me].reshape(-1), sends[me].reshape(-1), casting="no")
        await asyncio.gather(
            *(comm.send(r, np.ascontiguousarray(a), step=step, tag=EXCHANGE_TAG)
              for r, a in sends.items() if r != me and a.size),
            *(comm.post_recv(r, out, step=step, tag=EXCHANGE_TAG)
              for r, out in recvs.items() if r != me and out.size))
    finally:
        comm.discard_before(step + 1)
