"""Ranks to neighbours for the runtime's schemes: heap trees over any N, rings, stars.

Full trees with per-level codes (CodedReduce) use :class:`aioreduce.codes.TreeTopology`;
the uncoded tree works for any number of ranks, so it uses these heap formulas directly.
"""

from __future__ import annotations


def heap_children(rank: int, fanout: int, size: int) -> list[int]:
    """Children of ``rank`` in a heap-indexed ``fanout``-ary tree of ``size`` ranks."""
    first = fanout * rank + 1
    return list(range(first, min(first + fanout, size)))


def heap_parent(rank: int, fanout: int) -> int | None:
    """Parent of ``rank`` (None for the root, rank 0)."""
    return None if rank == 0 else (rank - 1) // fanout


def ring_neighbours(rank: int, size: int) -> tuple[int, int]:
    """(previous, next) on the ring 0 -> 1 -> ... -> size-1 -> 0."""
    return (rank - 1) % size, (rank + 1) % size
