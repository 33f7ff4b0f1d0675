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

from ..tensors import narrow, widen


class Exchanging(Protocol):
    """What the reductions run over: a rank of a job with an exchange step
    (:meth:`aioreduce.Node.exchange`; in unit tests, an in-memory comm with a step count)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def exchange(self, sends: Mapping[int, np.ndarray],
                 recvs: Mapping[int, np.ndarray], *, bulk: bool = False) -> Awaitable[None]: ...

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
    if dtype in (torch.bfloat16, torch.float16) and op in (dist.ReduceOp.SUM,
                                                          dist.ReduceOp.AVG):
        _sum16(parts, dtype, op == dist.ReduceOp.AVG, world, out)
        return
    combine = _COMBINE[op]
    acc = np.array(widen(parts[0], dtype), copy=True)
    for part in parts[1:]:
        combine(acc, widen(part, dtype), out=acc)
    if op == dist.ReduceOp.AVG:
        if acc.dtype.kind == "f":
            acc /= world
        else:
            acc //= world
    narrow(acc, dtype, out)


def _sum16(parts: Sequence[np.ndarray], dtype: torch.dtype, average: bool, world: int,
           out: np.ndarray) -> None:
    """:func:`reduce_parts`' sum of 16-bit floats by torch: each part widened as it is added
    (one pass each, on torch's threads; numpy widened into a new array first, three times
    the time), the same float32 additions in the same order."""
    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.view(np.int16)).view(dtype)

    acc = tensor(parts[0]).to(torch.float32)
    for part in parts[1:]:
        acc.add_(tensor(part))
    if average:
        acc.div_(world)
    tensor(out).copy_(acc)  # rounded to nearest even once, as torch casts


async def reduce_scatter(node: Exchanging, parts: Sequence[np.ndarray], out: np.ndarray,
                         dtype: torch.dtype, op: Any) -> None:
    """``out`` = the reduction of every rank's ``parts[me]`` (``parts[r]`` goes to rank
    ``r``; all wire dtype)."""
    me, world = node.rank, node.world_size
    got = {r: np.empty_like(out) for r in range(world) if r != me}
    await node.exchange({r: parts[r] for r in range(world) if r != me}, got, bulk=True)
    got[me] = parts[me]
    reduce_parts([got[r] for r in range(world)], dtype, op, world, out)


async def allreduce(node: Exchanging, flat: np.ndarray, dtype: torch.dtype, op: Any) -> None:
    """``flat`` (wire dtype, every rank the same length) becomes the reduction of every
    rank's ``flat``, identical on every rank."""
    me, world = node.rank, node.world_size
    edge = bounds(flat.size, world)
    parts = [flat[edge[r]:edge[r + 1]] for r in range(world)]
    mine = parts[me]
    reduced = np.empty_like(mine)
    await reduce_scatter(node, parts, reduced, dtype, op)
    mine[...] = reduced
    others = [r for r in range(world) if r != me]
    await node.exchange({r: mine for r in others}, {r: parts[r] for r in others}, bulk=True)
