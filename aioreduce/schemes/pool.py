"""Arrays that serve one step after another once nothing refers to them any more.

A scheme allocates a step's receive buffers and result afresh every step, and fresh memory
costs a page fault (and the kernel's zeroing of the page) the first time it is written: on one
2-core host a 7-rank 64 MiB tree spent a fifth of its CPU time clearing pages. Handing the same
memory back is only safe once no one can see it: not the caller (a result it kept), not a
background send still reading it, not a receive that may still write into it, not a result log.
All of those hold a Python reference to the array or to a view of it (a numpy view, a tensor
from ``torch.from_numpy``, a memoryview all keep the owning array alive), so the owning array's
reference count says it: held by the pool alone, nobody else can see it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

# sys.getrefcount of an array held by the pool's list alone: the list and the call's argument.
_ONLY_POOL = 2


class BufferPool:
    """Hands out owning arrays; one that only the pool still refers to is handed out again.

    ``spare``: free arrays kept for reuse at most (the rest are let go, so a pool never holds
    much more memory than a step needs); ``track``: arrays followed at most (the oldest are
    forgotten; still-used ones then simply are not reused).
    """

    def __init__(self, spare: int = 2, track: int = 16) -> None:
        # track: a step takes a handful of arrays, and every take looks at each tracked one:
        # with 64, a 13-rank coded tree at 40 KB spent 40 % of a parent's step here, scanning
        # results that its result log holds for thousands of steps.
        self.spare, self.track = spare, track
        self._arrays: list[np.ndarray] = []  # newest last
        self.reused = 0  # arrays handed out again (for tests and telemetry)

    def take(self, size: int, dtype: np.dtype[Any]) -> np.ndarray:
        """A 1-D array of ``size`` elements of ``dtype``, contents undefined."""
        arrays = self._arrays
        # Newest first, so the match is the most recently used free array (warm in cache),
        # and the scan stops there: a step takes the same sizes every step, so it mostly
        # stops at once. Indices, not a loop over the arrays: a loop variable would be one
        # more reference. The free ones passed on the way are noted for a miss (a step's
        # result, which its result log keeps, misses every step: one scan, not two).
        free: list[int] = []
        for i in range(len(arrays) - 1, -1, -1):
            if sys.getrefcount(arrays[i]) == _ONLY_POOL:
                if arrays[i].size == size and arrays[i].dtype == dtype:
                    self.reused += 1
                    array = arrays.pop(i)
                    arrays.append(array)  # the newest now
                    return array
                free.append(i)
        # No match: new memory, so let go of the free arrays beyond ``spare`` (the oldest).
        drop = set(free[self.spare:])
        kept = [arrays[i] for i in range(len(arrays)) if i not in drop] if drop else arrays
        array = np.empty(size, dtype)
        self._arrays = [*kept[max(0, len(kept) + 1 - self.track):], array]
        return array
