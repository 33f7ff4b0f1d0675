"""Healing a replacement process: the job's step and the program's state from a live peer.

A process that replaces a dead rank joins the running job (rank 0 gives it a new incarnation,
see :mod:`aioreduce.wire.incarnation`) and then needs what the dead one had: the job's step and
whatever state the program keeps (model, optimizer). It asks a live peer (:class:`HealAsk`);
the peer answers at its next step boundary, where its state is that of every step before it:
it calls the program's :attr:`StateHooks.state` and sends the step and the blob, in pieces, in
the background (the peer's steps go on). The newcomer hands the blob to
:attr:`StateHooks.load_state` and starts at that step; the steps the job ran meanwhile come
from the scheme's result window like a paused rank's (see :mod:`aioreduce.schemes.reduce`).

A program without state hooks heals the step alone (its data is a function of the step).

The same request heals a rank that fell behind its peers' result window (``FellBehind``),
and a step that failed because ranks were lost (a ring's that lost one, a transpose's or a
tree's that missed too many) can wait for their replacements (``rejoin_wait`` seconds) and
run again, as the next step, with every rank: the caller sees one step that took longer, not
an error. A rank inside a step (its program waits for the step, so its state is that of every
step before) answers heal requests at once, with that step's number: a replacement may be
what the step waits for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import GroupMismatch, PeerLost
from .schemes import FellBehind, Result, Session, StragglerError
from .schemes.base import TellsFailure
from .wire import tags
from .wire.control import HealAsk

if TYPE_CHECKING:
    from .stepper import Stepper
    from .transport import Mesh

log = logging.getLogger("aioreduce")

PIECE = 64 << 20  # bytes of the state per frame
EMPTY = np.empty(0, np.uint8)


@dataclass(frozen=True)
class StateHooks:
    """What a program gives a node so a replacement of one of its ranks can heal.

    ``state()`` is called on a live rank at a step boundary or while the program waits for a
    step (on the node's event loop), and returns the program's state as bytes or a numpy
    array it will not change afterwards;
    ``load_state(blob)`` is called on the replacement with those bytes before its first step.
    """

    state: Callable[[], bytes | bytearray | memoryview | np.ndarray]
    load_state: Callable[[memoryview], None]


class Healer:
    """One node's side of healing: serving peers that ask, and asking (see the module
    docstring)."""

    def __init__(self, mesh: Mesh, hooks: StateHooks | None, timeout: float,
                 neighbours: Callable[[], list[int]], rejoin_wait: float = 0.0) -> None:
        if rejoin_wait < 0:
            raise ValueError(f"rank {mesh.rank}: rejoin_wait must be >= 0, not {rejoin_wait}")
        self.mesh, self.hooks, self.timeout = mesh, hooks, timeout
        self.rejoin_wait = rejoin_wait
        self._neighbours = neighbours  # the scheme's: the first peers to ask
        # Inside a step (the program waits for it, its state is that of the steps before):
        # the step's number, and asks are answered at once with it.
        self._serving_at: int | None = None
        self._asked: dict[int, HealAsk] = {}  # rank -> its request, served at the next boundary
        self._tickets = 0  # our requests so far: each one's replies travel on its own key
        self.served = 0  # heals answered (for tests and logs)
        self._sending = 0  # transfers of the current state still on their way
        # Steps run with rerun=False (a group the caller runs again as a whole): the ranks
        # whose death failed one (rank -> its incarnation then), and that failure, which
        # every later such step raises at once until replace_lost().
        self._group_lost: dict[int, int] = {}
        self._group_error: PeerLost | StragglerError | None = None
        # Where the group runs again after replace_lost(): a replacement heals to this step,
        # answered inside the group's steps until one of them succeeds (it took part).
        self._group_at: int | None = None
        # ... and which replacements (rank -> incarnation) that is for: a newer one (its
        # predecessor died while the group ran again) waits for the next replace_lost(),
        # where the group runs again from a later step.
        self._group_for: dict[int, int] = {}
        self._serve_only: dict[int, int] | None = None  # while answering inside a group
        mesh.on_heal = self._ask

    def _ask(self, rank: int, ask: HealAsk) -> None:
        if ask.incarnation == self.mesh.incarnations.known[rank]:  # not a replaced process's
            self._asked[rank] = ask
            if self._serving_at is not None:
                self.serve(self._serving_at)

    async def step(self, steps: Stepper, run: Callable[[], Awaitable[Result]],
                   into: np.ndarray | None, *, rerun: bool = True,
                   session: Session | None = None) -> Result:
        """Run one step (``run`` takes the next step number) as healing asks: first answer
        the peers that asked; after ``FellBehind``, heal this rank's state too (with state
        hooks); after a step that failed because a rank was lost, wait up to
        ``rejoin_wait`` for its replacement and run it again (``into``, summed in place,
        is restored first), as often as ranks were lost.

        ``rerun=False``: the step is one of a group that the caller runs again as a whole
        (see :meth:`replace_lost`); it answers no heal at its boundary (a replacement must
        start at a group's first step), and a failure because ranks died is recorded and
        raised, by this step and at once by every later one of the group; a ``session`` that
        can (:class:`~aioreduce.schemes.base.TellsFailure`) tells the peers that such a step
        failed here, so that a peer which finished the step that failed here (its last parts
        came before the death) and waits in the next one fails it too, and runs the group
        again from the same step as every rank."""
        if not rerun:
            return await self._group_step(steps, run, session)
        self._serving_at = steps.step
        self.serve(steps.step)
        try:
            if not self.rejoin_wait:
                return await self._healing(steps, run)
            known = list(self.mesh.incarnations.known)
            saved = into.copy() if into is not None else None
            for _attempt in range(len(known)):  # a host lost takes several ranks at once
                try:
                    return await self._healing(steps, run)
                except (PeerLost, StragglerError) as exc:
                    lost = self._dead(exc, known)
                    if not lost:
                        raise
                    self._serving_at = steps.step  # the number the step runs again as
                    for rank in lost:
                        # (A peer that took this process for its dead predecessor runs again
                        # at once: so do we.)
                        if rank != self.mesh.rank and not await self._replaced(rank,
                                                                               known[rank]):
                            raise
                log.warning("rank %d: ranks %s were replaced; the failed step runs again as "
                            "step %d", self.mesh.rank, lost, steps.step)
                if into is not None and saved is not None:
                    np.copyto(into, saved)
            return await self._healing(steps, run)
        finally:
            self._serving_at = None

    async def _group_step(self, steps: Stepper, run: Callable[[], Awaitable[Result]],
                          session: Session | None) -> Result:
        if self._group_error is not None:
            step = steps.take()  # every rank numbers the group's steps alike, run or not
            # (checked here, not per step: a protocol's isinstance costs microseconds)
            if isinstance(session, TellsFailure):  # a peer may be in it, waiting for us
                session.tell_failed(step, self._group_error)
            raise self._group_error
        known = list(self.mesh.incarnations.known)
        self._serving_at, self._serve_only = self._group_at, self._group_for
        if self._group_at is not None:
            self.serve(self._group_at)
        try:
            result = await self._healing(steps, run)
        except (PeerLost, StragglerError) as exc:
            lost = self._dead(exc, known) if self.rejoin_wait else []
            if lost:
                log.warning("rank %d: step %d failed (%s); its group runs again once ranks "
                            "%s are replaced", self.mesh.rank, steps.step - 1, exc, lost)
                self._group_error = exc
                for rank in lost:
                    self._group_lost.setdefault(rank, known[rank])
            self._group_at, self._group_for = None, {}  # runs again from another step
            raise
        finally:
            self._serving_at, self._serve_only = None, None
        self._group_at, self._group_for = None, {}
        return result

    async def replace_lost(self, steps: Stepper) -> bool:
        """After steps run with ``rerun=False`` failed because ranks died: wait up to
        ``rejoin_wait`` for each one's replacement, answering heal requests meanwhile with
        the next step number (where the caller runs its group again, and a replacement
        starts). True if every one came; False if no such step failed (or ``rejoin_wait`` is
        0, or one did not come, or a live rank did not answer): then the caller raises its
        error. First the live ranks check that they all run the group again from the same
        step: :class:`~aioreduce.errors.GroupMismatch` on every one if not (see there)."""
        lost, self._group_lost, self._group_error = self._group_lost, {}, None
        if not lost:
            return False
        if not await self._same_step(lost, steps.step):
            return False
        self._serving_at = self._group_at = steps.step
        self.serve(steps.step)
        try:
            for rank, incarnation in lost.items():
                if rank != self.mesh.rank and not await self._replaced(rank, incarnation):
                    self._group_at = None
                    return False
        finally:
            self._serving_at = None
        known = self.mesh.incarnations.known
        self._group_for = {rank: known[rank] for rank in lost}
        log.warning("rank %d: ranks %s were replaced; the group of steps runs again from "
                    "step %d", self.mesh.rank, sorted(lost), steps.step)
        return True

    async def _same_step(self, lost: dict[int, int], at: int) -> bool:
        """Check with every other live rank that it runs the group again from step ``at``
        too; raise :class:`GroupMismatch` on every one if not. False if a rank did not
        answer within ``rejoin_wait`` (it died too, or is not in a group)."""
        mesh = self.mesh
        world = mesh.world_size
        key = max(incarnation * world + rank for rank, incarnation in lost.items())
        peers = [r for r in range(world) if r != mesh.rank and r not in lost]
        heads = [asyncio.ensure_future(mesh.recv_into(r, EMPTY, step=key, tag=tags.GROUP,
                                                      timeout=self.rejoin_wait))
                 for r in peers]
        try:
            await asyncio.gather(*(mesh.send(r, EMPTY, step=key, tag=tags.GROUP,
                                             meta={"at": at}) for r in peers))
            got = await asyncio.gather(*heads)
        except (PeerLost, TimeoutError):
            for head in heads:
                head.cancel()
            return False
        theirs = {r: h.meta.get("at") for r, h in zip(peers, got, strict=True)}
        if all(s == at for s in theirs.values()):
            return True
        theirs[mesh.rank] = at
        raise GroupMismatch(mesh.rank, sorted(lost),
                            {r: s if type(s) is int else -1 for r, s in theirs.items()})

    def _dead(self, exc: PeerLost | StragglerError, known: list[int]) -> list[int]:
        """The ranks whose death failed the step (to wait for), or none: the rank a
        ``PeerLost`` names, or the missing ranks of a ``StragglerError`` if every one of them
        is dead (its connection broke, or it was replaced since the step began), or is
        this process (a replacement its peers did not know yet)."""
        if isinstance(exc, PeerLost):
            return [exc.rank] if 0 <= exc.rank < len(known) else []
        mesh = self.mesh
        dead = [r for r in exc.missing if 0 <= r < len(known) and (
            r == mesh.rank  # our peers took us for our dead predecessor
            or mesh.is_lost(r) or mesh.incarnations.known[r] > known[r])]
        return dead if dead and len(dead) == len(exc.missing) else []

    async def _healing(self, steps: Stepper, run: Callable[[], Awaitable[Result]]) -> Result:
        try:
            return await run()
        except FellBehind as exc:
            if self.hooks is not None:  # heal the program's state from a peer too
                steps.step, exc.healed = await self.heal(), True
            raise

    async def _replaced(self, rank: int, incarnation: int) -> bool:
        """Wait up to ``rejoin_wait`` for a newer incarnation of ``rank`` than
        ``incarnation``."""
        try:
            await asyncio.wait_for(self.mesh.replaced(rank, incarnation), self.rejoin_wait)
            # Connected, its old process's loss is over: a step run again now waits for the
            # replacement's frames instead of failing at once on that loss.
            await asyncio.wait_for(self.mesh.connect(rank), self.rejoin_wait)
            return True
        except (TimeoutError, PeerLost):
            return False

    def serve(self, step: int) -> None:
        """A step boundary (``step`` is about to run): answer every rank that asked. One
        state at a time: while one is on its way, later askers wait for it to be sent (so a
        healing peer holds one copy of its state however many ask)."""
        only = self._serve_only
        asked = {rank: ask for rank, ask in self._asked.items()
                 if only is None or only.get(rank) == ask.incarnation}
        if not asked or self._sending:
            return
        for rank in asked:
            del self._asked[rank]
        blob = self._blob()
        self._sending = len(asked)
        meta = {"step": step, "nbytes": blob.nbytes, "barriers": self.mesh.barriers}
        for rank, ask in asked.items():
            log.info("rank %d: healing rank %d (incarnation %d) at step %d, %d bytes",
                     self.mesh.rank, rank, ask.incarnation, step, blob.nbytes)
            self.mesh.spawn(self._send(rank, ask.ticket, meta, blob))

    def _blob(self) -> np.ndarray:
        if self.hooks is None:
            return EMPTY
        state = self.hooks.state()
        if isinstance(state, np.ndarray):
            return np.ascontiguousarray(state).reshape(-1).view(np.uint8)
        return np.frombuffer(state, np.uint8)

    async def _send(self, rank: int, ticket: int, meta: dict[str, Any],
                    blob: np.ndarray) -> None:
        try:
            await self.mesh.send(rank, EMPTY, step=ticket, tag=tags.HEAL, meta=meta)
            for i, lo in enumerate(range(0, blob.nbytes, PIECE)):
                await self.mesh.send(rank, blob[lo:lo + PIECE], step=ticket,
                                     tag=tags.HEAL + 1 + i)
            self.served += 1
        except PeerLost as exc:
            log.warning("rank %d: rank %d went away while healing: %s", self.mesh.rank, rank,
                        exc)
        finally:
            self._sending -= 1
            if not self._sending and self._serving_at is not None:
                self.serve(self._serving_at)  # inside a step: the next askers now

    async def heal(self) -> int:
        """Ask the first peer that answers (see :func:`sources`) for the job's step and state,
        each within the timeout; load the state (and the barrier count) and return the step."""
        mesh, timeout = self.mesh, self.timeout
        failures = []
        for source in sources(mesh.rank, mesh.world_size, self._neighbours()):
            ticket = self._tickets
            self._tickets += 1
            try:
                await mesh.send_control(source, HealAsk(mesh.incarnations.mine, ticket))
                head = await mesh.recv_into(source, EMPTY, step=ticket, tag=tags.HEAL,
                                            timeout=timeout)
                step, nbytes, barriers = (head.meta.get(k) for k in ("step", "nbytes",
                                                                     "barriers"))
                if type(step) is not int or type(nbytes) is not int or nbytes < 0:
                    raise PeerLost(source, "sent a malformed heal")
                blob = np.empty(nbytes, np.uint8)
                for i, lo in enumerate(range(0, nbytes, PIECE)):
                    await mesh.recv_into(source, blob[lo:lo + PIECE], step=ticket,
                                         tag=tags.HEAL + 1 + i, timeout=timeout)
            except (PeerLost, TimeoutError) as exc:
                failures.append(f"rank {source}: {exc}")
                continue
            if self.hooks is not None:
                self.hooks.load_state(blob.data)
            if type(barriers) is int:
                mesh.barriers = barriers
            log.warning("rank %d (incarnation %d) healed from rank %d at step %d, %d bytes",
                        mesh.rank, mesh.incarnations.mine, source, step, nbytes)
            return step
        raise PeerLost(mesh.rank, "no live peer healed this rank: " + "; ".join(failures))


def sources(rank: int, world_size: int, neighbours: list[int]) -> list[int]:
    """The peers to heal from, in order: the scheme's neighbours (a tree rank's parent
    first), then every other rank."""
    near = sorted(neighbours)
    return [*near, *(r for r in range(world_size) if r != rank and r not in near)]
