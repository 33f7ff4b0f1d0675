"""A kept session's comm: while another scheme runs, it hears only about its own steps.

``Node.use(scheme, keep=True)`` keeps the old session alive (a benchmark alternating schemes
keeps each one's learned state). Its early handlers stay installed on the same mesh, and every
scheme numbers its frames by the node's step and sends them from the same ranks (rank 0 is the
root of the tree, the star's master and a ring member), so without a gate a kept session takes
the running scheme's frames for its own: a coded tree's parent forwarding gradient coding's
results to its tree children, say, work and traffic in the middle of another scheme's step.

The gate lets a dormant session hear frames of the steps it ran (a late child's request for a
result it holds is still answered), not of later ones, which belong to whatever scheme ran
them. Receives it posts are unaffected: a dormant session posts none.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from ..wire import Header
from .base import Comm, EarlyHandler


class GatedComm:
    """A :class:`~.base.Comm` whose early handlers can be told to ignore later steps."""

    def __init__(self, inner: Comm) -> None:
        self.inner = inner
        # Steps from this one on are not this session's (None: it is the running session).
        self.dormant_from: int | None = None

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    async def send(self, rank: int, array: np.ndarray, *, step: int, tag: int = 0,
                   meta: dict[str, Any] | None = None) -> None:
        await self.inner.send(rank, array, step=step, tag=tag, meta=meta)

    def post_recv(self, rank: int, out: np.ndarray, *, step: int,
                  tag: int = 0) -> asyncio.Future[Header]:
        return self.inner.post_recv(rank, out, step=step, tag=tag)

    def discard_before(self, step: int, tag: int = 0) -> None:
        self.inner.discard_before(step, tag)

    def is_lost(self, rank: int) -> bool:
        return self.inner.is_lost(rank)

    def on_peer_lost(self, listener: Callable[[int], None]) -> Callable[[], None]:
        return self.inner.on_peer_lost(listener)

    def on_early(self, rank: int, min_tag: int, handler: EarlyHandler) -> Callable[[], None]:
        def gated(header: Header, payload: memoryview) -> None:
            if self.dormant_from is None or header.step < self.dormant_from:
                handler(header, payload)

        return self.inner.on_early(rank, min_tag, gated)
