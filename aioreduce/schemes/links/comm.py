"""The narrow interface a scheme's messages travel through, and its comm version.

A step posts receives, sends messages, raises a floor under which messages are dropped on
arrival (and never written anywhere), and asks which step its peers are at.
:class:`CommLinks` does that through the scheme's comm: frames on the event loop, and the
in-memory network of the unit tests. :class:`~.lanes.LaneLinks` does it over a blocking
lane to and from each peer, off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np

from ...wire import Header
from ..base import Comm
from ..outbox import Outbox


class Links(Protocol):
    """What a step needs from the network (see the module docstring)."""

    @property
    def newest(self) -> int:
        """The newest step any peer sent a slice of (-1: none yet)."""

    @property
    def cut_at(self) -> int:
        """The newest step a peer told us it went on without us (see :meth:`tell`; -1:
        none): that peer is past it."""

    def post(self, src: int, out: np.ndarray, step: int, tag: int, *,
             whole: bool = False) -> asyncio.Future[Header]:
        """Receive slice ``tag`` of ``step`` from ``src`` into ``out``; the future ends with
        its header (meta included) once every byte is in, or with ``PeerLost``. ``whole``:
        ``out`` is written in whole elements only, so that once the receive is withdrawn
        it holds :meth:`landed` bytes of the message and its own values after them."""

    def landed(self, src: int, step: int, tag: int) -> int:
        """Bytes of the message that landed in a ``whole`` receive of (``src``, ``step``,
        ``tag``) before it was withdrawn (asked after :meth:`discard_before`, until the
        next step's :meth:`end_step`)."""

    def send(self, peer: int, array: np.ndarray, step: int, tag: int,
             meta: dict[str, Any], *, lent: bool = False) -> bool:
        """Send in the background; ``array`` must stay unchanged until it is sent (a peer
        that is not reading is skipped once it has many steps unsent), or, ``lent`` (only
        where :meth:`lends`), until :meth:`release` returns or the peer no longer reads it
        (it answered with what it made of it, or dropped it: the transpose writes the
        answer over what it lent). False: ``peer`` is lost, nothing was sent."""

    def lends(self, peer: int) -> bool:
        """Whether a send to ``peer`` may be ``lent``: the sender's array then needs to stay
        unchanged only until :meth:`release`, not until it is sent."""

    def release(self, peers: Iterable[int]) -> None:
        """What was lent to ``peers`` and is not sent yet is copied: the arrays may change.
        Waits for a send in progress (while its peer reads, until it is in; a few
        milliseconds once the peer stops reading)."""

    def discard_before(self, step: int, tag: int = 0) -> None:
        """Drop slices below ``(step, tag)`` on arrival; a posted receive below it is
        withdrawn, and its buffer is not written again once this returns."""

    def is_lost(self, rank: int) -> bool:
        """Whether ``rank`` can no longer send to or receive from this rank."""

    def heard_at(self, src: int) -> float:
        """``time.perf_counter()`` when bytes last came from ``src`` (0: not known finer than
        whole slices, which the stage itself times)."""

    def tell(self, peer: int, step: int) -> None:
        """We cut ``peer`` at ``step`` (it had sent nothing): make sure it learns which step
        we are at, so that one far behind jumps ahead (``FellBehind``) instead of being cut
        step after step while it catches up. (Over the comm it reads every frame as it
        comes, and learns that from our slices.)"""

    def end_step(self, step: int) -> None:
        """The step is over (step telemetry counts what it moved, if it bypassed the comm)."""

    async def close(self, timeout: float) -> None:
        """Let queued sends finish for up to ``timeout`` seconds, then stop."""


class CommLinks:
    """:class:`Links` through the scheme's comm, the sends through an :class:`Outbox`."""

    def __init__(self, comm: Comm, backlog_steps: int) -> None:
        self.comm = comm
        self.outbox = Outbox(comm, backlog_steps)
        self.newest = -1
        self.cut_at = -1  # (nobody tells over the comm: see tell)
        self._removers: list[Callable[[], None]] = [
            comm.on_early(p, 0, self._heard) for p in range(comm.world_size) if p != comm.rank]

    def _heard(self, header: Header, _payload: memoryview) -> None:
        self.newest = max(self.newest, header.step)

    def post(self, src: int, out: np.ndarray, step: int, tag: int, *,
             whole: bool = False) -> asyncio.Future[Header]:
        if not whole:
            return self.comm.post_recv(src, out, step=step, tag=tag)
        # The comm writes a frame where it lands, as it comes: received apart and copied
        # once whole (rare: a peer that lost its lanes), so nothing lands before that.
        staged = np.empty_like(out)
        inner = self.comm.post_recv(src, staged, step=step, tag=tag)
        outer: asyncio.Future[Header] = asyncio.get_running_loop().create_future()

        def arrived(done: asyncio.Future[Header]) -> None:
            if outer.done():  # withdrawn: out is not ours to write any more
                return
            if done.cancelled():
                outer.cancel()
            elif (exc := done.exception()) is not None:
                outer.set_exception(exc)
            else:
                out[...] = staged
                outer.set_result(done.result())

        inner.add_done_callback(arrived)
        outer.add_done_callback(lambda f: inner.cancel() if f.cancelled() else None)
        return outer

    def landed(self, src: int, step: int, tag: int) -> int:
        return 0  # (see post: whole receives land at once)

    def send(self, peer: int, array: np.ndarray, step: int, tag: int,
             meta: dict[str, Any], *, lent: bool = False) -> bool:
        if lent:
            raise ValueError("the comm's links lend nothing (see lends)")
        if self.comm.is_lost(peer):
            return False
        self.outbox.send(peer, array, step=step, tag=tag, meta=meta)
        return True

    def lends(self, peer: int) -> bool:
        return False  # the outbox holds the array until its frame is written

    def release(self, peers: Iterable[int]) -> None:
        pass  # nothing lent

    def discard_before(self, step: int, tag: int = 0) -> None:
        self.comm.discard_before(step, tag)

    def is_lost(self, rank: int) -> bool:
        return self.comm.is_lost(rank)

    def heard_at(self, src: int) -> float:
        return 0.0  # frames complete whole: the stage times them

    def tell(self, peer: int, step: int) -> None:
        pass  # the peer's inbox sees our slices' steps as they arrive

    def end_step(self, step: int) -> None:
        pass  # the comm's frames are counted as they pass

    async def close(self, timeout: float) -> None:
        for remove in self._removers:
            remove()
        self._removers.clear()
        await self.outbox.close(timeout)
