"""Heap-indexed trees: rank 0 is the root (the master); ranks 1..N compute.

Ranks are numbered level by level. With a constant fan-out ``n`` this is heap indexing: the
children of ``k`` are ``n*k + 1 .. n*k + n`` and its parent is ``(k - 1) // n``. A per-level
fan-out ``(n_1, ..., n_L)`` (``n_l`` children for each node of level ``l - 1``) numbers the same
way, level after level.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


def _per_level(value: int | Sequence[int], levels: int, what: str) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * levels
    out = tuple(int(v) for v in value)
    if len(out) != levels:
        raise ValueError(f"{what} has {len(out)} entries for {levels} levels")
    return out


@dataclass(frozen=True)
class TreeTopology:
    """A tree of ``levels`` levels below the root, with ``fanout[l]`` children per node of
    level ``l`` (an int means the same fan-out everywhere)."""

    fanout: tuple[int, ...]
    levels: int

    def __init__(self, fanout: int | Sequence[int], levels: int) -> None:
        if levels < 1:
            raise ValueError(f"a tree needs at least one level below the root, got {levels}")
        fan = _per_level(fanout, levels, "fanout")
        if any(f < 1 for f in fan):
            raise ValueError(f"fan-outs must be positive, got {fan}")
        object.__setattr__(self, "fanout", fan)
        object.__setattr__(self, "levels", levels)

    @cached_property
    def _starts(self) -> tuple[int, ...]:
        """First rank of each level 0..L, and the total size at the end."""
        starts, count, first = [0], 1, 0
        for f in self.fanout:
            first += count
            count *= f
            starts.append(first)
        starts.append(first + count)
        return tuple(starts)

    @property
    def size(self) -> int:
        """Number of ranks, root included."""
        return self._starts[-1]

    def level(self, rank: int) -> int:
        """0 for the root, L for the leaves."""
        self._check(rank)
        return max(lv for lv in range(self.levels + 1) if self._starts[lv] <= rank)

    def ranks_at(self, level: int) -> range:
        """The ranks of one level."""
        return range(self._starts[level], self._starts[level + 1])

    def children(self, rank: int) -> list[int]:
        """Children of ``rank`` in order (empty for a leaf)."""
        lv = self.level(rank)
        if lv == self.levels:
            return []
        f = self.fanout[lv]
        first = self._starts[lv + 1] + (rank - self._starts[lv]) * f
        return list(range(first, first + f))

    def parent(self, rank: int) -> int | None:
        """Parent of ``rank``; None for the root."""
        lv = self.level(rank)
        if lv == 0:
            return None
        return self._starts[lv - 1] + (rank - self._starts[lv]) // self.fanout[lv - 1]

    def family(self, rank: int) -> list[int]:
        """``rank`` and its siblings: the children of its parent."""
        p = self.parent(rank)
        return [0] if p is None else self.children(p)

    @property
    def leaves(self) -> range:
        return self.ranks_at(self.levels)

    @property
    def workers(self) -> int:
        """Ranks below the root (they all compute in CodedReduce)."""
        return self.size - 1

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in this tree of {self.size} ranks")

    def __repr__(self) -> str:
        fan = self.fanout[0] if len(set(self.fanout)) == 1 else list(self.fanout)
        return f"TreeTopology(fanout={fan}, levels={self.levels}, size={self.size})"


def tree_size(fanout: int, levels: int) -> int:
    """Ranks in a regular tree, root included: 1 + n + ... + n^L."""
    return 1 + sum(fanout ** lv for lv in range(1, levels + 1)) if fanout > 1 else levels + 1

