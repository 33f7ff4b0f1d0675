"""Lanes for the peers that have them, the comm for those whose connection broke.

A peer whose process dies takes its lanes with it. From the moment its connection breaks,
:class:`SplitLinks` routes everything to and from it through the comm
(:class:`~.comm.CommLinks`), and the rest over the lanes as before: its replacement (see
:mod:`aioreduce.heal`) is taken back at the first step it sends in, over the event loop, until
the two open lanes again (:mod:`.reopen`) and the scheme moves the peer back off ``on_comm``
at the step agreed on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import numpy as np

from ...wire import Header
from ..base import Comm
from .comm import CommLinks, Links
from .lanes import LaneLinks


class SplitLinks:
    """:class:`~.comm.Links` over ``lanes``, but through ``via_comm`` for every peer whose
    connection on ``comm`` broke (see the module docstring)."""

    def __init__(self, lanes: LaneLinks, via_comm: CommLinks, comm: Comm) -> None:
        self.lanes, self.via_comm = lanes, via_comm
        self.on_comm: set[int] = set()  # peers that lost their lanes for good
        self._remove = comm.on_peer_lost(self.on_comm.add)

    def _for(self, rank: int) -> Links:
        return self.via_comm if rank in self.on_comm else self.lanes

    @property
    def newest(self) -> int:
        return max(self.lanes.newest, self.via_comm.newest)

    @property
    def cut_at(self) -> int:
        return self.lanes.cut_at

    def post(self, src: int, out: np.ndarray, step: int, tag: int, *,
             whole: bool = False) -> asyncio.Future[Header]:
        return self._for(src).post(src, out, step, tag, whole=whole)

    def landed(self, src: int, step: int, tag: int) -> int:
        # The lanes' book: a receive posted there before the peer moved to the comm.
        return self.lanes.landed(src, step, tag)

    def send(self, peer: int, array: np.ndarray, step: int, tag: int,
             meta: dict[str, Any], *, lent: bool = False) -> bool:
        return self._for(peer).send(peer, array, step, tag, meta, lent=lent)

    def lends(self, peer: int) -> bool:
        return self._for(peer).lends(peer)

    def release(self, peers: Iterable[int]) -> None:
        self.lanes.release(peers)  # (only lanes lend: a peer moved to the comm since too)

    def discard_before(self, step: int, tag: int = 0) -> None:
        # The lanes raise the comm's floor too, which is all the comm's links have to do.
        self.lanes.discard_before(step, tag)

    def is_lost(self, rank: int) -> bool:
        return self._for(rank).is_lost(rank)

    def heard_at(self, src: int) -> float:
        return self._for(src).heard_at(src)

    def tell(self, peer: int, step: int) -> None:
        self._for(peer).tell(peer, step)

    def end_step(self, step: int) -> None:
        self.lanes.end_step(step)
        self.via_comm.end_step(step)

    async def close(self, timeout: float) -> None:
        self._remove()
        await asyncio.gather(self.lanes.close(timeout), self.via_comm.close(timeout))
