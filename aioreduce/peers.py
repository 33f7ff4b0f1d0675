"""A rank's messages outside its scheme: point-to-point frames of the trainer's own, a
barrier, and the collective steps that are not a sum (allgather, broadcast, exchange), all
over the node's mesh. :class:`~aioreduce.node.Node` is one of these and runs a scheme too."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .schemes import Result
from .schemes.broadcast import broadcast
from .schemes.exchange import exchange
from .schemes.gather import allgather
from .schemes.links import LaneLinks
from .stepper import Stepper
from .transport import Mesh, barrier
from .wire import Header


class Peers:
    """Messages and collective steps over ``mesh``; collective steps take their numbers
    from ``steps``, the same sequence the scheme's steps take theirs from."""

    def __init__(self, mesh: Mesh, steps: Stepper) -> None:
        self.mesh = mesh
        self._steps = steps
        self._lanes: LaneLinks | None = None  # to and from every peer, for bulk exchanges

    @property
    def rank(self) -> int:
        """This process's rank, 0..world_size-1."""
        return self.mesh.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the job."""
        return self.mesh.world_size

    # -- point-to-point messages -------------------------------------------------------------
    async def send(self, rank: int, array: np.ndarray, *, step: int = 0, tag: int = 0,
                   meta: dict[str, Any] | None = None) -> None:
        """Send ``array`` to ``rank`` as frame (step, tag), with optional small ``meta``.

        Returns once every byte is in the kernel, so ``array`` may be changed afterwards.
        A non-contiguous array is sent from a contiguous copy; object arrays are refused.
        The receiver finds ``meta`` in the returned header. Once the receiver has run a step,
        a frame more than ``PeerBudget.steps_ahead`` (65536) steps ahead of it is refused.
        """
        await self.mesh.send(rank, array, step=step, tag=tag, meta=meta)

    async def recv_into(self, rank: int, out: np.ndarray, *, step: int = 0, tag: int = 0,
                        timeout: float | None = None) -> Header:
        """Receive frame (step, tag) from ``rank`` directly into ``out`` (no copy).

        ``out`` must be writable and C-contiguous with the sender's dtype and byte size.
        Raises :class:`~aioreduce.errors.RecvTimeout` after ``timeout`` seconds and
        :class:`~aioreduce.errors.PeerLost` (naming the rank) if the peer's connection breaks.
        """
        return await self.mesh.recv_into(rank, out, step=step, tag=tag, timeout=timeout)

    def post_recv(self, rank: int, out: np.ndarray, *, step: int = 0,
                  tag: int = 0) -> asyncio.Future[Header]:
        """Post a receive without waiting: a future that resolves when ``out`` is filled.

        Cancel the future to withdraw the receive (``out`` is then never written again).
        """
        return self.mesh.post_recv(rank, out, step=step, tag=tag)

    def discard_before(self, step: int) -> None:
        """Frames of steps below ``step`` are stale: dropped on arrival, never delivered
        (unless a receive for them is still posted)."""
        self.mesh.discard_before(step)

    async def barrier(self, timeout: float = 60.0) -> None:
        """Wait until every rank has called ``barrier``."""
        await barrier(self.mesh, timeout)

    # -- collective steps --------------------------------------------------------------------
    async def allgather(self, array: np.ndarray) -> Result:
        """Every rank's ``array``, stacked (row ``r`` is rank ``r``'s), exactly, on every rank.
        A collective step; point to point (each rank sends ``N - 1`` copies), for small
        arrays: shapes, flags, or reductions other than a sum."""
        return await allgather(self.mesh, self._steps.take(), array)

    async def broadcast(self, array: np.ndarray, root: int = 0) -> Result:
        """Every rank gets ``root``'s ``array`` exactly (others pass an array of the same
        shape and dtype, which is not modified). A collective step: every rank calls it at the
        same step, e.g. to re-sync a model after :class:`~aioreduce.FellBehind`."""
        if not 0 <= root < self.world_size:
            raise ValueError(f"rank {self.rank}: broadcast root {root} is not a rank "
                             f"(world size {self.world_size})")
        return await broadcast(self.mesh, self._steps.take(), array, root)

    async def exchange(self, sends: Mapping[int, np.ndarray],
                       recvs: Mapping[int, np.ndarray], *, bulk: bool = False,
                       each: Callable[[int], None] | None = None) -> None:
        """A collective step that sends ``sends[r]`` to rank ``r`` and receives from rank
        ``r`` straight into ``recvs[r]``, exactly (all-to-all, gather, scatter). Every rank
        calls it at the same step, each with the sizes it receives.

        ``bulk=True`` (every rank alike): over lanes to and from every peer, opened at the
        first such step and kept, off the event loop (large arrays: the owners' sums of
        16-bit floats).

        ``each(r)``: called for every rank of ``recvs`` in rank order once its part is in
        (see :func:`~aioreduce.schemes.exchange.exchange`)."""
        step = self._steps.take()
        await exchange(self.mesh, step, sends, recvs,
                       await self._bulk_lanes(step) if bulk else None, each)

    async def _bulk_lanes(self, step: int) -> LaneLinks:
        if self._lanes is None:
            peers = [p for p in range(self.world_size) if p != self.rank]
            outs, ins = await self.mesh.open_links(peers, peers, step)
            # Exact steps never skip a peer: a rank is at most a step ahead of another here.
            self._lanes = LaneLinks(self.mesh, outs, ins, backlog_steps=1 << 30,
                                    opened_by=self.mesh, hear_comm=False)
        return self._lanes

    async def close_lanes(self, timeout: float) -> None:
        """Close the bulk exchanges' lanes (if opened), letting queued sends finish for up to
        ``timeout`` seconds."""
        lanes, self._lanes = self._lanes, None
        if lanes is not None:
            await lanes.close(timeout)
