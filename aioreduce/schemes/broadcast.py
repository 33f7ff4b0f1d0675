"""An exact broadcast from one root to every rank, point to point (root sends to each)."""

from __future__ import annotations

import contextlib
import time

import numpy as np

from .base import Comm, Result
from .exchange import exchange


async def broadcast(comm: Comm, step: int, array: np.ndarray, root: int) -> Result:
    """Step ``step``: every rank gets ``root``'s ``array``; the others' arrays give the shape
    and dtype and are not modified."""
    t0 = time.perf_counter()
    if comm.rank == root:
        value = np.ascontiguousarray(array).copy()
        await exchange(comm, step, {r: value for r in range(comm.world_size) if r != root}, {})
    else:
        value = np.empty_like(np.ascontiguousarray(array))
        await exchange(comm, step, {}, {root: value})
    with contextlib.suppress(ValueError):
        value.setflags(write=False)
    return Result(value, step, [root], [], True, 0.0, time.perf_counter() - t0)
