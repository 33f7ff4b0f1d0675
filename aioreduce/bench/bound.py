"""Each scheme's own bound: how fast its traffic could go on the links it uses.

A step cannot beat the bytes through its busiest link direction over the link rate, plus its
depth (the messages that must follow one another) times the one-way latency. The bench prints
``measured / bound`` beside each median (``--bound``), so a scheme is judged against what its
own traffic allows, not against another scheme.

* ring and Gloo: every rank sends and receives ``2 V (N-1) / N``; depth ``2 (N-1)``.
* transpose: the same bytes, in two rounds; depth 2.
* trees and stars (tree, coded tree, star, gradient coding): up the tree each child sends its
  message to its parent, down it the parent sends each child the result, both directions
  at once when pipelined; a rank with ``k`` neighbours moves ``k V`` in and ``k V`` out
  (a gradient code with ``m > 1`` sends ``V / m`` up, still ``V`` down, so ``k V`` bounds its
  busiest direction too); depth ``2 x`` the tree's height (1 for a star).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schemes import CodedTree, GradientCoding, Scheme, Star, Tree
from ..topology import heap_parent


@dataclass(frozen=True)
class Bound:
    """A scheme's lower bound on one step: ``busiest_bytes / rate + depth * latency``."""

    busiest_bytes: float  # through the busiest link direction
    depth: int  # messages that must follow one another
    rate: float  # bytes per second of one link direction
    latency: float  # one-way, seconds

    @property
    def seconds(self) -> float:
        """The bound, seconds."""
        return self.busiest_bytes / self.rate + self.depth * self.latency


def _height(world: int, fanout: int) -> int:
    """Levels below the root of a heap-ordered tree of ``world`` ranks."""
    height, r = 0, world - 1
    while r > 0:
        parent = heap_parent(r, fanout)
        assert parent is not None
        r, height = parent, height + 1
    return height


def bound(name: str, scheme: Scheme | None, world: int, vector_bytes: float, *,
          rate: float, latency: float = 0.0) -> Bound | None:
    """The bound of scheme ``name`` (``scheme`` None: Gloo's ring) on ``world`` ranks for a
    vector of ``vector_bytes``; None where this module has no model of the scheme."""
    ring_bytes = 2.0 * vector_bytes * (world - 1) / world
    if name in ("ring", "gloo"):
        return Bound(ring_bytes, 2 * (world - 1), rate, latency)
    if name == "transpose":
        return Bound(ring_bytes, 2, rate, latency)
    if not isinstance(scheme, Tree | CodedTree | Star | GradientCoding):
        return None
    busiest = max(len(scheme.neighbours(r, world)) for r in range(world)) * vector_bytes
    if isinstance(scheme, Tree):
        height = _height(world, scheme.fanout)
    elif isinstance(scheme, CodedTree):
        height = scheme.levels
    else:
        height = 1
    return Bound(busiest, 2 * height, rate, latency)
