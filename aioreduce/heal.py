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
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .errors import GroupMismatch, PeerLost, VectorMismatch
from .schemes import FellBehind, Result, Session, StragglerError
from .schemes.base import Arrival, Reforms, TellsFailure
from .wire import tags
from .wire.control import HealAsk, Reform, ResultAsk

if TYPE_CHECKING:
    from .stepper import Stepper
    from .transport import Mesh
    from .wire.frame import Header

log = logging.getLogger("aioreduce")

PIECE = 64 << 20  # bytes of the state per frame
# How long the live members of a ring that re-forms wait for one another's word: they are
# all in the same failed step, so they answer at once; a dead one fails the wait sooner.
AGREE_S = 10.0
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
                 neighbours: Callable[[], list[int]], rejoin_wait: float = 0.0,
                 members: Callable[[], tuple[int, ...] | None] = lambda: None) -> None:
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
        # Groups over a ring that can re-form: the ring's session (seen at a group's first
        # step), and whether the next group step is a group's first (after a last one, or
        # where a group runs again): the only place a group's ring changes its members.
        self._group_session: Reforms | None = None
        self._group_first = True
        self._marks_last = False  # a group step with ``last`` was seen: groups' starts known
        self._group_taken = False  # the group failed because ranks were taken back
        # A ring that left a rank out (see reformed): replacements that asked its lowest
        # member to be taken back; the change announced to the members, from its step on;
        # and the members this process healed into (a replacement's first session).
        self._joins: dict[int, HealAsk] = {}
        self._reform: Reform | None = None
        self.healed_members: tuple[int, ...] | None = None
        # A replacement that a re-formed ring took back (its steps ran without it): it joins
        # at the step the members change, where every member opens the ring's lanes anew.
        self.taken_back = False
        self._members = members  # the running session's, if it is a ring that can re-form
        # A group's last step (``last``) that succeeded here: its number, a copy of its result
        # and the ranks used and late, kept until a later group step succeeds. A peer whose
        # same step failed (a rank died after this one had all it needed) takes it from us.
        self._kept: tuple[int, np.ndarray, list[int], list[int]] | None = None
        self._spare: np.ndarray | None = None  # a step's copy of its vector, reused (_save)
        self._ended_at = -1  # the last group step that ended here, run or failed
        # rank -> the step it asked about last, not answered yet (answered once that step
        # ended here and no answer to it is on its way: one at a time, so bounded per rank)
        self._result_asks: dict[int, int] = {}
        self._answering: set[int] = set()
        self.rolled = 0  # group steps this rank took from a peer that finished them
        mesh.on_heal = self._ask
        mesh.on_reform = self._reformed
        mesh.on_result_ask = self._result_asked

    def _ask(self, rank: int, ask: HealAsk) -> None:
        if ask.incarnation < self.mesh.incarnations.known[rank]:
            return  # a replaced process's
        # (A newer one than we know: a replacement of rank 0 whose word of it, sent on
        # another task, may come after its ask. Authenticated as that rank, it is that rank.)
        if ask.join:
            self._joins[rank] = ask  # taken back at this rank's next step boundary
        else:
            self._asked[rank] = ask
            if self._serving_at is not None:
                self.serve(self._serving_at)

    def _reformed(self, rank: int, event: Reform) -> None:
        """The ring's lowest member re-forms it from ``event.start`` on: note it, and say so
        at once (it waits for every member before it runs the step before that one)."""
        members = self._members()
        if members is None or rank != min(members) or self.mesh.rank not in event.members:
            return
        self._reform = event
        self.mesh.spawn(self._quiet_send(rank, event.start, tags.MEMBERS + 2, {}))

    async def _quiet_send(self, rank: int, step: int, tag: int, meta: dict[str, Any]) -> None:
        with contextlib.suppress(PeerLost):  # gone: the step that needs it fails, and says so
            await self.mesh.send(rank, EMPTY, step=step, tag=tag, meta=meta)

    async def step(self, steps: Stepper, run: Callable[[], Awaitable[Result]],
                   into: np.ndarray | None, *, rerun: bool = True,
                   session: Session | None = None, last: bool = False,
                   arrival: Arrival | None = None) -> Result:
        """Run one step (``run`` takes the next step number) as healing asks: first answer
        the peers that asked; after ``FellBehind``, heal this rank's state too (with state
        hooks); after a step that failed because a rank was lost, wait up to
        ``rejoin_wait`` for its replacement and run it again (``into``, summed in place,
        is restored first), as often as ranks were lost. A ring's step (a session that
        :class:`Reforms`) can end on some ranks and fail on others when a rank dies after
        its last parts reached some of them: those go on and fail the next step. So there
        every rank keeps a copy of its last result, and where the step failed it first asks
        the live ranks for it (as for a group's last step, below); taken (into ``into``, or
        a new array shaped as the scheme's steps), the step counts as run here and the next
        one fails on every rank alike.

        ``rerun=False``: the step is one of a group that the caller runs again as a whole
        (see :meth:`replace_lost`); it answers no heal at its boundary (a replacement must
        start at a group's first step), and a failure because ranks died is recorded and
        raised, by this step and at once by every later one of the group; a ``session`` that
        can (:class:`~aioreduce.schemes.base.TellsFailure`) tells the peers that such a step
        failed here, so that a peer which finished the step that failed here (its last parts
        came before the death) and waits in the next one fails it too, and runs the group
        again from the same step as every rank.

        ``last`` (with ``rerun=False``): the group's last step. It may end on some ranks and
        fail on others (a rank died after its part reached some of them: the ring's last
        segments); those that finished go on to the next group. So a rank where it failed
        asks the live ranks for its result and, if one finished it, takes that (written into
        ``into``) and goes on too, as if its own step had succeeded; every rank keeps its
        last such result (a copy) until a later group step succeeds. With ``arrival``
        (``into`` is still being filled) the result is written once every piece has landed;
        such a vector cannot be restored, so a step with it is not run again in place."""
        if not rerun:
            return await self._group_step(steps, run, session, last, into, arrival)
        into = into if arrival is None else None
        # (A protocol's isinstance costs 10 us: not on every step, only where it may apply.)
        if (self._reform is not None or self._joins) and isinstance(session, Reforms):
            await self._boundary(session, steps.step)
        self._serving_at = steps.step
        if self._asked:  # (nearly every step: nobody asked)
            self.serve(steps.step)
        saved: np.ndarray | None = None
        try:
            if not self.rejoin_wait:
                return await self._healing(steps, run)
            known = list(self.mesh.incarnations.known)
            saved = self._save(into) if into is not None else None
            # A ring's step can end on some ranks and fail on others (a rank died after its
            # last segments reached some of them): those go on to the next step. So here,
            # as for a group's last step, every rank keeps its last result, and a rank where
            # the step failed first asks the live ranks for it.
            # (Not before the scheme's first step: a step not summed in place takes the
            # result into a new array shaped as the steps before it.)
            rolls = arrival is None and isinstance(session, Reforms) and (
                into is not None or steps.like is not None)
            for attempt in range(len(known)):  # a host lost takes several ranks at once
                # Who runs this attempt: a rank replaced before it began (another rank of a
                # lost host, back first) is in it; ``known`` stays the incarnations when the
                # step first ran, so a late word of an old process's loss is not waited on.
                began = list(self.mesh.incarnations.known)
                at = steps.step
                try:
                    result = await self._healing(steps, run)
                except (PeerLost, StragglerError) as exc:
                    lost = self._dead(exc, known)
                    if rolls:
                        self._ended(at)
                    if not lost:
                        raise
                    reforms = session if isinstance(session, Reforms) else None
                    if rolls and attempt == 0 and reforms is not None:
                        self._serving_at = None
                        target = into if into is not None else np.empty_like(steps.like)
                        taken = await self._roll_forward(at, target, lost,
                                                         members=reforms.members)
                        if taken is not None:
                            self._keep(at, taken)
                            return taken
                    # The number the step runs again as. A ring answers heals once its
                    # members are agreed: a replacement heals into the ring it will run in.
                    self._serving_at = None if reforms is not None else steps.step
                    missing: list[int] = []
                    for rank in lost:
                        # (A peer that took this process for its dead predecessor runs again
                        # at once: so do we.)
                        if rank != self.mesh.rank and not await self._replaced(rank,
                                                                               known[rank]):
                            if reforms is None:
                                raise
                            missing.append(rank)
                    if reforms is not None:
                        await self._agree(reforms, lost, missing, steps.step, exc, began)
                        self._serving_at = steps.step
                        self.serve(steps.step)
                else:
                    if rolls:
                        self._keep(at, result)
                        self._ended(at)
                    return result
                back = [r for r in lost if r not in missing]
                if back:
                    log.warning("rank %d: ranks %s were replaced; the failed step runs again "
                                "as step %d", self.mesh.rank, back, steps.step)
                if into is not None and saved is not None:
                    np.copyto(into, saved)
            at = steps.step
            result = await self._healing(steps, run)
            if rolls:
                self._keep(at, result)
                self._ended(at)
            return result
        finally:
            self._serving_at = None
            if saved is not None:
                self._spare = saved

    def _save(self, into: np.ndarray) -> np.ndarray:
        """A copy of ``into`` (to restore it before a run again), in the memory of an earlier
        step's copy where it fits (fresh memory costs page faults every step). Taken while
        in use, so steps that overlap each have their own."""
        spare, self._spare = self._spare, None
        if spare is None or spare.shape != into.shape or spare.dtype != into.dtype:
            return into.copy()
        np.copyto(spare, into)
        return spare

    async def _agree(self, session: Reforms, lost: list[int], missing: list[int], at: int,
                     exc: PeerLost | StragglerError, known: list[int]) -> None:
        """After a ring step failed because ``lost`` died and ``missing`` of them were not
        replaced here within ``rejoin_wait``: the live members agree, through the lowest of
        them, on the ring the step runs again over, and this rank re-forms its session to it.
        A rank is left out only if no live member saw its replacement (one that did will
        run with it, and the others then find it too). Raises ``exc`` if a member does not
        answer in time (it died too), :class:`GroupMismatch` if the members would run it
        again at different steps."""
        mesh, wait = self.mesh, self._agree_wait
        members = session.members
        # The members that ran the failed step and live: not a rank another death took
        # (its connection broke) or that a replacement took over since (``known``: the
        # incarnations when this run of the step began; a rank replaced before it is in it);
        # such a rank stays a member, and the step run again fails on it (then it is waited
        # for) or runs with its replacement.
        incarnations = mesh.incarnations.known
        live = [r for r in members if r == mesh.rank or (
            r not in lost and not mesh.is_lost(r) and incarnations[r] == known[r])]
        coordinator = min(live)
        try:
            if mesh.rank != coordinator:
                await mesh.send(coordinator, EMPTY, step=at, tag=tags.MEMBERS,
                                meta={"at": at, "missing": missing})
                decision = (await mesh.recv_into(coordinator, EMPTY, step=at,
                                                 tag=tags.MEMBERS + 1, timeout=2 * wait)).meta
            else:
                others = [r for r in live if r != mesh.rank]
                heads = await asyncio.gather(*(
                    mesh.recv_into(r, EMPTY, step=at, tag=tags.MEMBERS, timeout=wait)
                    for r in others))
                theirs = {r: h.meta for r, h in zip(others, heads, strict=True)}
                decision = _decide(members, mesh.rank, missing, at, theirs)
                await asyncio.gather(*(mesh.send(r, EMPTY, step=at, tag=tags.MEMBERS + 1,
                                                 meta=decision) for r in others))
                # A replacement healed into the run that failed (a peer inside it answered
                # at once) ran it too, and waits for this word: every member replaced since
                # the run began hears it as well (one that came later is not waiting: the
                # frame stays unread, keyed by a step nobody agrees at again).
                new = [r for r in members if r != mesh.rank and r not in others
                       and incarnations[r] != known[r] and not mesh.is_lost(r)]
                await asyncio.gather(*(mesh.send(r, EMPTY, step=at, tag=tags.MEMBERS + 1,
                                                 meta=decision) for r in new),
                                     return_exceptions=True)
        except (PeerLost, TimeoutError):
            raise exc from None
        ring = decision.get("members")
        if not isinstance(ring, list) or mesh.rank not in ring:
            at_of = decision.get("at")
            if isinstance(at_of, dict):
                raise GroupMismatch(mesh.rank, sorted(lost), {
                    int(r): s for r, s in at_of.items() if str(r).isdigit() and type(s) is int})
            raise exc
        if tuple(ring) != members:
            out = sorted(set(members) - set(ring))
            log.warning("rank %d: ranks %s did not come back within %g s; the steps run over "
                        "the %d others from step %d", mesh.rank, out, self.rejoin_wait,
                        len(ring), at)
            session.reform(ring)

    async def _boundary(self, session: Reforms, step: int, *, group: bool = False) -> None:
        """A re-formed ring's step boundary: apply a change announced for this step; on the
        lowest member, take back the replacements that asked: announce the ring with them
        from the next step on, wait until every member has heard it (none can start that
        step before this rank has run this one), and heal them at that step."""
        reform, members = self._reform, session.members
        if reform is not None and step >= reform.start:
            self._reform = None
            if reform.members != members:
                log.warning("rank %d: the steps run over ranks %s from step %d",
                            self.mesh.rank, list(reform.members), step)
                # Connected first: a step takes a peer whose connection broke and did not
                # come back for lost (the transpose would not wait for its slices).
                await asyncio.gather(*(self._connect(r) for r in reform.members
                                       if r not in members and r != self.mesh.rank))
                session.reform(reform.members)
                members = session.members
            # The lowest member: the replacements it took back are healed into this step
            # like any asker (serve(), right after this boundary, sends the members too).
            for rank in [r for r in self._joins if r in members]:
                self._asked[rank] = self._joins.pop(rank)
            return
        if self.mesh.rank != min(members):
            self._joins.clear()  # asked as the lowest member, which it is not: it asks again
            return
        if not self._joins or self._reform is not None:
            return
        joiners = [r for r in self._joins if r not in members]
        for r in [r for r in self._joins if r in members]:
            del self._joins[r]  # (already back)
        if not joiners:
            return
        event = Reform(tuple(sorted({*members, *joiners})), step + 1)
        others = [r for r in members if r != self.mesh.rank]
        acks = [asyncio.ensure_future(self.mesh.recv_into(
            r, EMPTY, step=event.start, tag=tags.MEMBERS + 2, timeout=self.timeout))
            for r in others]
        await asyncio.gather(*(self._quiet_control(r, event) for r in others))
        # A member that does not answer is dead: the step fails without it and the ring
        # re-forms from there; the change stands for every member that heard it.
        await asyncio.gather(*acks, return_exceptions=True)
        self._reform = event
        log.warning("rank %d: ranks %s healed; the steps take them back at step %d%s",
                    self.mesh.rank, joiners, event.start,
                    " (groups of steps: at the first group's start from there)" if group
                    else "")

    async def _connect(self, rank: int) -> None:
        with contextlib.suppress(PeerLost, TimeoutError):  # the step then finds it lost
            await asyncio.wait_for(self.mesh.connect(rank), self.timeout)

    async def _quiet_control(self, rank: int, event: Reform) -> None:
        with contextlib.suppress(PeerLost):
            await self.mesh.send_control(rank, event)

    async def _group_boundary(self, session: Reforms, at: int) -> None:
        """A group's first step over a ring that can re-form (``at``): the only point where
        its members change, so a rank left out is taken back here (:meth:`_boundary`: the
        lowest member announces the ring with it, every member applies that at its first
        group-first step from the one announced, the same step everywhere as every rank
        numbers the groups alike; the group then fails at once and runs again with them,
        healed by :meth:`replace_lost`). The replacements this step answers: those the ring
        runs without, which learn so from the answer and ask to be taken back; never a
        replacement of a member, which heals where its group runs again."""
        before = session.members
        if self._reform is not None or self._joins:
            await self._boundary(session, at, group=self._marks_last)
        joined = [r for r in session.members if r not in before]
        if joined:
            # Taken back here. Its first group may not be laid out as the members' (a
            # replacement's DDP sums its first iteration as one vector, not in buckets it
            # has not built yet), so this group fails on every member at once, as if the
            # ranks had died, and runs again with them where replace_lost() heals them:
            # every rank then runs a group again, alike.
            known = self.mesh.incarnations.known
            self._group_error = PeerLost(joined[0], "taken back into the ring: its group "
                                         "runs again with it")
            self._group_lost = {r: known[r] - 1 for r in joined}
            self._group_taken = True
            return
        if self._serving_at is None:
            outside = {rank: ask.incarnation for rank, ask in self._asked.items()
                       if rank not in before}
            if outside:
                self._serving_at, self._serve_only = at, outside

    async def _group_step(self, steps: Stepper, run: Callable[[], Awaitable[Result]],
                          session: Session | None, last: bool, into: np.ndarray | None,
                          arrival: Arrival | None = None) -> Result:
        at = steps.step  # the number this step takes
        self._serving_at, self._serve_only = self._group_at, self._group_for
        if last:
            self._marks_last = True
        if self._group_first and self._group_error is None:
            self._group_first = False
            # (checked once a group, not per step: a protocol's isinstance costs 10 us)
            if self.rejoin_wait and isinstance(session, Reforms):
                self._group_session = session
                await self._group_boundary(session, at)
        elif (not self._marks_last and self._group_session is not None
              and cast(object, session) is self._group_session and self._group_error is None
              and (self._reform is not None or self._joins or self._asked)):
            # A program that does not mark its groups' last steps: where its groups start
            # is not known here, so any group step is where a rank left out is answered and
            # taken back (the group then fails on every member at the same step and runs
            # again with it, as at a first step). A program that marks them waits for the
            # next group's start instead, and loses no step of the group.
            await self._group_boundary(self._group_session, at)
        if self._group_error is not None:
            self._serving_at, self._serve_only = None, None
            step = steps.take()  # every rank numbers the group's steps alike, run or not
            self._ended(step)
            # (checked here, not per step: a protocol's isinstance costs microseconds)
            if isinstance(session, TellsFailure):  # a peer may be in it, waiting for us
                session.tell_failed(step, self._group_error)
            raise self._group_error
        known = list(self.mesh.incarnations.known)
        if self._serving_at is not None:
            self.serve(self._serving_at)
        try:
            result = await self._healing(steps, run)
        except (PeerLost, StragglerError) as exc:
            lost = self._dead(exc, known) if self.rejoin_wait else []
            self._ended(at)
            if lost and last and into is not None:
                # (answering the serving side first: a peer may be asking us the same)
                self._serving_at, self._serve_only = None, None
                taken = await self._roll_forward(at, into, lost, arrival)
                if taken is not None:  # kept as if run here: another may ask us too
                    self._group_at, self._group_for = None, {}
                    self._keep(at, taken)
                    self._group_first = True
                    return taken
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
        if last:
            self._keep(at, result)
            self._group_first = True
        elif self._kept is not None and self._kept[0] < at:
            self._kept = None  # every rank ran a step after it: nobody will ask
        self._ended(at)
        return result

    @property
    def _agree_wait(self) -> float:
        """How long live ranks in the same failed step wait for one another's word."""
        return max(self.rejoin_wait, AGREE_S)

    def _keep(self, at: int, result: Result) -> None:
        """Keep a copy of step ``at``'s result (a group's last, or a ring's plain step) for a
        peer where it failed."""
        value = np.asarray(result.value).reshape(-1)
        kept = self._kept
        # Plain ring steps keep every result: the last copy's memory is reused (fresh memory
        # costs page faults every step), unless an answer may still be sending it.
        if (kept is not None and not self._answering and kept[1].shape == value.shape
                and kept[1].dtype == value.dtype):
            np.copyto(kept[1], value)
            copy = kept[1]
        else:
            copy = value.copy()
        self._kept = (at, copy, list(result.used), list(result.late))

    def _ended(self, step: int) -> None:
        """A group step ended here (ran or failed): answer the ranks that asked for it."""
        self._ended_at = max(self._ended_at, step)
        for rank in list(self._result_asks):
            self._answer(rank)

    def _result_asked(self, rank: int, ask: ResultAsk) -> None:
        """``rank``'s group step ``ask.step`` failed: answer once that step ended here. (An
        honest rank asks for one step at a time: a newer ask replaces its older one.)"""
        self._result_asks[rank] = ask.step
        self._answer(rank)

    def _answer(self, rank: int) -> None:
        """Answer ``rank``'s ask if its step ended here and no answer is on its way to it."""
        step = self._result_asks.get(rank)
        if step is None or step > self._ended_at or rank in self._answering:
            return
        del self._result_asks[rank]
        self._answering.add(rank)
        self.mesh.spawn(self._send_answer(rank, step, self._kept))

    async def _send_answer(self, rank: int, step: int,
                           kept: tuple[int, np.ndarray, list[int], list[int]] | None) -> None:
        try:
            with contextlib.suppress(PeerLost):
                if kept is None or kept[0] != step:
                    await self.mesh.send(rank, EMPTY, step=step, tag=tags.ROLL,
                                         meta={"have": False})
                    return
                _step, value, used, late = kept
                await self.mesh.send(rank, EMPTY, step=step, tag=tags.ROLL,
                                     meta={"have": True, "used": used, "late": late})
                await self.mesh.send(rank, value, step=step, tag=tags.ROLL + 1)
        finally:
            self._answering.discard(rank)
            self._answer(rank)  # an ask that came meanwhile

    async def _roll_forward(self, at: int, into: np.ndarray, lost: list[int],
                            arrival: Arrival | None = None, *,
                            members: Sequence[int] | None = None) -> Result | None:
        """Step ``at`` (a group's last, or a plain step of a ring: of ``members``) failed
        here because ``lost`` died: the result from a live rank that finished it (written
        into ``into``), or None if none did (each answers once its own step ``at`` is
        over; a peer that cannot answer is not waited for: :meth:`_answer_of`)."""
        mesh = self.mesh
        peers = [r for r in (self._group_ranks() if members is None else members)
                 if r != mesh.rank and r not in lost and not mesh.is_lost(r)]
        heads = [asyncio.ensure_future(self._answer_of(r, at)) for r in peers]
        try:
            for done in asyncio.as_completed(heads):
                try:
                    head = await done
                except (PeerLost, TimeoutError):
                    continue
                used, late = head.meta.get("used"), head.meta.get("late")
                if (head.meta.get("have") is not True or not _ranks(used, mesh.world_size)
                        or not _ranks(late, mesh.world_size)):
                    continue
                try:
                    if arrival is not None:  # (a piece still landing would overwrite it)
                        await asyncio.to_thread(arrival.landed, 0, into.size)
                    await mesh.recv_into(head.src, into.reshape(-1), step=at,
                                         tag=tags.ROLL + 1, timeout=self.timeout)
                except (PeerLost, TimeoutError, VectorMismatch):
                    continue
                self.rolled += 1
                log.warning("rank %d: step %d failed here when ranks %s died, but rank %d had "
                            "finished it: its result taken, the next steps go on", mesh.rank,
                            at, lost, head.src)
                return Result(into, at, cast(list[int], used), cast(list[int], late))
        finally:
            for pending in heads:
                pending.cancel()
        return None

    async def _answer_of(self, rank: int, at: int) -> Header:
        """Ask ``rank`` for its result of step ``at``: the head of its answer. ``PeerLost``
        at once if the ask cannot reach it, or once a new process replaces it (neither can
        answer: a rank of a lost host not yet seen dead here, dialled, refuses; one found
        replaced never ran the step), ``TimeoutError`` after :attr:`_agree_wait`."""
        mesh = self.mesh
        head = asyncio.ensure_future(mesh.recv_into(rank, EMPTY, step=at, tag=tags.ROLL,
                                                    timeout=self._agree_wait))
        gone = mesh.replaced(rank, mesh.incarnations.known[rank])
        try:
            await mesh.send_control(rank, ResultAsk(at))
            await asyncio.wait((head, gone), return_when=asyncio.FIRST_COMPLETED)
            if not head.done():
                raise PeerLost(rank, f"replaced while asked for step {at}'s result")
            return head.result()
        finally:
            head.cancel()
            gone.cancel()

    async def replace_lost(self, steps: Stepper) -> bool:
        """After steps run with ``rerun=False`` failed because ranks died: wait up to
        ``rejoin_wait`` for each one's replacement, answering heal requests meanwhile with
        the next step number (where the caller runs its group again, and a replacement
        starts). True if every one came, or, over a ring that can re-form, once the live
        members agreed to run the group again without the ones that did not (as a ring's
        failed step does, see :meth:`_agree`; such a rank's replacement is taken back at a
        later group's first step). False if no such step failed (or ``rejoin_wait`` is 0,
        or one did not come and the ring cannot re-form, or a live rank did not answer):
        then the caller raises its error. First the live ranks check that they all run the
        group again from the same step: :class:`~aioreduce.errors.GroupMismatch` on every
        one if not (see there)."""
        lost, error, taken = self._group_lost, self._group_error, self._group_taken
        self._group_lost, self._group_error, self._group_taken = {}, None, False
        if not lost or error is None:
            return False
        reforms = self._group_session
        world = self.mesh.world_size
        # The check's key: the deaths (their ranks and incarnations), or, for ranks taken
        # back, their replacements, apart from any death's key (a replacement may die too).
        key = max(incarnation * world + rank for rank, incarnation in lost.items())
        if not await self._same_step(lost, steps.step,
                                     key + (1 << 32) + world if taken else key):
            return False
        began = list(self.mesh.incarnations.known)
        self._group_at = steps.step
        # A ring answers heals once its members are agreed: a replacement heals into the
        # ring it will run in.
        self._serving_at = None
        if reforms is None:
            self._serving_at = steps.step
            self.serve(steps.step)
        missing: list[int] = []
        try:
            for rank, incarnation in lost.items():
                if rank != self.mesh.rank and not await self._replaced(rank, incarnation):
                    if reforms is None:
                        self._group_at = None
                        return False
                    missing.append(rank)
            if reforms is not None:
                try:
                    await self._agree(reforms, sorted(lost), missing, steps.step, error, began)
                except (PeerLost, StragglerError):
                    self._group_at = None
                    return False
                self._serving_at = steps.step
                self.serve(steps.step)
        finally:
            self._serving_at = None
        self._group_first = True  # the group runs again: from a group's first step
        known = self.mesh.incarnations.known
        back = sorted(rank for rank in lost if rank not in missing)
        self._group_for = {rank: known[rank] for rank in back}
        if back:
            log.warning("rank %d: ranks %s were replaced; the group of steps runs again "
                        "from step %d", self.mesh.rank, back, steps.step)
        return True

    def _group_ranks(self) -> Sequence[int]:
        """The ranks a group's checks ask: its ring's members if it can re-form (a rank it
        left out runs no group), else every rank."""
        if self._group_session is not None:
            return self._group_session.members
        return range(self.mesh.world_size)

    async def _same_step(self, lost: dict[int, int], at: int, key: int) -> bool:
        """Check with every other live rank (of :meth:`_group_ranks`) that it runs the
        group again from step ``at`` too, on frames keyed ``key`` (the reason); raise
        :class:`GroupMismatch` on every one if not. False if a rank did not answer within
        ``rejoin_wait`` (it died too, or is not in a group)."""
        mesh = self.mesh
        peers = [r for r in self._group_ranks() if r != mesh.rank and r not in lost]
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
        is dead (its connection broke, it was replaced since the step began, or a peer
        that saw it die said so: ``exc.lost``, which may name this process, a replacement
        its peers did not know yet)."""
        if isinstance(exc, PeerLost):
            return [exc.rank] if 0 <= exc.rank < len(known) else []
        mesh = self.mesh
        # A peer that saw a rank die names it lost (a tree's dead root for its grandchildren,
        # a dead leaf for the root): then it is dead here too, this process included (our
        # peers took us for our dead predecessor). Missing alone, this process was only late:
        # running the step again here, alone, would mix its vector into a later step.
        dead = [r for r in exc.missing if 0 <= r < len(known) and (
            r in exc.lost
            or (r != mesh.rank and (mesh.is_lost(r) or mesh.incarnations.known[r] > known[r])))]
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
        if not self._asked or self._sending:  # (every step: nobody asked)
            return
        only = self._serve_only
        asked = {rank: ask for rank, ask in self._asked.items()
                 if only is None or only.get(rank) == ask.incarnation}
        if not asked:
            return
        for rank in asked:
            del self._asked[rank]
        blob = self._blob()
        self._sending = len(asked)
        meta: dict[str, Any] = {"step": step, "nbytes": blob.nbytes,
                                "barriers": self.mesh.barriers}
        members = self._members()
        if members is not None:  # a ring: the replacement runs in it only if it is a member
            meta["members"] = list(members)
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
        each within the timeout; load the state (and the barrier count) and return the step.
        If the answer is a ring that runs without this rank (it was not back in time), ask
        the ring's lowest member to take it back, and heal from its answer instead."""
        mesh = self.mesh
        failures = []
        for source in sources(mesh.rank, mesh.world_size, self._neighbours()):
            try:
                got = await self._fetch(source, join=False)
                while got[3] is not None and mesh.rank not in got[3]:
                    source = min(got[3])
                    log.warning("rank %d: the job's steps left this rank out while it was "
                                "away; asking rank %d to take it back", mesh.rank, source)
                    got = await self._fetch(source, join=True)
                    self.taken_back = True
            except (PeerLost, TimeoutError) as exc:
                failures.append(f"rank {source}: {exc}")
                continue
            step, blob, barriers, self.healed_members = got
            if self.hooks is not None:
                self.hooks.load_state(blob.data)
            if type(barriers) is int:
                mesh.barriers = barriers
            log.warning("rank %d (incarnation %d) healed from rank %d at step %d, %d bytes",
                        mesh.rank, mesh.incarnations.mine, source, step, blob.nbytes)
            return step
        raise PeerLost(mesh.rank, "no live peer healed this rank: " + "; ".join(failures))

    async def _fetch(self, source: int, *, join: bool
                     ) -> tuple[int, np.ndarray, object, tuple[int, ...] | None]:
        """One heal from ``source``: the step, the state, the barrier count and the ring's
        members (None for a scheme that does not re-form). ``join``: wait until ``source``,
        a ring's lowest member, takes this rank back (its next two step boundaries)."""
        mesh, timeout = self.mesh, self.timeout
        ticket = self._tickets
        self._tickets += 1
        await mesh.send_control(source, HealAsk(mesh.incarnations.mine, ticket, join))
        head = await mesh.recv_into(source, EMPTY, step=ticket, tag=tags.HEAL,
                                    timeout=timeout)
        step, nbytes, barriers, ring = (head.meta.get(k) for k in ("step", "nbytes",
                                                                   "barriers", "members"))
        if type(step) is not int or type(nbytes) is not int or nbytes < 0 or not (
                ring is None or (isinstance(ring, list) and ring and all(
                    type(r) is int and 0 <= r < mesh.world_size for r in ring))):
            raise PeerLost(source, "sent a malformed heal")
        blob = np.empty(nbytes, np.uint8)
        for i, lo in enumerate(range(0, nbytes, PIECE)):
            await mesh.recv_into(source, blob[lo:lo + PIECE], step=ticket,
                                 tag=tags.HEAL + 1 + i, timeout=timeout)
        return step, blob, barriers, None if ring is None else tuple(ring)


def _decide(members: tuple[int, ...], me: int, missing: list[int], at: int,
            theirs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The lowest live member's decision (a frame's meta) from every live member's proposal:
    the ring without the ranks that no member saw replaced, or, if the members would run the
    step again at different steps, each one's step."""
    ats = {r: m.get("at") for r, m in theirs.items()}
    if any(a != at for a in ats.values()):
        ats[me] = at
        return {"at": {str(r): a if type(a) is int else -1 for r, a in ats.items()}}
    out = set(missing)
    for proposal in theirs.values():
        said = proposal.get("missing")
        out &= {r for r in said if type(r) is int} if isinstance(said, list) else set()
    return {"members": [r for r in members if r not in out]}


def _ranks(value: object, world_size: int) -> bool:
    """Is ``value`` a list of ranks (a peer's frame: checked before use)?"""
    return isinstance(value, list) and all(type(r) is int and 0 <= r < world_size
                                           for r in value)


def sources(rank: int, world_size: int, neighbours: list[int]) -> list[int]:
    """The peers to heal from, in order: the scheme's neighbours (a tree rank's parent
    first), then every other rank."""
    near = sorted(neighbours)
    return [*near, *(r for r in range(world_size) if r != rank and r not in near)]
