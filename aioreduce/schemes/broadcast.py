"""An exact broadcast from one root to every rank, point to point (root sends to each)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np

from .base import Comm, Result

BROADCAST_TAG = (1 << 30) + 3


async def broadcast(comm: Comm, step: int, array: np.ndarray, root: int) -> Result:
    """Step ``step``: every rank gets ``root``'s ``array``; the others' arrays give the shape
    and dtype and are not modified."""
    t0 = time.perf_counter()
    comm.discard_before(step)
    try:
        if comm.rank == root:
            value = np.ascontiguousarray(array).copy()
            await asyncio.gather(*(comm.send(r, value, step=step, tag=BROADCAST_TAG)
                                   for r in range(comm.world_size) if r != root))
        else:
            value = np.empty_like(np.ascontiguousarray(array))
            await comm.post_recv(root, value, step=step, tag=BROADCAST_TAG)
    finally:
        comm.discard_before(step + 1)
    with contextlib.suppress(ValueError):
        value.setflags(write=False)
    return Result(value, step, [root], [], True, 0.0, time.perf_counter() - t0)
