"""CodedReduce (``CodedTree``) and the uncoded tree (``Tree``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..codes import CodedTreePlan, GradientCode, TreeTopology, coded_tree_plan, coded_tree_unit
from ..topology import heap_children, heap_parent
from .base import Comm, OnInsufficient, StepOptions
from .reduce import Family, ReduceSession

_PLANS_KEPT = 4  # data-set sizes whose plan a CodedTree keeps (a train and a test set, say)


@dataclass(frozen=True)
class CodedTree:
    """CodedReduce: a tree of ``levels`` levels below rank 0, ``fanout`` children per node;
    every parent decodes from any ``fanout - stragglers`` of its children.

    Every rank but the root computes: ask :meth:`placement` which weighted samples, pass the
    weighted gradient to ``node.aggregate``. The job must have exactly
    ``TreeTopology(fanout, levels).size`` ranks (13 for fan-out 3 and 2 levels).
    """

    fanout: int | Sequence[int] = 3
    levels: int = 2
    stragglers: int | Sequence[int] = 1
    code: GradientCode | Sequence[GradientCode] | None = None
    deadline: float = 30.0
    on_insufficient: OnInsufficient = "raise"
    # Pipelining chunks, and a message's chunks at most (None: by whether the job spans
    # hosts, see StepOptions.chunking).
    chunk_bytes: int | None = None
    max_chunks: int | None = None
    history_bytes: int = 256 << 20  # results a parent keeps for ranks that fell behind
    # Chunks over lanes to and from the parent and children (off the event loop; the comm
    # must offer bulk links, else the event loop's frames): see ReduceSession. None: for a
    # first vector of at least 1 MiB.
    lanes: bool | None = None
    coded: bool = field(default=True, init=False)

    @cached_property
    def topology(self) -> TreeTopology:
        return TreeTopology(self.fanout, self.levels)

    @cached_property
    def options(self) -> StepOptions:
        return StepOptions(self.deadline, self.on_insufficient, self.chunk_bytes,
                           self.history_bytes, lanes=self.lanes, max_chunks=self.max_chunks)

    def validate(self, world_size: int) -> None:
        if world_size != self.topology.size:
            raise ValueError(f"{self.topology} needs exactly {self.topology.size} ranks, the "
                             f"job has {world_size}")

    def plan(self, num_samples: int) -> CodedTreePlan:
        """The placement of a data set of ``num_samples`` over this tree (kept: planning
        takes tens of milliseconds at 13 ranks, and samplers and benchmarks ask per step)."""
        plans = self._plans
        plan = plans.pop(num_samples, None)
        if plan is None:
            plan = coded_tree_plan(num_samples, self.fanout, self.levels, self.stragglers,
                                   self.code)
        plans[num_samples] = plan  # most recent last
        while len(plans) > _PLANS_KEPT:
            del plans[next(iter(plans))]
        return plan

    @cached_property
    def _plans(self) -> dict[int, CodedTreePlan]:
        return {}

    @cached_property
    def min_samples(self) -> int:
        """The smallest data-set size this tree's placement fits (multiples fit too)."""
        return coded_tree_unit(self.fanout, self.levels, self.stragglers, self.code)

    def placement(self, rank: int, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
        return self.plan(num_samples).placement(rank)

    def neighbours(self, rank: int, world_size: int) -> list[int]:
        """Ranks this rank talks to: parent, children, and grandchildren (adoption)."""
        return _neighbours(self.family(rank))

    def family(self, rank: int) -> Family:
        return _tree_family(rank, self.topology.parent, self.topology.children,
                            self._codes[self.topology.level(rank)]
                            if self.topology.children(rank) else None)

    @cached_property
    def _codes(self) -> tuple[GradientCode, ...]:
        # The codes do not depend on the data-set size; plan the smallest one that fits.
        return self.plan(self.min_samples).codes

    def open(self, comm: Comm) -> ReduceSession:
        return ReduceSession(comm, self.family(comm.rank), self.options)


def _tree_family(rank: int, parent_of: Callable[[int], int | None],
                 children_of: Callable[[int], list[int]], code: GradientCode | None) -> Family:
    parent = parent_of(rank)
    kids = children_of(rank)
    depth, above = 0, parent
    while above is not None:
        depth, above = depth + 1, parent_of(above)
    return Family(parent, kids, code,
                  grandparent=parent_of(parent) if parent is not None else None,
                  grandchildren={c: children_of(c) for c in kids}, depth=depth)


def _neighbours(fam: Family) -> list[int]:
    up = [] if fam.parent is None else [fam.parent]
    return up + fam.children


@dataclass(frozen=True)
class Tree:
    """Uncoded tree allreduce over any number of ranks: reduce to rank 0, broadcast back,
    pipelined in chunks so the levels overlap."""

    fanout: int = 2
    # Pipelining chunks, and a message's chunks at most (None: by whether the job spans
    # hosts, see StepOptions.chunking).
    chunk_bytes: int | None = None
    max_chunks: int | None = None
    deadline: float = 300.0
    history_bytes: int = 256 << 20
    # Chunks over lanes to and from the parent and children (off the event loop; the comm
    # must offer bulk links, else the event loop's frames): see ReduceSession. None: for a
    # first vector of at least 1 MiB.
    lanes: bool | None = None
    coded: bool = field(default=False, init=False)

    def validate(self, world_size: int) -> None:
        if self.fanout < 1:
            raise ValueError("fanout must be at least 1")

    def neighbours(self, rank: int, world_size: int) -> list[int]:
        return _neighbours(self.family(rank, world_size))

    def family(self, rank: int, world_size: int) -> Family:
        return _tree_family(rank, lambda r: heap_parent(r, self.fanout),
                            lambda r: heap_children(r, self.fanout, world_size), None)

    def open(self, comm: Comm) -> ReduceSession:
        opts = StepOptions(self.deadline, "raise", self.chunk_bytes, self.history_bytes,
                           lanes=self.lanes, max_chunks=self.max_chunks)
        return ReduceSession(comm, self.family(comm.rank, comm.world_size), opts)
