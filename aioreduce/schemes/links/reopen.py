"""Lanes opened again between a replacement process and its tree, star or transpose
peers (the ones it would have lanes with).

Why. A tree's chunks (a transpose's slices) travel on lanes opened at the session's first
step. A process that dies takes its lanes with it; without this, its replacement and its
peers would talk over the event loop's connections for the rest of the job, at more CPU per
byte than a lane (docs/schemes.md), and a long job on spot machines would slow down with
every death it healed.

How. Both ends of a path must switch at the same step, since a receive is posted on the path
its sender uses: a chunk sent on a lane for a receive posted on the comm never lands. So the
replacement proposes a step (``LaneReopen(start)``, on :data:`~aioreduce.wire.tags.REOPEN`) to
each peer it would have lanes with, and touches no later step with that peer until it has the
answer; the peer answers with the step from which the chunks go on lanes: the one asked or,
if it has touched that one already (sent or posted for it), the first it has not (or -1 if its
session has no lanes: small vectors). Both then open the lanes at once, in the background
(``BulkLinks.open_links``, keyed by that step), and until they are open each side holds back
its sends to the other of that step or later (in order) and starts no such step. (An answer
travels at the step it answers, so an answer to an earlier ask is told apart.) Once they
are open, or failed (then both sides stay on the comm: an opening fails on both ends), the
held sends go out, on whichever path the session now routes them.

A peer that dies meanwhile ends the wait (its lanes do not open; the tree goes on without it,
as with any dead peer). Two neighbours replaced at once ask each other: the lower rank's
proposal stands (the higher answers it and gives its own up; the lower asks again when it hears
the higher's, in case its first went to the dead process), a repeated ask gets the same answer
and keeps the opening under way, and a replacement that does not
know yet whether its session uses lanes (that is decided at its first step, by the vector's
size) answers once it does (:meth:`Reopener.decided`). An asker that gives up waiting for the
answer (``ANSWER_TIMEOUT_S``) withdraws its ask (``LaneReopen(-1)`` at the step asked), so a
peer that answered late drops its opening instead of holding its steps until it times out.
A re-formed transpose opens all its lanes anew instead (every member changes at one step).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from ...errors import PeerLost
from ...wire import Header, tags
from ...wire.control import LaneReopen, MalformedControl, decode_reopen, reopen_meta
from ..base import BulkLink, Comm

log = logging.getLogger("aioreduce.schemes")

ANSWER_TIMEOUT_S = 10.0  # a live peer of the same session answers at once
_NOTHING = np.empty(0, np.uint8)


@dataclass
class _Pending:
    """A peer whose lanes are being opened again: nothing from step ``start`` on with it until
    ``done`` (asked: the step proposed; agreed: the step answered)."""

    start: int
    done: asyncio.Future[None]
    answer: asyncio.Future[int] | None = None  # the proposer's, until the peer answers
    asked: int = -1  # the answerer's: the step the peer asked for
    held: list[Callable[[], None]] = field(default_factory=list)  # sends, in order
    held_steps: set[int] = field(default_factory=set)
    task: asyncio.Task[None] | None = None


class Reopener:
    """One session's reopenings. ``touched()``: the latest step the session has posted or
    sent for; ``has_lanes()``: whether its chunks travel on lanes (it answers -1 if not), or
    None while it does not know yet (the answer then waits for :meth:`decided`);
    ``opened(peer, out, in, start)``: lanes with ``peer`` are open, for steps >= ``start``."""

    def __init__(self, comm: Comm, touched: Callable[[], int],
                 has_lanes: Callable[[], bool | None],
                 opened: Callable[[int, BulkLink, BulkLink, int], None], *,
                 held_steps: int | None = None) -> None:
        self.comm = comm
        # Sends held for at most this many steps per peer (None: no bound); later ones are
        # dropped, as an outbox skips a peer that does not read (the tree asks again).
        self._max_held = held_steps
        self._touched, self._has_lanes, self._opened = touched, has_lanes, opened
        # Peers whose lanes are opening again (read, never changed, by the session: when it is
        # empty, as nearly always, a step neither waits nor holds a send for it).
        self.opening: dict[int, _Pending] = {}
        self._deferred: dict[int, int] = {}  # peer -> the step it asked, answered at decided()
        self._closed = False

    def listen(self, peers: Iterable[int]) -> list[Callable[[], None]]:
        """Answer and hear from ``peers`` (the removers)."""
        removers = [self.comm.on_early(p, tags.REOPEN, self._heard) for p in peers]
        removers.append(self.comm.on_peer_lost(self._peer_lost))
        return removers

    # -- the session's side -------------------------------------------------------------------
    def propose(self, peer: int, start: int) -> None:
        """Ask ``peer`` to open lanes with us again, from step ``start`` at the earliest."""
        loop = asyncio.get_running_loop()
        pending = _Pending(start, loop.create_future(), answer=loop.create_future())
        self._drop(peer, run=True)
        self.opening[peer] = pending
        self._send(peer, start, LaneReopen(start))
        pending.task = asyncio.ensure_future(self._asked(peer, pending))

    def holds(self, peer: int, step: int) -> bool:
        """Whether a send of ``step`` to ``peer`` must wait (see :meth:`hold`)."""
        pending = self.opening.get(peer)
        return pending is not None and step >= pending.start

    def hold(self, peer: int, step: int, send: Callable[[], None]) -> bool:
        """Run ``send`` (of ``step``) once the lanes with ``peer`` are open or failed, in
        order; False (dropped) if that would hold more steps than the bound."""
        pending = self.opening[peer]
        if (step not in pending.held_steps and self._max_held is not None
                and len(pending.held_steps) >= self._max_held):
            log.warning("rank %d: rank %d's lanes are still opening; its step %d is not "
                        "sent", self.comm.rank, peer, step)
            return False
        pending.held_steps.add(step)
        pending.held.append(send)
        return True

    async def ready(self, step: int) -> None:
        """Return once no opening holds ``step`` back (call before posting for it)."""
        waits = [p.done for p in self.opening.values() if step >= p.start]
        if waits:
            await asyncio.wait(waits)

    def decided(self) -> None:
        """The session knows now whether it has lanes: answer the peers that asked before."""
        deferred, self._deferred = self._deferred, {}
        lanes = bool(self._has_lanes())
        for peer, asked in deferred.items():
            if not self.comm.is_lost(peer) and not self._closed:
                self._answer(peer, asked, lanes)

    def cancel(self) -> None:
        """Give up every opening under way (held sends dropped: the session that held them
        is being replaced, e.g. a re-formed transpose's, which opens lanes of its own)."""
        self._deferred.clear()
        for peer in list(self.opening):
            self._drop(peer, run=False)

    def close(self) -> None:
        self._closed = True
        self.cancel()

    # -- both sides -----------------------------------------------------------------------------
    def _heard(self, header: Header, _payload: memoryview) -> None:
        if header.tag != tags.REOPEN or self._closed:
            return
        peer = header.src
        try:
            event = decode_reopen(header.meta)
        except MalformedControl as exc:
            log.warning("rank %d: from rank %d: %s", self.comm.rank, peer, exc)
            return
        if event.start < 0 and not event.answer:
            # The asker gave up waiting for our answer to its ask of ``header.step`` (lost or
            # late): drop that opening now rather than hold our steps with it until the
            # opening times out.
            ours = self.opening.get(peer)
            if ours is not None and ours.answer is None and ours.asked == header.step:
                self._drop(peer, run=True)
            self._deferred.pop(peer, None)
            return
        if event.answer:
            # (An answer travels at the step it answers: one to an earlier ask is not ours.)
            pending = self.opening.get(peer)
            if (pending is not None and pending.answer is not None
                    and not pending.answer.done() and header.step == pending.start):
                pending.answer.set_result(event.start)
            return
        ours = self.opening.get(peer)
        if ours is not None and ours.answer is not None and not ours.answer.done():
            if self.comm.rank < peer:
                # Both ends replaced, asking each other: ours stands, the peer answers it.
                # Asked again, in case ours went to the peer's dead process and was lost.
                self._send(peer, ours.start, LaneReopen(ours.start))
                return
        elif ours is not None and ours.answer is None and ours.asked == event.start:
            # The same ask again (see above): the same answer, the opening under way kept.
            self._send(peer, ours.asked, LaneReopen(ours.start, answer=True))
            return
        lanes = self._has_lanes()
        if lanes is None:  # (one per peer: a repeated ask replaces the last)
            self._deferred[peer] = event.start
            return
        self._answer(peer, event.start, lanes)

    def _answer(self, peer: int, asked: int, lanes: bool) -> None:
        """Agree with ``peer`` on a step: the one asked or, if this session has touched it,
        the first it has not (-1: no lanes); and open the lanes from there."""
        start = max(asked, self._touched() + 1) if lanes else -1
        self._send(peer, asked, LaneReopen(start, answer=True))
        # One opening per peer, however often it asks: an earlier one (or our own proposal,
        # given up) is cancelled, and what it held goes through the new one, which holds it
        # again from its own start on.
        earlier = self.opening.pop(peer, None)
        if start >= 0:
            pending = _Pending(start, asyncio.get_running_loop().create_future(), asked=asked)
            self.opening[peer] = pending
            pending.task = asyncio.ensure_future(self._open(peer, pending))
        if earlier is not None:
            self._retire(earlier, run=True)

    def _peer_lost(self, peer: int) -> None:
        self._deferred.pop(peer, None)
        pending = self.opening.get(peer)
        if pending is not None and pending.answer is not None and not pending.answer.done():
            pending.answer.set_exception(PeerLost(peer, "lost before it answered"))

    async def _asked(self, peer: int, pending: _Pending) -> None:
        assert pending.answer is not None
        try:
            start = await asyncio.wait_for(pending.answer, ANSWER_TIMEOUT_S)
        except (PeerLost, TimeoutError) as exc:
            log.warning("rank %d: rank %d did not answer our lanes' reopening (%s): its "
                        "chunks stay on the comm", self.comm.rank, peer, exc)
            if isinstance(exc, TimeoutError):  # it may have answered late: withdraw the ask
                self._send(peer, pending.start, LaneReopen(-1))
            start = -1
        if start < 0:
            self._settle(peer)
            return
        pending.start = start
        await self._open(peer, pending)

    async def _open(self, peer: int, pending: _Pending) -> None:
        try:
            links = self.comm.bulk_links()
            if links is None:
                return
            outs, ins = await links.open_links([peer], [peer], pending.start, partial=True)
            if peer in outs and peer in ins and not self._closed:
                self._opened(peer, outs[peer], ins[peer], pending.start)
                log.info("rank %d: lanes with rank %d open again, from step %d",
                         self.comm.rank, peer, pending.start)
            else:
                for lane in (*outs.values(), *ins.values()):
                    lane.close()
                log.warning("rank %d: lanes with rank %d did not open again: its chunks "
                            "stay on the comm", self.comm.rank, peer)
        finally:
            if self.opening.get(peer) is pending:
                self._settle(peer)

    def _drop(self, peer: int, *, run: bool) -> None:
        """Give up the opening with ``peer`` under way, if any (its task cancelled)."""
        pending = self.opening.pop(peer, None)
        if pending is not None:
            self._retire(pending, run=run)

    def _settle(self, peer: int, *, run: bool = True) -> None:
        """The opening with ``peer`` is over: release what it held back."""
        pending = self.opening.pop(peer, None)
        if pending is not None:
            self._retire(pending, run=run, cancel=False)

    @staticmethod
    def _retire(pending: _Pending, *, run: bool, cancel: bool = True) -> None:
        """End an opening no longer in the book: its task cancelled (unless it is the one
        ending), its waiters released, its held sends run in order (``run``)."""
        if cancel and pending.task is not None:
            pending.task.cancel()
        if not pending.done.done():
            pending.done.set_result(None)
        if pending.answer is not None and not pending.answer.done():
            pending.answer.cancel()
        if run:
            for send in pending.held:
                send()

    def _send(self, peer: int, step: int, event: LaneReopen) -> None:
        sending = asyncio.ensure_future(self.comm.send(peer, _NOTHING, step=step,
                                                      tag=tags.REOPEN,
                                                      meta=reopen_meta(event)))
        sending.add_done_callback(lambda f: f.cancelled() or f.exception())  # lost: no matter


__all__ = ["Reopener"]
