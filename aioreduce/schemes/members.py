"""A comm over some of the ranks: a scheme that re-forms without a dead rank runs on it.

A session written for ranks ``0 .. N-1`` (the transpose: shard ``k`` is rank ``k``'s) runs
unchanged over ``members`` when its comm numbers them ``0 .. len(members) - 1``:
:class:`MembersComm` maps those positions to the ranks underneath, both ways. A scheme's
errors and results name positions; :func:`real_result` and :func:`real_error` give them
back in ranks (the healer and the caller think in ranks).

Its bulk links are the comm's underneath, their ends numbered by position too: a re-formed
session opens lanes with the members at the step it changes (every member changes there).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..wire import Header
from .base import BulkLink, BulkLinks, Comm, CommWrapper, EarlyHandler, Result, StragglerError


class MembersComm(CommWrapper):
    """``inner`` seen as the ranks ``members`` only, numbered by their position."""

    def __init__(self, inner: Comm, members: Sequence[int]) -> None:
        super().__init__(inner)
        self.members = tuple(sorted(set(members)))
        self._position = {r: i for i, r in enumerate(self.members)}
        if inner.rank not in self._position:
            raise ValueError(f"rank {inner.rank}: a comm over ranks {list(self.members)} "
                             "without this rank")

    @property
    def rank(self) -> int:
        return self._position[self.inner.rank]

    @property
    def world_size(self) -> int:
        return len(self.members)

    async def send(self, rank: int, array: np.ndarray, *, step: int, tag: int = 0,
                   meta: dict[str, Any] | None = None) -> None:
        await self.inner.send(self.members[rank], array, step=step, tag=tag, meta=meta)

    def post_recv(self, rank: int, out: np.ndarray, *, step: int, tag: int = 0
                  ) -> asyncio.Future[Header]:
        return self.inner.post_recv(self.members[rank], out, step=step, tag=tag)

    def is_lost(self, rank: int) -> bool:
        return self.inner.is_lost(self.members[rank])

    def on_peer_lost(self, listener: Callable[[int], None]) -> Callable[[], None]:
        def heard(rank: int) -> None:
            if rank in self._position:
                listener(self._position[rank])

        return self.inner.on_peer_lost(heard)

    def on_early(self, rank: int, min_tag: int, handler: EarlyHandler, *,
                 since: int | None = None) -> Callable[[], None]:
        return self.inner.on_early(self.members[rank], min_tag, handler, since=since)

    def bulk_links(self) -> BulkLinks | None:
        inner = self.inner.bulk_links()
        return None if inner is None else MembersLinks(inner, self.members)

    def real(self, positions: Sequence[int]) -> list[int]:
        """The ranks at ``positions``."""
        return [self.members[p] for p in positions]


class MembersLinks:
    """``inner`` bulk links with their peers numbered by position among ``members``."""

    def __init__(self, inner: BulkLinks, members: tuple[int, ...]) -> None:
        self.inner, self.members = inner, members
        self._position = {r: i for i, r in enumerate(members)}

    async def open_links(self, send_to: Sequence[int], recv_from: Sequence[int], step: int,
                         *, partial: bool = False
                         ) -> tuple[Mapping[int, BulkLink], Mapping[int, BulkLink]]:
        outs, ins = await self.inner.open_links([self.members[p] for p in send_to],
                                                [self.members[p] for p in recv_from], step,
                                                partial=partial)
        return ({self._position[r]: lane for r, lane in outs.items()},
                {self._position[r]: lane for r, lane in ins.items()})

    @property
    def spans_hosts(self) -> bool:
        return self.inner.spans_hosts

    def count_moved(self, step: int, sent: int, src: int, received: int, frames: int) -> None:
        self.inner.count_moved(step, sent, self.members[src], received, frames)


def real_result(comm: MembersComm, res: Result) -> Result:
    """``res`` with its ranks named as ranks, not positions."""
    return dataclasses.replace(res, used=comm.real(res.used), late=comm.real(res.late),
                               stand_in=comm.real(res.stand_in),
                               drifted=comm.real(res.drifted))


def real_error(comm: MembersComm, exc: BaseException) -> BaseException:
    """``exc`` with the ranks it names as ranks (a straggler error's missing ranks)."""
    if isinstance(exc, StragglerError):
        return StragglerError(exc.step, comm.real(exc.missing), exc.detail, exc.received,
                              lost=comm.real(exc.lost))
    return exc
