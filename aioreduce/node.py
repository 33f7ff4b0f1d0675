"""The public runtime: a :class:`Node` is one rank of a job.

Use it as an async context manager; entering it joins the job (listener, rendezvous through
rank 0), leaving it waits for the other ranks (bounded) and closes every connection::

    async with Node.from_env() as node:
        await node.send(1, array, step=0)
        await node.recv_into(1, out, step=0)

``send`` and ``recv_into`` are the Comm interface the collective schemes are written against.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import numpy as np

from .env import NodeEnv, discover
from .transport import Mesh, MeshOptions, barrier, rendezvous
from .wire import Header

log = logging.getLogger("aioreduce")


class Node:
    """One rank of an aioreduce job."""

    def __init__(self, env: NodeEnv, *, options: MeshOptions | None = None,
                 close_timeout: float = 10.0) -> None:
        self.env = env
        if options is None and env.max_frame is not None:
            options = MeshOptions(max_payload=env.max_frame)
        self.mesh = Mesh(env.rank, env.world_size, env.secret, env.job, options)
        self.close_timeout = close_timeout
        self._started = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *,
                 options: MeshOptions | None = None, **kwargs: Any) -> Node:
        """A node configured from ``AIOREDUCE_*``/torchrun/SLURM/Open MPI variables."""
        return cls(discover(environ), options=options, **kwargs)

    @property
    def rank(self) -> int:
        """This process's rank, 0..world_size-1."""
        return self.env.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the job."""
        return self.env.world_size

    async def start(self) -> None:
        """Listen and rendezvous; afterwards every rank's address is known."""
        env = self.env
        if env.rank == 0:
            await self.mesh.listen(env.bind_addr or _bind_for(env.master_addr), env.master_port)
        await rendezvous(self.mesh, (env.master_addr, env.master_port),
                         advertise=env.advertise_addr, bind=env.bind_addr,
                         timeout=env.rendezvous_timeout)
        self._started = True
        log.debug("rank %d joined job %s (%d ranks)", env.rank, env.job, env.world_size)

    async def close(self, *, wait_for_peers: bool = True) -> None:
        """Leave the job: a bounded barrier so peers get their last frames, then disconnect."""
        if self._started and wait_for_peers:
            try:
                await barrier(self.mesh, self.close_timeout)
            except Exception as exc:  # a dead peer must not block shutdown
                log.warning("rank %d: closing without a clean barrier: %s", self.rank, exc)
        self._started = False
        await self.mesh.close()

    async def __aenter__(self) -> Node:
        try:
            await self.start()
        except BaseException:
            await self.mesh.close()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close(wait_for_peers=exc is None)

    # -- Comm interface -----------------------------------------------------------------------
    async def send(self, rank: int, array: np.ndarray, *, step: int = 0, tag: int = 0) -> None:
        """Send ``array`` to ``rank`` as frame (step, tag).

        Returns once every byte is in the kernel, so ``array`` may be changed afterwards.
        A non-contiguous array is sent from a contiguous copy; object arrays are refused.
        """
        await self.mesh.send(rank, array, step=step, tag=tag)

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
        Use it to post many receives at once and wait on them with your own deadline.
        """
        return self.mesh.post_recv(rank, out, step=step, tag=tag)

    def discard_before(self, step: int) -> None:
        """Frames of steps below ``step`` are stale: dropped on arrival, never delivered."""
        self.mesh.set_floor(step)

    async def barrier(self, timeout: float = 60.0) -> None:
        """Wait until every rank has called ``barrier``."""
        await barrier(self.mesh, timeout)


def _bind_for(master_addr: str) -> str:
    """Rank 0 listens on the rendezvous address if it is a loopback one, else on all interfaces."""
    loopback = master_addr.startswith("127.") or master_addr == "localhost"
    return master_addr if loopback else "0.0.0.0"
