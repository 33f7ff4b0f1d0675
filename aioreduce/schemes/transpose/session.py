"""One rank of a bounded-time transpose allreduce: what a step does, and what lives across
steps (the stage clock, background sends, which replicas drifted, the newest step heard of).

A step, on rank ``r`` of ``N``:

1. post the phase-1 receives: slices of shard ``r`` from each peer (one scratch row each);
2. rotate this rank's vector shard by shard (each shard is rotated on its own), sending each
   shard's slices to its owner as soon as it is ready (in the background: a stopped owner
   only blocks its own queue), then post the phase-2 receives of every other shard, straight
   into the result (which may be the caller's vector: it has been read by now);
3. stage 1 (bounded by ``D1``): add what arrived to this rank's own copy of shard ``r``;
   raise the floor so late phase-1 slices are dropped on arrival;
4. rotate the reduced shard back (its owner inverts just 1/N of the vector, not every rank
   all of it), send it to every rank, with its received fraction and the ranks missing from
   it; stage 2 ends ``D1 + D2`` after stage 1 began (an owner that waited its whole ``D1``
   still has ``D2`` to deliver), and its early close does not wait for owners that sent
   nothing in stage 1;
5. a reduced slice that did not come gets the stand-in; account for every slice, apply the
   safety valve, update the clocks (one per stage, as their times differ: stage 1 absorbs
   the ranks' skew).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...codes.hadamard import Rotation
from ..base import BulkLink, Comm, FellBehind, Result, StragglerError, spans_hosts
from ..links import CommLinks, LaneLinks, Links, SplitLinks, unopened
from ..links.reopen import Reopener
from ..members import MembersComm, real_error, real_result
from ..pool import BufferPool
from .clock import StageClock
from .layout import NOTICE_TAG, PHASE2_TAG, Layout
from .stage import Slot, Stage

if TYPE_CHECKING:
    from . import Transpose

log = logging.getLogger("aioreduce.schemes")
TRANSITION = 3.0  # the bound of a step that starts or stops rotating, in bounds (see _run)


class TransposeSession:
    """State of the transpose scheme on one rank (see the module docstring)."""

    def __init__(self, comm: Comm, opts: Transpose) -> None:
        self.comm, self.opts = comm, opts
        # The comm of the ranks underneath, and the ranks the steps run over: every rank
        # until a dead one is left out (see reform; then ``comm`` numbers the members).
        self._base = comm
        self.members: tuple[int, ...] = tuple(range(comm.world_size))
        self._retired: list[Links] = []  # links of the ring before a re-form, to close
        self.clocks = self._new_clocks()
        # Through the comm until the first step opens lanes to every peer (if the comm has
        # them: not the in-memory network); see links.py and lanes.py.
        self.links: Links = CommLinks(comm, opts.backlog_steps)
        self._want_lanes = opts.lanes and comm.world_size > 1
        self._slice_bytes = opts.slices(spans_hosts(comm))
        # A step's rotated vector, phase-1 scratch and result: reused once nothing holds them
        # (a send still queued for a slow peer, a result the caller kept), as fresh 16 MiB
        # arrays cost page faults every step.
        self.pool = BufferPool(spare=4)
        self.drifted: set[int] = set()  # ranks known to have used stand-ins since a re-sync
        self.last_deadline = 0.0
        self._rotation: Rotation | None = None
        # hadamard="after_loss" (see _rotates): the newest block of rotate_steps steps in
        # which this rank saw or heard of a loss, and this block's decision.
        self._lossy_block = -1
        self._at = -1  # the step running
        self._block: tuple[int, bool] = (-1, False)
        self._changed_at = -1  # the step that began a block with another decision
        self._rot_cost = 0.0  # seconds this rank's forward rotation took (moving average)
        self._heard_rotating = (False, False)  # a peer rotated: (last step, this step)
        # A replacement and each peer open lanes again (see links/reopen.py); a step sends
        # and posts only for itself, so a peer's slices move to its new lanes at the start
        # of the step agreed on (_lanes_from), never inside one.
        self._lanes_from: dict[int, int] = {}
        self._joined = False  # a replacement taken back by a re-formed transpose
        self.reopener = Reopener(comm, lambda: self._at,
                                 lambda: isinstance(self.links, SplitLinks), self._reopened)
        self._removers = self.reopener.listen(
            p for p in range(comm.world_size) if p != comm.rank)

    @property
    def newest(self) -> int:
        """The newest step any peer sent a slice of."""
        return self.links.newest

    @property
    def lanes_open(self) -> bool:
        """Whether the slices travel over lanes (opened by the first step)."""
        return isinstance(self.links, SplitLinks)

    @property
    def lane_peers(self) -> list[int]:
        """The peers (ranks) whose slices travel over lanes now."""
        links, comm = self.links, self.comm
        if not isinstance(links, SplitLinks):
            return []
        mine = [p for p in range(comm.world_size) if p != comm.rank and p not in links.on_comm]
        return comm.real(mine) if isinstance(comm, MembersComm) else mine

    def known(self, step: int) -> bool:
        return False  # every step needs this rank's own vector

    def rejoined(self, step: int) -> None:
        """A replacement process (see :class:`~..base.Rejoins`): our peers' lanes went with
        the dead process, so everything goes over the comm until each peer and we open
        lanes again (from the next step on, or later: see links/reopen.py). Taken back by a
        re-formed transpose (``reform(joined=True)``, first), it opens them with every
        member at its first step instead, as they all do there."""
        if self._joined:
            return
        # (Healed into a re-formed transpose without being taken back: its members' comm
        # numbers peers by position, which the reopening does not: the event loop's.)
        if self._want_lanes and self.comm is self._base and self.comm.bulk_links() is not None:
            for peer in range(self.comm.world_size):
                if peer != self.comm.rank and not self.comm.is_lost(peer):
                    self.reopener.propose(peer, step + 1)
        self._want_lanes = False

    def _reopened(self, peer: int, out: BulkLink, in_: BulkLink, start: int) -> None:
        """Lanes with ``peer`` open again; its slices move to them at step ``start``."""
        links = self.links
        if self.comm is not self._base:  # re-formed meanwhile: the members' lanes only
            for lane in (out, in_):
                lane.close()
            return
        if isinstance(links, SplitLinks):
            links.lanes.add({peer: out}, {peer: in_})
        else:  # a replacement's first: every other peer stays on the comm until its turn
            assert isinstance(links, CommLinks)
            self.links = SplitLinks(
                LaneLinks(self.comm, {peer: out}, {peer: in_}, self.opts.backlog_steps,
                          links.newest, opened_by=self.comm.bulk_links(),
                          notice_tag=NOTICE_TAG, lending=True), links, self.comm)
            self.links.on_comm.update(p for p in range(self.comm.world_size)
                                      if p != self.comm.rank)
        self._lanes_from[peer] = start

    async def close(self, timeout: float) -> None:
        for remove in self._removers:
            remove()
        self.reopener.close()
        for links in [*self._retired, self.links]:
            await links.close(timeout)
        self._retired.clear()

    def reform(self, members: Sequence[int], *, joined: bool = False) -> None:
        """See :class:`~..base.Reforms`: from the next step on, shard ``k`` is the ``k``-th
        member's, the members open new lanes with each other at that step (every member
        applies the change there: see aioreduce.heal; a replacement taken back is
        ``joined`` and opens its lanes there too), and the stage clocks learn again."""
        members = tuple(sorted(set(members)))
        if joined:  # a replacement's new session: everything it has is fresh already
            self._joined = True
            self._want_lanes = self.opts.lanes and len(members) > 1
        if members == self.members:
            return
        self.comm = (self._base if len(members) == self._base.world_size
                     else MembersComm(self._base, members))
        self.members = members
        self._retired.append(self.links)
        self.links = CommLinks(self.comm, self.opts.backlog_steps)
        # Every member that ran steps changes at the same one: new lanes there. (A new
        # session healed into these members changes alone: see rejoined.)
        self._want_lanes = self.opts.lanes and len(members) > 1 and self._at >= 0
        self.reopener.cancel()  # (pairwise openings: the new lanes replace them)
        self._lanes_from.clear()
        self._rotation = None
        self.drifted.clear()
        self.clocks = self._new_clocks()

    def _lanes_reopened(self, step: int) -> None:
        """From this step on, the peers whose lanes opened again for it use them."""
        links = self.links
        for peer, start in list(self._lanes_from.items()):
            if step >= start:
                del self._lanes_from[peer]
                if isinstance(links, SplitLinks) and not self.comm.is_lost(peer):
                    links.on_comm.discard(peer)

    def _new_clocks(self) -> tuple[StageClock, ...]:
        """One clock per stage: stage 1 waits out the ranks' skew, stage 2 only a transfer."""
        opts = self.opts
        fixed = None if opts.deadline is None else opts.deadline / 2
        return tuple(StageClock(warmup=opts.warmup, slack=opts.slack, headroom=opts.headroom,
                                min_deadline=opts.min_deadline, fixed=fixed)
                     for _stage in range(2))

    async def _open_lanes(self, step: int) -> None:
        """Lanes to and from every peer, at the first step (every rank's comm is built the
        same way, so every rank makes the same choice)."""
        self._want_lanes = False
        peers = [p for p in range(self.comm.world_size) if p != self.comm.rank]
        links = self.comm.bulk_links()
        if links is None:
            return  # no mesh under this comm: the event loop's way
        # A peer dead before this first step has no lanes: it is lost to them (its slices
        # are missing, as a peer's that dies later are).
        outs, ins = await links.open_links(peers, peers, step, partial=True)
        old = self.links
        assert isinstance(old, CommLinks)
        # A peer whose connection breaks goes on through the comm until its replacement and
        # we open lanes again (see rejoined, _reopened).
        self.links = SplitLinks(
            LaneLinks(self.comm, outs, ins, self.opts.backlog_steps, old.newest,
                      opened_by=links, notice_tag=NOTICE_TAG,
                      lost=unopened(peers, outs, ins, step), lending=True), old, self.comm)

    def _rotation_for(self, length: int, dtype: np.dtype | None = None) -> Rotation:
        n = self.comm.world_size
        if (self._rotation is None or self._rotation.length != length
                or self._rotation.parts != n):
            self._rotation = Rotation(length, self.opts.seed, parts=n)
            if dtype is not None:  # now, at a first step (waited for: warm-up), not later
                self._rotation.prepare(dtype)
        return self._rotation

    async def step(self, step: int, like: np.ndarray, own: Awaitable[np.ndarray]) -> Result:
        return await self._in_ranks(self._run(step, like, own, None))

    async def step_to(self, step: int, like: np.ndarray, own: Awaitable[np.ndarray],
                      into: np.ndarray) -> Result:
        """The step with its result received straight into ``into`` (see
        :class:`~..base.WritesInto`): no result buffer, no copy of it."""
        return await self._in_ranks(self._run(step, like, own, into.reshape(-1)))

    async def _in_ranks(self, run: Awaitable[Result]) -> Result:
        """A step's outcome with its ranks named as ranks (a re-formed session's comm
        numbers the members by position)."""
        while self._retired:
            await self._retired.pop().close(0.0)
        comm = self.comm
        if not isinstance(comm, MembersComm):
            return await run
        try:
            return real_result(comm, await run)
        except StragglerError as exc:
            raise real_error(comm, exc) from None

    async def _run(self, step: int, like: np.ndarray, own: Awaitable[np.ndarray],
                   into: np.ndarray | None) -> Result:
        comm, opts = self.comm, self.opts
        n, me = comm.world_size, comm.rank
        t0 = time.perf_counter()
        links = self.links
        if self.newest >= step + opts.behind_steps:
            # Told we were cut at the newest step (Links.tell): our peers are past it by the
            # time we have our vector for it, and would cut us there again; the next one.
            ahead = self.newest + 1 if links.cut_at >= self.newest else self.newest
            links.discard_before(ahead)
            raise FellBehind(me, step, ahead)
        links.discard_before(step)
        self._heard_rotating = (self._heard_rotating[1], False)
        self._at = step
        if self._want_lanes:
            await self._open_lanes(step)
            links = self.links
        if self.reopener.opening:  # lanes with a replacement opening again
            await self.reopener.ready(step)
        if self._lanes_from:
            self._lanes_reopened(step)
            links = self.links
        if opts.hadamard is True and like.dtype.kind != "f":
            raise TypeError(f"rank {me}: Transpose(hadamard=True) needs floating-point "
                            f"vectors, not {like.dtype}; pass hadamard=False")
        # The rotation's padded layout whenever this scheme may rotate, so that every rank
        # cuts the same shards and slices whether or not it rotates this step.
        shape = (self._rotation_for(like.size, like.dtype)
                 if opts.hadamard is not False and like.size and like.dtype.kind == "f"
                 else None)
        rot = shape if shape is not None and self._rotates(step) else None
        length = shape.padded if shape is not None else like.size
        layout = _layout(length, n, max(1, self._slice_bytes // like.dtype.itemsize))
        lo, hi = layout.shards[me]
        # Row j: sender j's copy of our shard.
        scratch = self.pool.take(n * (hi - lo), like.dtype).reshape(n, hi - lo)
        # The result lands in `out` (the caller's array, or one of ours), except what lies
        # in the rotation's padding: slices reaching past the vector land in `tail`.
        out = into if into is not None else self.pool.take(like.size, like.dtype)
        tail = _Tail(layout, like.size, self.pool, like.dtype)
        phase1 = self._post(step, layout, me, [j for j in range(n) if j != me], 0,
                            lambda src, a, b: scratch[src, a - lo:b - lo])
        phase2: list[Slot] = []
        sent_early: set[int] = set()  # reduced slices sent during stage 1 (see _adder)
        peers = [j for j in range(n) if j != me]
        lent = False  # whether arrays of the caller's went out lent (released at the end)
        try:
            mine = np.asarray(await own).reshape(-1)
            # Stage 1's time starts here, with the rotation in it: the ranks' vectors are
            # ready at about the same time, their rotations (on a busy host) are not, and a
            # clock started after our own rotation would charge its variance twice.
            ready = time.perf_counter()
            # What we send must stay as it is until it is sent (a slow owner may take longer
            # than this step): our rotated vector, a copy, or the caller's array lent to the
            # links until the step ends (see below).
            y = self.pool.take(length, like.dtype)
            # Without the rotation, when the result lands in a buffer of ours (not in place),
            # nothing is copied but our own shard, into that buffer, where it is summed and
            # sent from in phase 2 (ours: it is not reused while a lane still reads it). The
            # others' shards go out from the caller's array as it is, lent to links that lend
            # (lanes: see Links.release). In place, over links that lend, the same, and the
            # reduced slices land over the lent shards in whole elements (see Links.post): a
            # cut one keeps our own values after what landed, for its stand-in (_finish).
            # Our reduced shard is still summed in and sent from a copy: lent, the caller's
            # array would have to be released at the end of the step, which waits for a
            # send in progress, and phase 2 to the slowest peer is often still going when we
            # have everything (docs/transpose.md has what that cost). Over the comm's links,
            # or with the rotation, the vector is copied whole.
            apart = rot is None and not np.may_share_memory(mine, out)
            lends = all(links.lends(k) for k in peers)
            over = (rot is None and not apart and lends
                    and self.opts.inject_loss <= 0)  # (experiments drop arrived slices)
            # Where our shard is summed: in the result when it is apart, and in place (over)
            # in the caller's array itself, where our own values already are; phase 2 then
            # sends from a copy in `y` (copy_out), made as each reduced slice is complete:
            # one pass over our shard instead of two (into `y`, and back into `out`).
            acc = out if (apart or over) and hi <= like.size else y
            copy_out = y if over and acc is out else None
            send_from = mine if (apart or over) and lends else None
            lent = send_from is not None
            meta: dict[str, Any] = {"c": [clock.advert() for clock in self.clocks],
                                    "d": me in self.drifted, "r": rot is not None,
                                    "l": self._lossy_block}
            rotating = 0.0
            # Shard by shard, each sent to its owner as soon as it is ready (ours last, it
            # is needed only once the others' copies are in), the event loop turning between
            # shards: the links start working after 1/N of the rotation, not all of it.
            # (Not without the rotation over lanes: their threads send at once, and a turn
            # of the loop costs a resumption of every coroutine above this one.)
            turn = rot is not None or not isinstance(links, SplitLinks)
            for i in range(1, n + 1):
                k = (me + i) % n
                a, b = layout.shards[k]
                if rot is not None:
                    t = time.perf_counter()
                    rot.forward_part(k, mine, y)
                    rotating += time.perf_counter() - t
                elif k == me:
                    if copy_out is None:  # (summed in place: our values are there already)
                        _copy_part(mine, acc, a, b)
                elif send_from is None:
                    _copy_part(mine, y, a, b)
                if k != me:
                    self._send_shard(step, layout, y, k, meta, send_from)
                    if turn:
                        await asyncio.sleep(0)
            # Reduced slices may land in the caller's vector: posted only now that it is read.
            phase2 = [s for k in range(n) if k != me
                      for s in self._post(step, layout, k, [k], PHASE2_TAG,
                                          lambda _src, a, b: tail.view(out, a, b),
                                          whole=over)]
            d1, d2 = (clock.deadline() for clock in self.clocks)
            # The clocks learn stage times without the rotation; a step in which this rank
            # rotates, or after one in which a peer did, gets that time on top (the peers'
            # slices come that much later; the owner rotates 1/N back before phase 2).
            if rot is not None:
                self._rot_cost = (rotating if not self._rot_cost
                                  else 0.8 * self._rot_cost + 0.2 * rotating)
            extra = self._rot_cost if rot is not None or self._heard_rotating[0] else 0.0
            if d1 is not None and d2 is not None and extra:
                d1, d2 = d1 + extra, d2 + extra / n
            if step == self._changed_at and d1 is not None and d2 is not None:
                # This rank starts or stops rotating: the ranks that change with it send at
                # another time than the clocks know (the first rotation's cost is measured
                # only now, and differs from rank to rank), so this one step's bound is
                # TRANSITION times longer (still a bound: a stopped rank is cut).
                d1, d2 = d1 * TRANSITION, d2 * TRANSITION
            # The step's bound: both stages', each with the grace it may take past its
            # deadline while every sender it lacks is still delivering.
            grace = opts.flowing_grace
            self.last_deadline = ((d1 + d2) * (1 + grace) if d1 is not None and d2 is not None
                                  else 0.0)
            stage1 = Stage(phase1, (n - 1) * (hi - lo),
                           on_arrival=self._adder(step, acc, scratch, layout, rot is not None,
                                                  sent_early, copy_out))
            await stage1.run(d1, self._idle(0), self._need(), opts.max_wait, since=ready,
                             grace=grace, heard=links.heard_at)
            if stage1.reason != "complete":
                log.info("rank %d step %d: stage 1 ended (%s) after %.1f ms of %.1f ms with "
                         "%.1f%% of its data", me, step, stage1.reason, stage1.elapsed * 1e3,
                         (d1 or 0) * 1e3, stage1.fraction * 100)
            links.discard_before(step, PHASE2_TAG)
            if stage1.reason == "deadline":
                # A sender cut while it had sent nothing may be steps behind (a pause, a
                # spike longer than several of our steps): over lanes it would not learn how
                # far until it read its way to our step, cut all along (see Links.tell).
                for src in stage1.silent(links.heard_at):
                    links.tell(src, step)
            self._drop_injected(step, 1, phase1)
            shard_fraction, missing = self._reduce(acc, scratch, layout, phase1, shape,
                                                   rot is not None)
            if rot is not None:  # the layout's shards are the rotation's parts
                rot.inverse_part(me, y[lo:hi])
            self._send_phase2(step, layout, acc, shard_fraction, missing, skip=sent_early,
                              copy_out=copy_out)
            end = min(hi, like.size)
            if lo < end and acc is not out:
                out[lo:end] = y[lo:end]
            # An owner that sent us nothing in stage 1 was not running then (a pause, a GC,
            # a preempted VM): its reduced shard comes only after it wakes, so stage 2 closes
            # early without it instead of waiting out its bound (the stand-in covers it, as
            # at a deadline). The README's tail row, 3 runs each: P99/P50 1.17-1.19 with
            # 0.89-0.90 % lost, against 1.27-1.34 with 0.77-0.82 % when stage 2 waited.
            stage2 = Stage(phase2, length - (hi - lo), optional=stage1.silent(links.heard_at))
            # Stage 2 ends both bounds after stage 1 began, not one bound after it ended
            # here: an owner whose stage 1 ran to its deadline sends only then.
            left = None if d1 is None or d2 is None else max(d2, d1 + d2 - stage1.elapsed)
            await stage2.run(left, self._idle(1), self._need(), opts.max_wait, grace=grace,
                             heard=links.heard_at)
            if stage2.reason != "complete":
                log.info("rank %d step %d: stage 2 ended (%s) after %.1f ms of %.1f ms with "
                         "%.1f%% of its data", me, step, stage2.reason, stage2.elapsed * 1e3,
                         (left or 0) * 1e3, stage2.fraction * 100)
            self._drop_injected(step, 2, phase2)
        finally:
            for slot in phase1 + phase2:
                slot.future.cancel()
            # Whatever ended the step, no receive of it writes into our buffers any more
            # (the caller's vector among them) once it is over.
            links.discard_before(step + 1)
            if lent:  # (before the caller changes its array)
                links.release(peers)
            links.end_step(step)
        for clock, stage, shift in ((self.clocks[0], stage1, extra),
                                    (self.clocks[1], stage2, extra / n)):
            _observe_stage(clock, stage, shift, links.heard_at)
        tail.land(out, phase2, layout)
        own_part = _OwnContribution(mine, y if send_from is None else mine, rot, layout, out)
        return self._finish(step, like, own_part, out, into is not None, layout, phase2,
                            shard_fraction, missing, time.perf_counter() - t0, over)

    # -- the two phases -----------------------------------------------------------------------
    def _post(self, step: int, layout: Layout, owner: int, srcs: list[int], tag0: int,
              where: Callable[[int, int, int], np.ndarray], whole: bool = False) -> list[Slot]:
        """Post the receives of ``owner``'s shard slices from each of ``srcs``; slice
        ``[a, b)`` from ``src`` lands in ``where(src, a, b)`` (``whole``: in whole
        elements, see Links.post)."""
        slices = layout.slices_of(owner)
        tail = layout.tail_index(owner)
        slots = []
        for src in srcs:
            if self.links.is_lost(src):
                continue
            for i, (a, b) in enumerate(slices):
                fut = self.links.post(src, where(src, a, b), step, tag0 + i, whole=whole)
                slots.append(Slot(src, i, b - a, fut, tail=i >= tail))
        return slots

    def _send_shard(self, step: int, layout: Layout, y: np.ndarray, owner: int,
                    meta: dict[str, Any], lend: np.ndarray | None = None) -> None:
        """Our copy of ``owner``'s shard to its owner, slice by slice (phase 1): from ``y``,
        or lent from ``lend`` (the caller's vector; a slice reaching into the rotation's
        padding is copied into ``y`` first)."""
        if not self.links.is_lost(owner):
            for i, (a, b) in enumerate(layout.slices_of(owner)):
                if lend is not None and b <= lend.size:
                    self.links.send(owner, lend[a:b], step, i, meta, lent=True)
                    continue
                if lend is not None:
                    _copy_part(lend, y, a, b)
                self.links.send(owner, y[a:b], step, i, meta)

    def _rotates(self, step: int) -> bool:
        """Whether this rank rotates its vector at ``step``: always, never, or (by default)
        in a block of ``rotate_steps`` steps after one in which it saw or heard of a loss. A
        calm step loses nothing, so the rotation buys it nothing and would cost a pass over
        the whole vector. Blocks, decided at their first step, and losses told to every
        peer in the phase-1 meta, so that the ranks start and stop rotating together (a
        rank that rotates sends later than one that does not)."""
        hadamard = self.opts.hadamard
        if hadamard != "after_loss":
            return bool(hadamard)
        block = step // max(1, self.opts.rotate_steps)
        if self._block[0] != block:
            rotates = self._lossy_block >= block - 1 and block > 0
            # The first step after a change gets a longer bound (see _run).
            self._changed_at = step if rotates != self._block[1] else -1
            self._block = (block, rotates)
        return self._block[1]

    def _adder(self, step: int, y: np.ndarray, scratch: np.ndarray, layout: Layout,
               rotating: bool, sent_early: set[int], copy_out: np.ndarray | None = None
               ) -> Callable[[Slot], None] | None:
        """What stage 1 calls with each slice of our shard as it arrives: added to our copy
        at once, so the sum is done when the stage ends (the adds overlap the wait). Not a
        slice of a sender in the other rotation state (its row is converted whole, in
        :meth:`_reduce`), nor when slices are dropped after arrival for experiments.

        Without the rotation a reduced slice needs nothing else of the shard: once every
        peer's copy of slice ``i`` is in, it goes to every rank at once (phase 2 of that
        slice overlaps the rest of stage 1), with the fraction 1 and nobody missing; its
        index goes into ``sent_early`` (sent from ``copy_out`` when ``y`` is the caller's
        array, see :meth:`_send_phase2`). The stage calls this only while it is open, so
        nothing is sent from here once :meth:`_send_phase2` has begun."""
        if self.opts.inject_loss > 0:
            return None
        me, n = self.comm.rank, self.comm.world_size
        lo, _hi = layout.shards[me]
        slices = layout.slices_of(me)
        counts = [0] * len(slices)

        def add(slot: Slot) -> None:
            header = slot.header
            if header is not None and bool(header.meta.get("r")) == rotating:
                a, b = slices[slot.index]
                y[a:b] += scratch[slot.src, a - lo:b - lo]
                slot.added = True
                counts[slot.index] += 1
                if counts[slot.index] == n - 1 and not rotating:
                    sent_early.add(slot.index)
                    self._send_slice(step, slot.index, _sendable(y, copy_out, a, b),
                                     {"f": 1.0, "m": []})

        return add

    def _reduce(self, y: np.ndarray, scratch: np.ndarray, layout: Layout, phase1: list[Slot],
                shape: Rotation | None, rotating: bool) -> tuple[float, list[int]]:
        """Our shard, in ``y``: own copy plus every slice that arrived. Returns the shard's
        received fraction (of all N contributions) and the ranks missing from it.

        A sender that rotated when we did not, or the other way round (ranks start and stop
        rotating on the losses each saw), has its copy brought to our state first: its
        missing slices zeroed, then its whole row rotated or rotated back (1/N of the
        vector, only in such a step)."""
        n, me = self.comm.world_size, self.comm.rank
        lo, _hi = layout.shards[me]
        slices = layout.slices_of(me)
        counts = np.ones(len(slices))
        got: dict[int, int] = {}
        arrived: dict[int, list[Slot]] = {}
        for slot in phase1:
            if slot.arrived:
                arrived.setdefault(slot.src, []).append(slot)
        for src, slots in arrived.items():
            header = slots[0].header
            if header is not None:
                self._learn(src, header.meta)  # the same on all its slices
            theirs = bool(header.meta.get("r")) if header is not None else rotating
            row = scratch[src]
            if shape is not None and theirs != rotating:
                have = {slot.index for slot in slots}
                for index, (a, b) in enumerate(slices):
                    if index not in have:
                        row[a - lo:b - lo] = 0
                if rotating:
                    shape.forward_part_inplace(me, row)
                else:
                    shape.inverse_part(me, row)
                y[lo:lo + row.size] += row
            else:
                for slot in slots:
                    if not slot.added:  # (most were, as they came: see _adder)
                        a, b = slices[slot.index]
                        y[a:b] += row[a - lo:b - lo]
            for slot in slots:
                counts[slot.index] += 1
            got[src] = len(slots)
        if self.opts.missing == "rescale" and y.dtype.kind == "f":
            for i in np.flatnonzero(counts < n):
                a, b = slices[i]
                y[a:b] *= n / counts[i]
        sizes = np.array([b - a for a, b in slices], float)
        fraction = float(sizes @ counts / (n * sizes.sum())) if slices else 1.0
        missing = [j for j in range(n) if j != me and got.get(j, 0) < len(slices)]
        return fraction, missing

    def _learn(self, src: int, meta: dict[str, Any]) -> None:
        """What a peer's phase-1 frames carry: its deadline proposals and whether it used a
        stand-in since the last re-sync."""
        adverts = meta.get("c")
        if isinstance(adverts, list) and len(adverts) == 2:
            for clock, advert in zip(self.clocks, adverts, strict=True):
                if isinstance(advert, dict):
                    clock.heard(src, advert.get("tc"), advert.get("tb"))
        if meta.get("d") is True:
            self.drifted.add(src)
        if meta.get("r") is True:
            self._heard_rotating = (self._heard_rotating[0], True)
        lossy = meta.get("l")
        # (At most this step's block: a peer cannot make us rotate blocks ahead.)
        if isinstance(lossy, int) and lossy <= self._at // max(1, self.opts.rotate_steps):
            self._lossy_block = max(self._lossy_block, lossy)

    def _send_phase2(self, step: int, layout: Layout, out: np.ndarray, fraction: float,
                     missing: list[int], skip: set[int], copy_out: np.ndarray | None = None
                     ) -> None:
        """Our reduced shard to every rank, interleaved, with what it lacks (but the slices
        in ``skip``: sent already); from ``copy_out`` when ``out`` is the caller's array,
        which goes back to the caller while a send to a slow peer may still read."""
        meta = {"f": fraction, "m": missing}
        for i, (a, b) in enumerate(layout.slices_of(self.comm.rank)):
            if i not in skip:
                self._send_slice(step, i, _sendable(out, copy_out, a, b), meta)

    def _send_slice(self, step: int, index: int, values: np.ndarray,
                    meta: dict[str, Any]) -> None:
        """Reduced slice ``index`` of our shard to every rank (phase 2)."""
        me = self.comm.rank
        for k in range(self.comm.world_size):
            if k != me:  # (to a lost rank: nothing is sent)
                self.links.send(k, values, step, PHASE2_TAG + index, meta)

    # -- accounting -------------------------------------------------------------------------
    def _finish(self, step: int, like: np.ndarray, own: _OwnContribution, out: np.ndarray,
                in_place: bool, layout: Layout, phase2: list[Slot], own_fraction: float,
                own_missing: list[int], seconds: float, over: bool = False) -> Result:
        n, me, opts = self.comm.world_size, self.comm.rank, self.opts
        fractions = {me: own_fraction}
        late = set(own_missing)
        stand_in: set[int] = set()
        weight = n if opts.missing == "rescale" and out.dtype.kind == "f" else 1
        got: dict[int, float] = {}  # owner -> contributions received, weighted by size
        for slot in phase2:
            a, b = layout.slices_of(slot.src)[slot.index]
            meta = slot.header.meta if slot.arrived and slot.header is not None else None
            f = meta.get("f") if meta is not None else None
            if meta is not None and isinstance(f, float) and 0 <= f <= 1:
                got[slot.src] = got.get(slot.src, 0.0) + f * (b - a)
                ranks = meta.get("m")
                if isinstance(ranks, list):
                    late.update(r for r in ranks if isinstance(r, int) and 0 <= r < n)
            else:  # the stand-in: our own contribution (x N when rescaling)
                start = a
                if over and b <= out.size:  # what landed is the owner's sum: kept
                    start += (self.links.landed(slot.src, step, PHASE2_TAG + slot.index)
                              // out.itemsize)
                _stand_in(out, own, slot.src, start, b, weight)
                got[slot.src] = got.get(slot.src, 0.0) + (b - a) / n
                stand_in.add(slot.src)
        for k in range(n):
            if k != me:
                lo, hi = layout.shards[k]
                fractions[k] = got.get(k, 0.0) / (hi - lo) if hi > lo else 1.0
                if hi > lo and k not in got:  # nothing posted: the owner's link is lost
                    _stand_in(out, own, k, lo, hi, weight)
                    fractions[k] = 1 / n
                    stand_in.add(k)
        late.update(stand_in)
        sizes = {k: hi - lo for k, (lo, hi) in enumerate(layout.shards)}
        total = sum(sizes.values())
        received = sum(fractions[k] * sizes[k] for k in sizes) / total if total else 1.0
        worst = min((fractions[k] for k in sizes if sizes[k]), default=1.0)
        if stand_in:
            self.drifted.add(me)
        lost = 1.0 - received
        if late or stand_in or lost > 0:  # rotate in the next block: see _rotates
            self._lossy_block = max(self._lossy_block, step // max(1, opts.rotate_steps))
        if lost > opts.max_loss + 1e-12:
            # The missing ranks whose links broke are named dead: this step may end on a
            # lane's EOF before the transport's connection to the rank has been read as
            # broken (a busy host), and healing waits only for ranks known dead; one that
            # took the death for a straggler would leave its peers waiting for it to agree.
            raise StragglerError(step, sorted(late), f"{lost:.1%} of the contributions missing "
                                 f"on rank {me}, more than max_loss {opts.max_loss:.1%}",
                                 received, lost=[k for k in late if self.links.is_lost(k)])
        value = out.reshape(like.shape)
        if not in_place:
            value.setflags(write=False)
        resync = opts.resync_every > 0 and step % opts.resync_every == opts.resync_every - 1
        result = Result(value, step, [r for r in range(n) if r not in late], sorted(late),
                        received >= 1.0 and not late, 0.0, seconds, received, worst,
                        sorted(stand_in), sorted(self.drifted), self.last_deadline, resync)
        if resync:
            self.drifted.clear()
        return result

    def _drop_injected(self, step: int, phase: int, slots: list[Slot]) -> None:
        """Experiments: lose a seeded fraction of the slices that arrived (not in warm-up)."""
        p = self.opts.inject_loss
        if p <= 0 or self.clocks[0].reliable:
            return
        rng = np.random.default_rng([self.opts.seed, step, phase, self.comm.rank])
        for slot, u in zip(slots, rng.random(len(slots)), strict=True):
            if slot.arrived and u < p:
                slot.arrived = False

    def _idle(self, stage: int) -> float:
        """Quiet time after which a stage with every tail in closes early."""
        clock = self.clocks[stage]
        if clock.reliable or clock.estimate is None:
            return self.opts.max_wait
        return self.opts.idle_fraction * clock.estimate

    def _need(self) -> float:
        return 1.0 - self.opts.max_loss if self.opts.on_excess_loss == "wait" else 0.0


@functools.lru_cache(maxsize=8)
def _layout(length: int, world: int, slice_elems: int) -> Layout:
    """The layout of a step (the same, its shards and slices computed once, every step of
    a run)."""
    return Layout(length, world, slice_elems)


def _observe_stage(clock: StageClock, stage: Stage, shift: float,
                   heard: Callable[[int], float]) -> None:
    """Tell ``clock`` how long ``stage`` took, less ``shift`` (the rotation's time): where a
    sender had sent nothing when it was cut, or when the others were in, also the time the
    others needed (a straggler's lateness is not the network's; :meth:`StageClock.observe`)."""
    late = stage.late_start()
    if late is not None:  # complete, one or more senders late to start
        clock.observe(max(0.0, stage.elapsed - shift), 1.0, max(0.0, late[1] - shift),
                      late[0])
        return
    silent = stage.silent(heard) if stage.fraction < 1.0 else frozenset()
    others = stage.others_took(silent) if silent else None
    if silent and others is None:
        return  # nobody sent anything: nothing to learn about the network
    clock.observe(max(0.0, stage.elapsed - shift), stage.fraction,
                  None if others is None else max(0.0, others - shift), silent)


def _sendable(summed: np.ndarray, copy_out: np.ndarray | None, a: int, b: int) -> np.ndarray:
    """``summed[a:b]`` to send: itself, or copied into ``copy_out`` first (``summed`` is the
    caller's array, which it may change once the step returns)."""
    if copy_out is None:
        return summed[a:b]
    copy_out[a:b] = summed[a:b]
    return copy_out[a:b]


def _copy_part(mine: np.ndarray, y: np.ndarray, a: int, b: int) -> None:
    """``y[a:b] = mine[a:b]``, zeros past the end of ``mine`` (the rotation's padding)."""
    end = min(b, mine.size)
    if a < end:
        y[a:end] = mine[a:end]
    y[max(a, end):b] = 0


def _stand_in(out: np.ndarray, own: _OwnContribution, owner: int, a: int, b: int,
              weight: int) -> None:
    """``out[a:b]`` (of ``owner``'s shard) = this rank's own contribution times ``weight``
    (nothing past the end of the vector: the rotation's padding)."""
    end = min(b, out.size)
    if a < end:
        np.multiply(own.values(owner, a, end), weight, out=out[a:end])


class _Tail:
    """Where reduced slices that reach past the vector (into the rotation's padding) land:
    a small buffer of ours, copied into the result once the step is over."""

    def __init__(self, layout: Layout, size: int, pool: BufferPool, dtype: np.dtype) -> None:
        self.size = size
        starts = [a for k in range(layout.world) for a, b in layout.slices_of(k) if b > size]
        self.start = min(starts, default=layout.length)
        self.buf = pool.take(layout.length - self.start, dtype) if starts else None

    def view(self, out: np.ndarray, a: int, b: int) -> np.ndarray:
        if b <= self.size or self.buf is None:
            return out[a:b]
        return self.buf[a - self.start:b - self.start]

    def land(self, out: np.ndarray, slots: list[Slot], layout: Layout) -> None:
        """Copy the part inside the vector of every tail slice that arrived."""
        if self.buf is None:
            return
        for slot in slots:
            a, b = layout.slices_of(slot.src)[slot.index]
            if slot.arrived and b > self.size and a < self.size:
                out[a:self.size] = self.buf[a - self.start:self.size - self.start]


class _OwnContribution:
    """This rank's own (not rotated) values of another owner's shard: the stand-in for a
    reduced slice that did not come. Read from the caller's vector while it is intact (in
    place without the rotation, after what landed of the reduced slice: see _run); once
    the result was written over it (``step_to`` into the vector itself), from what this rank
    sent (rotated back one shard at a time, only when a stand-in is needed)."""

    def __init__(self, mine: np.ndarray, y: np.ndarray, rot: Rotation | None, layout: Layout,
                 out: np.ndarray) -> None:
        self._intact = mine if rot is not None and not np.may_share_memory(mine, out) else None
        self._y, self._rot, self._layout = y, rot, layout
        self._parts: dict[int, np.ndarray] = {}

    def values(self, owner: int, a: int, b: int) -> np.ndarray:
        """Entries ``[a, b)`` (inside the vector) of ``owner``'s shard."""
        if self._rot is None:  # y is a copy of the vector outside this rank's own shard
            return self._y[a:b]
        if self._intact is not None:
            return self._intact[a:b]
        lo, hi = self._layout.shards[owner]
        part = self._parts.get(owner)
        if part is None:
            part = self._parts[owner] = self._y[lo:hi].copy()
            self._rot.inverse_part(owner, part)
        return part[a - lo:b - lo]
