"""A reduce-broadcast session: the state one rank keeps across the steps of a tree or star.

Per step (``step`` tags every frame, so nothing mixes across steps):

1. post the receives for every chunk from every child and the result from the parent,
   *before* this rank's own vector is awaited;
2. up: per chunk, decode from the first sufficient set of children (or what arrived by the
   deadline) and pass it on at once, so levels overlap (:class:`~.paths.UpPath`);
3. down: the root's decoded chunks are the result; every rank forwards result chunks to its
   children as they arrive, in the background, so a slow child never holds up a fast parent;
   a rank takes the result from its parent, or from its grandparent when the failover machine
   says so (:class:`~.paths.DownPath`, :mod:`.failover`). A step returns as soon as its result
   is known, even if this rank's own decode is still under way (it is no longer needed).

Across steps the session keeps: the outcomes of recent steps (a bounded :class:`ResultLog`)
to answer children and grandchildren that ask for them, requests for steps not known yet,
which result chunks it already forwarded, the failover state, and the background sends.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

import numpy as np

from ...errors import PeerLost
from ...wire import Header, tags
from ..base import LANES_FROM, BulkLink, BulkLinks, Comm, Result, StepOptions, spans_hosts
from ..links import LaneLinks, unopened
from ..links.reopen import Reopener
from ..outbox import Outbox
from ..pool import BufferPool
from .failover import Link, ParentFailover
from .family import DOWN, REQUEST_TAG, VERDICT_TAG, Family
from .history import Outcome, ResultLog
from .paths import EMPTY, DownPath, Layout, UpPath
from .report import Report, Verdict

log = logging.getLogger("aioreduce.schemes")

MAX_PENDING_STEPS = 64  # requests for future steps kept at most (an authenticated peer's)
CLAIM_STEPS = 64  # steps whose forwarded chunks are remembered


class ReduceSession:
    """One rank's session of a reduce-broadcast scheme (CodedTree, GradientCoding, Tree, Star)."""

    def __init__(self, comm: Comm, family: Family, opts: StepOptions,
                 encode: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.comm, self.family, self.opts, self.encode = comm, family, opts, encode
        self.outbox = Outbox(comm, opts.backlog_steps, on_drained=self._drained)
        self.log = ResultLog(opts.history_bytes)
        # Receive buffers and results, reused once nothing refers to them (not the caller, a
        # background send, a posted receive or the result log): a step's worth kept spare.
        self.pool = BufferPool(spare=len(family.children) + 3)
        self.failover = (ParentFailover(family.parent, family.grandparent)
                         if family.parent is not None else None)
        self._pending: dict[int, set[int]] = {}  # step -> ranks that asked before it was known
        self._resend: dict[int, int] = {}  # peer -> last step skipped while it did not read
        self._claimed: dict[int, set[int]] = {}  # step -> tags already forwarded
        self._probe: DownPath | None = None
        self._removers: list[Callable[[], None]] = []
        self._known_up_to = -1  # the latest step whose outcome arrived before we asked
        self._decode = (-1, 0.0)  # (step, seconds this rank spent decoding it), for telemetry
        self._chunking = opts.chunking(spans_hosts(comm))
        # The last step's layout: the next one's too while the vector keeps its size and
        # dtype (the family and the chunking are the session's; five calls less a step).
        self._layout: Layout | None = None
        # Lanes (opts.lanes, opened at the first step if the comm has bulk links): the chunks
        # to and from the parent and the children travel on them; verdicts, requests and
        # whatever involves the grandparent or grandchildren stay on the comm. A peer whose
        # connection breaks leaves them; its replacement process (see aioreduce.heal) and we
        # open them again (see .reopen), from a step agreed on (_lanes_from).
        family_peers = [p for p in (family.parent, *family.children) if p is not None]
        self._lane_peers = set(family_peers)
        self._lanes_from: dict[int, int] = {}
        self._want_lanes = opts.lanes is not False and bool(self._lane_peers)
        self.lanes: LaneLinks | None = None
        self._removers.append(comm.on_peer_lost(self._lane_peers.discard))
        self._touched = -1  # the latest step posted or sent for (see .reopen)
        # A replacement's lanes: None until its first step tells (by the vector's size)
        # whether this session uses them; a peer replaced with it that asks meanwhile is
        # answered then (Reopener.decided).
        self._rejoined_lanes: bool | None = False
        self.reopener = Reopener(comm, lambda: self._touched, self._has_lanes,
                                 self._reopened, held_steps=opts.backlog_steps)
        self._removers += self.reopener.listen(family_peers)
        for src in (family.parent, family.grandparent):
            if src is not None:
                self._removers.append(comm.on_early(
                    src, DOWN, functools.partial(self._early_outcome, src)))
        if family.children:
            for peer in family.served():
                self._removers.append(comm.on_early(
                    peer, REQUEST_TAG, functools.partial(self._early_request, peer)))

    # -- one step ---------------------------------------------------------------------------
    async def step(self, step: int, like: np.ndarray, own: Awaitable[np.ndarray]) -> Result:
        t0 = time.perf_counter()
        fam = self.family
        self.discard_before(step)
        if self._want_lanes:
            self._want_lanes = False  # decided at the first step, alike on every rank
            if self.opts.lanes or like.nbytes >= LANES_FROM:
                await self._open_lanes(step)
        elif self._rejoined_lanes is None:  # a replacement's first step
            self._rejoined_lanes = bool(self.opts.lanes or like.nbytes >= LANES_FROM)
            self.reopener.decided()
        if self.reopener.opening:
            await self.reopener.ready(step)  # lanes that open again from this step on
        self._touched = max(self._touched, step)
        lay = self._layout
        if lay is None or lay.length != like.size or lay.dtype != like.dtype:
            lay = self._layout = Layout.of(like, fam, *self._chunking)
        self._end_probe()
        up = UpPath(self, step, lay) if fam.children else None
        down = (DownPath(self, step, lay, self.failover) if self.failover is not None
                else None)
        up_task: asyncio.Task[Outcome | None] | asyncio.Task[None] | None = None
        try:
            mine = await self._own(step, lay, own)
            if down is None:
                assert up is not None
                outcome = await up.run(mine)
                assert outcome is not None
                self.conclude(outcome)
            else:
                if up is not None:
                    # (the loop's create_task: asyncio.ensure_future is three Python calls
                    # more, every step of an interior rank)
                    up_task = asyncio.get_running_loop().create_task(up.run(mine))
                else:
                    up_task = self._send_own(step, lay, mine, down)
                outcome = await down.wait(time.perf_counter() - t0)
                self.conclude(outcome)
            return _result(outcome, like, t0)
        finally:
            if up_task is not None and not up_task.done():
                up_task.cancel()  # the result is known: our own decode is no longer needed
            if up is not None:
                up.close()
            if down is not None:
                down.close()
                if down.probe is not None:
                    self._probe = down
            self.discard_before(step + 1)
            if self.lanes is not None:
                self.lanes.end_step(step)

    async def _open_lanes(self, step: int) -> None:
        """Lanes to and from the parent and every child, at the first step (every rank's comm
        is built the same way, so every rank makes the same choice)."""
        links = self.comm.bulk_links()
        if links is None:
            return  # no mesh under this comm: the event loop's way
        peers = sorted(self._lane_peers)
        # A peer dead before this first step has no lanes: it is lost to them, as a peer that
        # dies later is (the tree goes on without it where its code allows).
        outs, ins = await links.open_links(peers, peers, step, partial=True)
        self._new_lanes(outs, ins, links, unopened(peers, outs, ins, step))

    def _new_lanes(self, outs: Mapping[int, BulkLink], ins: Mapping[int, BulkLink],
                   opened_by: BulkLinks | None, lost: dict[int, PeerLost]) -> None:
        parent = self.family.parent
        self.lanes = LaneLinks(
            self.comm, outs, ins, self.opts.backlog_steps, opened_by=opened_by,
            lost=lost, on_resumed=self._drained,
            # A result from the parent before we asked (we still compute): forward it now.
            early=lambda src, _step, tag: src == parent and DOWN <= tag < VERDICT_TAG,
            on_early=self._early_outcome, stage_bytes=self.opts.history_bytes)

    def _has_lanes(self) -> bool | None:
        """Whether our chunks travel on lanes (what a reopening is answered; see .reopen):
        None while a replacement has not run its first step."""
        return True if self.lanes is not None else self._rejoined_lanes

    def _reopened(self, peer: int, out: BulkLink, in_: BulkLink, start: int) -> None:
        """Lanes with ``peer`` (a replacement, or our peer if we are one) open again: its
        chunks from step ``start`` on travel on them."""
        if self.lanes is None:  # a replacement's first
            self._new_lanes({peer: out}, {peer: in_}, self.comm.bulk_links(), {})
        else:
            self.lanes.add({peer: out}, {peer: in_})
        self._lanes_from[peer] = start
        self._lane_peers.add(peer)

    @property
    def lanes_open(self) -> bool:
        """Whether the chunks travel over lanes (opened by the first step, ``opts.lanes``)."""
        return self.lanes is not None

    @property
    def lane_peers(self) -> list[int]:
        """The peers whose chunks travel over lanes now."""
        return sorted(self._lane_peers) if self.lanes is not None else []

    # -- where a message goes -------------------------------------------------------------------
    def _lanes_for(self, peer: int, step: int, tag: int) -> LaneLinks | None:
        """The lanes a chunk of ``step`` to or from ``peer`` travels on (None: the comm;
        control tags, ranks that are not parent or child, and steps before the lanes with a
        replacement opened again always go through the comm)."""
        if (tag < tags.ABORT and peer in self._lane_peers
                and step >= self._lanes_from.get(peer, 0)):
            return self.lanes
        return None

    def post_data(self, src: int, out: np.ndarray, step: int, tag: int
                  ) -> asyncio.Future[Header]:
        """Receive chunk ``tag`` of ``step`` from ``src`` into ``out`` (over its lane, if any)."""
        lanes = self._lanes_for(src, step, tag) if self.lanes is not None else None
        if lanes is not None:
            return lanes.post(src, out, step, tag)
        return self.comm.post_recv(src, out, step=step, tag=tag)

    def send_data(self, peer: int, array: np.ndarray, step: int, tag: int,
                  meta: dict[str, object] | None) -> None:
        """Send in the background (over ``peer``'s lane, if any; a verdict never is)."""
        if self.reopener.opening and self.reopener.holds(peer, step):  # once lanes are open
            self.reopener.hold(peer, step, functools.partial(self.send_data, peer, array, step,
                                                             tag, meta))
            return
        self._touched = max(self._touched, step)
        lanes = self._lanes_for(peer, step, tag) if self.lanes is not None else None
        if lanes is not None:
            lanes.send(peer, array, step, tag, meta or {})
        else:
            self.outbox.send(peer, array, step=step, tag=tag, meta=meta)

    def discard_before(self, step: int) -> None:
        """Steps below ``step`` are over: their frames are dropped, on lanes too."""
        if self.lanes is not None:
            self.lanes.discard_before(step)  # the comm's too
        else:
            self.comm.discard_before(step)

    def decoded(self, step: int, seconds: float) -> None:
        """Count ``seconds`` of decoding and combining towards ``step``."""
        last, total = self._decode
        self._decode = (step, seconds + (total if last == step else 0.0))

    def decode_seconds(self, step: int) -> float:
        """Seconds this rank spent decoding and combining ``step`` (0 if it did not)."""
        last, total = self._decode
        return total if last == step else 0.0

    async def _own(self, step: int, lay: Layout, own: Awaitable[np.ndarray]) -> np.ndarray:
        mine = (await own).reshape(-1)
        if self.encode is not None:
            mine = self.encode(mine)
        if mine.size != lay.own_len or mine.dtype != lay.dtype:
            raise ValueError(f"rank {self.comm.rank}, step {step}: vector of {mine.size} "
                             f"{mine.dtype} differs from the {lay.own_len} {lay.dtype} this "
                             "step was posted for")
        return mine

    def _send_own(self, step: int, lay: Layout, mine: np.ndarray,
                  down: DownPath) -> asyncio.Task[None] | None:
        """A leaf's message: its own vector, sent without a copy; the chunks past the first
        ``window`` paced (a task, returned), the rest at once."""
        bounds = lay.own_bounds
        window = 2 * self.family.depth
        parent = self.family.parent
        source = down.sources.get(parent) if parent is not None else None
        # Paced by the result: chunk c goes once result chunk c - window is here, window
        # being the chunks a round trip to the root and back holds. Sent at once, a leaf's
        # chunks took its parent's link from the result coming down, which then lagged and
        # ended the step alone where links bind (docs/status.md has the fractions of bound).
        # The result's chunk c - window needs nothing of ours past chunk c - window, so this
        # never waits for itself; a result that fails or is dropped ends the wait. (Not
        # where up and down chunks differ: a star master with m > 1 sends only at the end.
        # Nor where the parent is on this host: no link is shared there, each direction has
        # its own socket, and the waits only stall the leaf.)
        on_host = parent is not None and self.lanes is not None and self.lanes.on_host(parent)
        paced = source is not None and bounds == lay.bounds and not on_host
        first = min(window, len(bounds)) if paced else len(bounds)
        for c in range(first):
            self._send_chunk(step, mine, bounds, c)
        if first == len(bounds):
            return None
        assert source is not None
        return asyncio.ensure_future(self._send_paced(step, mine, bounds, source.chunks,
                                                      window))

    async def _send_paced(self, step: int, mine: np.ndarray,
                          bounds: tuple[tuple[int, int], ...],
                          result: list[asyncio.Future[Header]], window: int) -> None:
        for c in range(window, len(bounds)):
            await asyncio.wait([result[c - window]])
            self._send_chunk(step, mine, bounds, c)

    def _send_chunk(self, step: int, mine: np.ndarray, bounds: tuple[tuple[int, int], ...],
                    c: int) -> None:
        """Chunk ``c`` of a leaf's own vector to the parent (the last one with its report)."""
        lo, hi = bounds[c]
        self.send_up(step, c, mine[lo:hi],
                     Report((self.comm.rank,)).to_meta() if c == len(bounds) - 1 else None)

    def _end_probe(self) -> None:
        """A bypassed parent whose result of the last step arrived after all is back."""
        down, self._probe = self._probe, None
        if down is None or down.probe is None:
            return
        if down.probe.complete() and self.failover is not None:
            self.failover.answered(down.probe.rank, down.step)
        down.probe.cancel()

    # -- sending ----------------------------------------------------------------------------
    def send_up(self, step: int, tag: int, chunk: np.ndarray,
                meta: dict[str, object] | None) -> None:
        parent = self.family.parent
        assert parent is not None and self.failover is not None
        # (A leaf sends before its step waits for the result: the send itself must see a
        # parent that came back.)
        if self.failover.state is Link.LOST and not self.parent_back():
            return  # nobody there to decode it
        self.send_data(parent, chunk, step, tag, meta)

    def parent_back(self) -> bool:
        """Whether the parent is connected; one whose connection came back (a replacement)
        takes the failover out of LOST, so it is sent to and asked again."""
        assert self.family.parent is not None and self.failover is not None
        if self.comm.is_lost(self.family.parent):
            return False
        self.failover.parent_back()
        return True

    def rejoined(self, step: int) -> None:
        """A replacement process starting at ``step`` (see :class:`~aioreduce.schemes.base.
        Rejoins`): the parent sent the dead one what we need; ask it again. The peers'
        lanes to the dead process are gone: everything goes over the comm until each peer
        and we open them again (see links/reopen.py)."""
        if self.family.parent is not None:
            self.request(self.family.parent, step)
        # Our peers' lanes went with the dead process: none at the first step, but ask each
        # peer to open them again (it has lanes, or answers no), from the next step on.
        # (No peer is a lane peer until its lanes are open: the chunks go over the comm.)
        peers = sorted(self._lane_peers)
        self._lane_peers.clear()
        if self._want_lanes and self.comm.bulk_links() is not None:
            self._rejoined_lanes = None  # (known at our first step: see _has_lanes)
            for peer in peers:
                if not self.comm.is_lost(peer):
                    self.reopener.propose(peer, step + 1)
        self._want_lanes = False

    def request(self, rank: int, step: int) -> None:
        """Ask ``rank`` for the outcomes from ``step`` on."""
        log.info("rank %d: asking rank %d for the outcomes from step %d on (parent %s)",
                 self.comm.rank, rank, step,
                 self.failover.state.value if self.failover is not None else "-")
        self.outbox.send(rank, EMPTY, step=step, tag=REQUEST_TAG)

    def forward(self, step: int, tag: int, chunk: np.ndarray,
                meta: dict[str, object] | None) -> None:
        """Pass a result chunk or verdict to our children, once per (step, tag); the children
        of a child whose connection broke get it from us directly."""
        claimed = self._claimed.setdefault(step, set())
        if tag in claimed:
            return
        claimed.add(tag)
        if len(self._claimed) > CLAIM_STEPS:
            del self._claimed[min(self._claimed)]
        for child in self.family.children:
            targets = (self.family.grandchildren.get(child, []) if self.comm.is_lost(child)
                       else [child])
            for target in targets:
                self.send_data(target, chunk, step, tag, meta)

    def chunk_arrived(self, step: int, c: int, chunk: np.ndarray,
                      fut: asyncio.Future[Header]) -> None:
        """A result chunk landed in a source's buffer: forward it."""
        if self.family.children and not fut.cancelled() and fut.exception() is None:
            self.forward(step, DOWN + c, chunk, fut.result().meta or None)

    def conclude(self, outcome: Outcome, *, forward: bool = False) -> None:
        """A step's outcome is known: keep it and answer whoever asked for it."""
        if not self.family.children:
            return
        if forward and outcome.verdict is not None:
            self.forward(outcome.step, VERDICT_TAG, EMPTY, outcome.verdict.to_meta())
        self.log.add(outcome)
        for peer in sorted(self._pending.pop(outcome.step, ())):
            self._send_outcome(peer, outcome)
        for peer, last in list(self._resend.items()):
            if outcome.step <= last:
                self._send_outcome(peer, outcome)
            if outcome.step >= last:
                del self._resend[peer]

    # -- serving requests ----------------------------------------------------------------------
    def _early_request(self, peer: int, header: Header, _payload: memoryview) -> None:
        if header.tag == REQUEST_TAG:
            self.serve(peer, header.step)

    def serve(self, peer: int, step: int) -> None:
        """Send ``peer`` the outcomes from ``step`` on: what is kept now, the rest when known;
        a step older than the window gets FellBehind's verdict at once."""
        if self.log.too_old(step):
            behind = Verdict(behind=self.log.latest + 1)
            self.outbox.send(peer, EMPTY, step=step, tag=VERDICT_TAG, meta=behind.to_meta())
            return
        kept = self.log.since(step)
        for outcome in kept:
            self._send_outcome(peer, outcome)
        if not kept or kept[0].step != step:
            self._pending.setdefault(step, set()).add(peer)
            while len(self._pending) > MAX_PENDING_STEPS:
                del self._pending[min(self._pending)]

    def _drained(self, peer: int, first: int, last: int) -> None:
        """Sends to ``peer`` of steps ``first``..``last`` were skipped while it did not read
        (some before we knew the outcome ourselves: forwarded early): a rank we serve gets
        those outcomes now, or as we learn them, instead of waiting out a deadline."""
        if peer in self.family.served():
            self.serve(peer, first)
            if last > self.log.latest:
                self._resend[peer] = max(last, self._resend.get(peer, last))

    def _send_outcome(self, peer: int, outcome: Outcome) -> None:
        if outcome.value is None:
            verdict = outcome.verdict or Verdict()
            self.outbox.send(peer, EMPTY, step=outcome.step, tag=VERDICT_TAG,
                             meta=verdict.to_meta())
            return
        meta = outcome.report.to_meta() if outcome.report is not None else {}
        last = len(outcome.bounds) - 1
        for c, (lo, hi) in enumerate(outcome.bounds):
            self.send_data(peer, outcome.value[lo:hi], outcome.step, DOWN + c,
                           meta if c == last else None)

    def known(self, step: int) -> bool:
        return step <= self._known_up_to

    def _early_outcome(self, src: int, header: Header, payload: memoryview) -> None:
        """A result chunk or verdict from our parent or grandparent arrived before we posted
        for it (we are busy with an earlier step): pass it on to our children now."""
        if DOWN <= header.tag < VERDICT_TAG:
            if header.meta:  # the last chunk carries the report: the whole result is here
                self._known_up_to = max(self._known_up_to, header.step)
            if self.family.children:
                data = np.frombuffer(payload, dtype=header.dtype or np.uint8)
                self.forward(header.step, header.tag, data, header.meta or None)
        elif header.tag == VERDICT_TAG:
            verdict = Verdict.from_meta(header.meta)
            if verdict.behind is None:  # FellBehind is an answer to us alone
                self._known_up_to = max(self._known_up_to, header.step)
                if self.family.children:
                    self.forward(header.step, VERDICT_TAG, EMPTY, verdict.to_meta())

    # -- lifetime -----------------------------------------------------------------------------
    async def close(self, timeout: float) -> None:
        for remove in self._removers:
            remove()
        self._removers.clear()
        if self._probe is not None and self._probe.probe is not None:
            self._probe.probe.cancel()
        self.reopener.close()
        await self.outbox.close(timeout)
        if self.lanes is not None:
            await self.lanes.close(timeout)


def _result(outcome: Outcome, like: np.ndarray, t0: float) -> Result:
    assert outcome.value is not None and outcome.report is not None
    value = outcome.value.reshape(like.shape)
    try:  # noqa: SIM105 (contextlib.suppress: three calls more, every step)
        value.setflags(write=False)  # it may still be on its way to slower ranks
    except ValueError:
        pass
    rep = outcome.report
    return Result(value, outcome.step, list(rep.used), list(rep.late), rep.exact,
                  rep.error_bound, time.perf_counter() - t0)


__all__ = ["ReduceSession"]
