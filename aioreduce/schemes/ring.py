"""Ring-AllReduce: reduce-scatter then all-gather, both directions of every link busy.

The vector is split in two halves that travel the ring in opposite directions at the same
time, so each rank sends to both neighbours and receives from both. Each half is cut into N
segments; in N-1 reduce-scatter steps every rank ends with one fully reduced segment, and in
N-1 all-gather steps every segment reaches every rank. Every rank sends 2(N-1)/N of the vector:
the bandwidth optimum. All-gather receives land directly in the result; reduce-scatter receives
go to one scratch segment per direction, added in place. A segment is only modified after the
send that reads it has drained (``send`` returns then), which zero-copy sends require.

The ring waits for every rank: it is the baseline that stragglers hurt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field

import numpy as np

from ..topology import ring_neighbours
from .base import Comm, Result


def _segments(length: int, n: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, length, n + 1).astype(int)
    return [(int(edges[i]), int(edges[i + 1])) for i in range(n)]


async def _ring(comm: Comm, acc: np.ndarray, send_to: int, recv_from: int, pos: int,
                step: int, tag: int) -> None:
    """One directional ring over ``acc`` (a view), in which this rank is at position ``pos``."""
    n = comm.world_size
    seg = _segments(acc.size, n)
    scratch = np.empty(max(hi - lo for lo, hi in seg), acc.dtype)
    for i in range(n - 1):  # reduce-scatter
        s_lo, s_hi = seg[(pos - i) % n]
        r_lo, r_hi = seg[(pos - i - 1) % n]
        tmp = scratch[: r_hi - r_lo]
        fut = comm.post_recv(recv_from, tmp, step=step, tag=tag + i)
        await asyncio.gather(comm.send(send_to, acc[s_lo:s_hi], step=step, tag=tag + i), fut)
        acc[r_lo:r_hi] += tmp
    for i in range(n - 1):  # all-gather
        s_lo, s_hi = seg[(pos + 1 - i) % n]
        r_lo, r_hi = seg[(pos - i) % n]
        fut = comm.post_recv(recv_from, acc[r_lo:r_hi], step=step, tag=tag + n + i)
        await asyncio.gather(comm.send(send_to, acc[s_lo:s_hi], step=step, tag=tag + n + i),
                             fut)


@dataclass(frozen=True)
class Ring:
    """Bidirectional Ring-AllReduce (the bandwidth-optimal, straggler-sensitive baseline)."""

    bidirectional: bool = True
    coded: bool = field(default=False, init=False)

    def validate(self, world_size: int) -> None:
        pass

    def neighbours(self, rank: int, world_size: int) -> list[int]:
        return sorted(set(ring_neighbours(rank, world_size)) - {rank})

    def open(self, comm: Comm) -> RingSession:
        return RingSession(comm, self.bidirectional)


class RingSession:
    """A ring keeps nothing across steps."""

    def __init__(self, comm: Comm, bidirectional: bool) -> None:
        self.comm, self.bidirectional = comm, bidirectional

    async def close(self, timeout: float) -> None:
        pass

    def known(self, step: int) -> bool:
        return False  # a ring's result needs everyone's vector

    async def step(self, step: int, like: np.ndarray, own: Awaitable[np.ndarray]) -> Result:
        comm = self.comm
        t0 = time.perf_counter()
        comm.discard_before(step)
        mine = (await own).reshape(-1)
        acc = mine.copy()
        n, rank = comm.world_size, comm.rank
        if n > 1:
            prev, nxt = ring_neighbours(rank, n)
            if self.bidirectional and acc.size >= 2 * n:
                half = acc.size // 2
                # Position on the reversed ring (0 -> N-1 -> ... -> 1 -> 0) is -rank mod n.
                await asyncio.gather(_ring(comm, acc[:half], nxt, prev, rank, step, 0),
                                     _ring(comm, acc[half:], prev, nxt, (-rank) % n, step,
                                           1 << 20))
            else:
                await _ring(comm, acc, nxt, prev, rank, step, 0)
        comm.discard_before(step + 1)
        value = acc.reshape(like.shape)
        value.setflags(write=False)
        return Result(value, step, list(range(n)), [], True, 0.0, time.perf_counter() - t0)
