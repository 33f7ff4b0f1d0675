"""Reductions that every owner computes directly from every rank's contribution.

``reduce_scatter``: rank ``r`` receives every rank's part ``r`` (one exchange) and reduces them
in rank order. ``allreduce``: a reduce-scatter of the vector cut into ``N`` parts, then every
owner sends its reduced part to every rank (a second exchange). Each rank sends
``V (N - 1) / N`` bytes per exchange, as the ring does per phase, but every value is reduced
once, by its owner: 16-bit floats are accumulated in float32 and rounded back once (Gloo
rounds every partial sum to 16 bits), and the bytes on the wire stay 16-bit. Also the exact
path for integers, min, max, product and the bitwise ops, which a bounded-time scheme must not
approximate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from ..schemes.base import Arrival
from ..tensors import narrow, widen


class Exchanging(Protocol):
    """What the reductions run over: a rank of a job with an exchange step
    (:meth:`aioreduce.Node.exchange`; in unit tests, an in-memory comm with a step count)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def exchange(self, sends: Mapping[int, np.ndarray],
                 recvs: Mapping[int, np.ndarray], *, bulk: bool = False,
                 each: Callable[[int], None] | None = None) -> Awaitable[None]: ...

Combine = Callable[..., Any]  # a numpy ufunc: (a, b, out=a)

_COMBINE: dict[Any, Combine] = {
    dist.ReduceOp.SUM: np.add, dist.ReduceOp.AVG: np.add, dist.ReduceOp.MIN: np.minimum,
    dist.ReduceOp.MAX: np.maximum, dist.ReduceOp.PRODUCT: np.multiply,
    dist.ReduceOp.BAND: np.bitwise_and, dist.ReduceOp.BOR: np.bitwise_or,
    dist.ReduceOp.BXOR: np.bitwise_xor}


def supported(op: Any) -> bool:
    """Can :func:`reduce_parts` apply ``op`` (a ``RedOpType``)."""
    return op in _COMBINE


def bounds(length: int, parts: int) -> list[int]:
    """Where ``parts`` nearly equal consecutive parts of ``length`` elements start (and the
    end): the first ``length % parts`` parts have one more."""
    q, r = divmod(length, parts)
    return [i * q + min(i, r) for i in range(parts + 1)]


def reduce_parts(parts: Sequence[np.ndarray], dtype: torch.dtype, op: Any, world: int,
                 out: np.ndarray) -> None:
    """Reduce ``parts`` (wire dtype, rank order) with ``op`` into ``out`` (wire dtype): in
    float32 for 16-bit floats, rounded once; ``AVG`` divides by ``world``."""
    fold = Fold(dtype, op, world)
    for part in parts:
        fold.add(part)
    fold.into(out)


class Fold:
    """A reduction fed one part at a time, in rank order, as the parts arrive (the same
    operations in the same order as a reduction of all of them at once): 16-bit floats are
    summed in float32 by torch, each part widened into one reused buffer as it is added
    (half the time of torch's mixed-dtype add, a third of numpy's widening); everything
    else by numpy's ufunc of ``op``."""

    def __init__(self, dtype: torch.dtype, op: Any, world: int) -> None:
        self.dtype, self.op, self.world = dtype, op, world
        self.sum16 = (dtype in (torch.bfloat16, torch.float16)
                      and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG))
        self._acc: Any = None  # float32 tensor (sum16) or numpy array
        self._wide: torch.Tensor | None = None

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.view(np.int16)).view(self.dtype)

    def add(self, part: np.ndarray) -> None:
        """Fold in the next rank's ``part`` (wire dtype)."""
        if self.sum16:
            t = self._tensor(part)
            if self._acc is None:
                self._acc = t.to(torch.float32)
            else:
                if self._wide is None:
                    self._wide = torch.empty(t.shape, dtype=torch.float32)
                self._wide.copy_(t)
                self._acc.add_(self._wide)
        elif self._acc is None:
            self._acc = np.array(widen(part, self.dtype), copy=True)
        else:
            _COMBINE[self.op](self._acc, widen(part, self.dtype), out=self._acc)

    def into(self, out: np.ndarray) -> None:
        """Write the reduction into ``out`` (wire dtype): ``AVG`` divided by the world size,
        16-bit floats rounded to nearest even once, as torch casts."""
        acc = self._acc
        if self.sum16:
            if self.op == dist.ReduceOp.AVG:
                acc.div_(self.world)
            self._tensor(out).copy_(acc)
            return
        if self.op == dist.ReduceOp.AVG:
            if acc.dtype.kind == "f":
                acc /= self.world
            else:
                acc //= self.world
        narrow(acc, self.dtype, out)


async def reduce_scatter(node: Exchanging, parts: Sequence[np.ndarray], out: np.ndarray,
                         dtype: torch.dtype, op: Any) -> None:
    """``out`` = the reduction of every rank's ``parts[me]`` (``parts[r]`` goes to rank
    ``r``; all wire dtype), each folded in, in rank order, as soon as it is in. ``out`` may
    be ``parts[me]`` itself."""
    me, world = node.rank, node.world_size
    got = {r: np.empty_like(out) for r in range(world) if r != me}
    fold = Fold(dtype, op, world)
    own = [parts[me]]  # folded when its turn in rank order comes

    def each(r: int) -> None:
        if own and me < r:
            fold.add(own.pop())
        fold.add(got[r])

    await node.exchange({r: parts[r] for r in range(world) if r != me}, got, bulk=True,
                        each=each)
    if own:
        fold.add(own.pop())
    fold.into(out)


async def allreduce(node: Exchanging, flat: np.ndarray, dtype: torch.dtype, op: Any,
                    arrival: Arrival | None = None) -> None:
    """``flat`` (wire dtype, every rank the same length) becomes the reduction of every
    rank's ``flat``, identical on every rank. ``arrival``: ``flat`` is a device tensor's
    staging buffer, and each owner's part is copied back (:meth:`Arrival.final`) as soon as
    it is here, while the others are still on the wire."""
    me, world = node.rank, node.world_size
    edge = bounds(flat.size, world)
    parts = [flat[edge[r]:edge[r + 1]] for r in range(world)]
    mine = parts[me]
    await reduce_scatter(node, parts, mine, dtype, op)  # read (folded) before it is written
    others = [r for r in range(world) if r != me]
    each: Callable[[int], None] | None = None
    if arrival is not None:
        back = arrival

        def each(r: int) -> None:
            back.final(edge[r], edge[r + 1])

        each(me)
    await node.exchange({r: mine for r in others}, {r: parts[r] for r in others}, bulk=True,
                        each=each)
