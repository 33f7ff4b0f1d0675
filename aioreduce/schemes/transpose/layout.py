"""Where every element of a transpose step travels: shards, their owners, and slices.

Shard ``k`` (owned by rank ``k``) is a contiguous range of the (rotated) vector; the first
``L mod N`` shards get one element more. Each shard travels as slices of about
``slice_bytes``, so a sender that is cut off by a deadline loses only its last slices, and the
owner knows exactly which ranges of which contributions arrived. Pure arithmetic, no IO.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ...wire import tags

PHASE2_TAG = tags.SECOND  # phase-2 slice i travels on tag PHASE2_TAG + i; phase 1 on tag i
NOTICE_TAG = tags.NOTICE  # over the mesh, to a peer whose lane is full: the step we are at
TAIL = 0.99  # a slice at or past this fraction of its shard is a "tail" slice


@dataclass(frozen=True)
class Layout:
    """Shards and slices of a vector of ``length`` elements over ``world`` ranks."""

    length: int
    world: int
    slice_elems: int

    def __post_init__(self) -> None:
        if self.world < 1 or self.slice_elems < 1 or self.length < 0:
            raise ValueError("a layout needs world >= 1, slice_elems >= 1, length >= 0")
        if -(-(self.length // self.world + 1) // self.slice_elems) >= PHASE2_TAG:
            raise ValueError("too many slices per shard: raise slice_bytes")

    @cached_property
    def shards(self) -> list[tuple[int, int]]:
        """``[lo, hi)`` of every shard, by owner rank."""
        base, extra = divmod(self.length, self.world)
        bounds, lo = [], 0
        for k in range(self.world):
            hi = lo + base + (1 if k < extra else 0)
            bounds.append((lo, hi))
            lo = hi
        return bounds

    @cached_property
    def _slices(self) -> list[list[tuple[int, int]]]:
        return [[(s, min(s + self.slice_elems, hi)) for s in range(lo, hi, self.slice_elems)]
                for lo, hi in self.shards]

    def slices_of(self, owner: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` (absolute) of the slices of ``owner``'s shard, in sending order (computed
        once per layout: the session looks them up for every slot)."""
        return self._slices[owner]

    def tail_index(self, owner: int) -> int:
        """Index of the first tail slice of ``owner``'s shard (floating-point ratio: the
        public OptiReduce code divides integers here, so its early close never fires)."""
        n = len(self.slices_of(owner))
        return min(max(n - 1, 0), int(TAIL * n))
