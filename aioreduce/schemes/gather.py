"""An exact all-gather, point to point: every rank sends its array to every other rank.

For the small tensors torch programs gather (shapes, flags, metrics) and for reductions that
are not sums (min, max, product: gather, then reduce locally, exactly). It sends ``N - 1``
copies of the array from every rank, so it is not meant for gradients.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from .base import Comm, Result
from .exchange import exchange


async def allgather(comm: Comm, step: int, array: np.ndarray) -> Result:
    """Step ``step``: every rank gets every rank's ``array`` stacked along a new first axis
    (row ``r`` is rank ``r``'s); every rank passes the same shape and dtype."""
    t0 = time.perf_counter()
    mine = np.ascontiguousarray(array)
    value = np.empty((comm.world_size, *mine.shape), mine.dtype)
    others = [r for r in range(comm.world_size) if r != comm.rank]
    value[comm.rank] = mine
    await exchange(comm, step, dict.fromkeys(others, mine), {r: value[r] for r in others})
    with contextlib.suppress(ValueError):
        value.setflags(write=False)
    return Result(value, step, list(range(comm.world_size)), [], True, 0.0,
                  time.perf_counter() - t0)
