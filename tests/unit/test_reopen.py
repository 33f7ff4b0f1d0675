"""Lanes opened again with a replacement (``schemes/links/reopen.py``), on the in-memory
network with links that open once both ends ask for them at the same step: the step both ends
switch at, what each side holds back until then (and in what order it goes), and the ways an
opening ends without lanes. The lanes themselves over real processes: ``tests/loopback/
test_heal.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from aioreduce.schemes.base import BulkLink
from aioreduce.schemes.links.reopen import ANSWER_TIMEOUT_S, Reopener
from aioreduce.transport.memory import MemoryNetwork

from . import clockloop
from .clockloop import ClockLoop, advance, until


class Links:
    """Bulk links of a two-rank job: ``open_links`` returns once the other rank asked for
    the same step (a lane is a string naming its ends and step)."""

    def __init__(self) -> None:
        self.asked: dict[tuple[int, int], asyncio.Future[None]] = {}
        self.steps: list[tuple[int, int]] = []  # (rank, step) of every opening

    def of(self, rank: int) -> Any:
        links = self

        class Mine:
            async def open_links(self, send_to: Sequence[int], recv_from: Sequence[int],
                                 step: int, *, partial: bool = False
                                 ) -> tuple[dict[int, Any], dict[int, Any]]:
                (peer,) = send_to
                links.steps.append((rank, step))
                key = (min(rank, peer), step)
                fut = links.asked.setdefault(key, asyncio.get_running_loop().create_future())
                if not fut.done() and {r for r, s in links.steps if s == step} == {rank, peer}:
                    fut.set_result(None)
                await asyncio.shield(fut)  # (a cancelled opening leaves the pair's alone)
                return {peer: f"{rank}->{peer}@{step}"}, {peer: f"{peer}->{rank}@{step}"}

        return Mine()


class Side:
    """One end: a comm, what it touched, whether it has lanes, and what happened."""

    def __init__(self, net: MemoryNetwork, links: Links, rank: int, *, touched: int,
                 has_lanes: bool) -> None:
        self.comm = net.comms[rank]
        self.comm.bulk_links = lambda: links.of(rank)  # type: ignore[method-assign]
        self.touched, self.has_lanes = touched, has_lanes
        self.opened: list[tuple[int, str, str, int]] = []
        self.sent: list[str] = []
        self.reopener = Reopener(self.comm, lambda: self.touched, lambda: self.has_lanes,
                                 self._opened, held_steps=2)
        self.removers = self.reopener.listen([1 - rank])

    def _opened(self, peer: int, out: BulkLink, in_: BulkLink, start: int) -> None:
        self.opened.append((peer, str(out), str(in_), start))

    def send(self, peer: int, step: int, what: str) -> Callable[[], None] | None:
        """A session's send: held while the opening holds ``step``, else done now."""
        def now() -> None:
            self.sent.append(what)

        if self.reopener.holds(peer, step):  # (run later as a session's: asking again)
            self.reopener.hold(peer, step, lambda: self.send(peer, step, what))
            return None
        now()
        return now


def _pair(*, touched: int = 3, has_lanes: bool = True) -> tuple[MemoryNetwork, Links, Side,
                                                                Side]:
    net, links = MemoryNetwork(2), Links()
    peer = Side(net, links, 0, touched=touched, has_lanes=has_lanes)
    new = Side(net, links, 1, touched=-1, has_lanes=False)  # the replacement
    return net, links, peer, new


@pytest.mark.parametrize("touched, start", [(3, 5), (7, 8)])
def test_both_ends_switch_at_the_step_answered_and_hold_that_step_until_the_lanes_open(
        touched: int, start: int) -> None:
    """The replacement asks for step 5; a peer that touched 3 agrees to 5, one that touched
    7 (it forwarded results ahead of its own step) answers 8. Both open the lanes keyed by
    that step; until they are open each holds back its sends of that step or later (sent
    after, in order) and a step that late does not start."""

    async def main() -> None:
        _net, links, peer, new = _pair(touched=touched)
        new.reopener.propose(0, 5)
        assert new.reopener.holds(0, 5) and not new.reopener.holds(0, 4)
        assert new.send(0, 4, "new:4") is not None  # before the step asked: at once
        new.send(0, 6, "new:6a")
        new.send(0, 6, "new:6b")
        ready = asyncio.ensure_future(new.reopener.ready(5))
        await until(lambda: peer.reopener.holds(1, start))
        assert not peer.reopener.holds(1, start - 1)
        peer.send(1, start, "peer:first")
        peer.send(1, start + 1, "peer:second")
        await asyncio.wait_for(ready, 5)
        assert links.steps.count((0, start)) == 1 and links.steps.count((1, start)) == 1
        assert peer.opened == [(1, f"0->1@{start}", f"1->0@{start}", start)]
        assert new.opened == [(0, f"1->0@{start}", f"0->1@{start}", start)]
        assert new.sent == ["new:4", "new:6a", "new:6b"]
        assert peer.sent == ["peer:first", "peer:second"]
        assert not new.reopener.holds(0, 9) and not peer.reopener.holds(1, 9)

    asyncio.run(main())


def test_a_peer_without_lanes_answers_no_and_nothing_is_held() -> None:
    async def main() -> None:
        _net, links, peer, new = _pair(has_lanes=False)
        new.reopener.propose(0, 5)
        new.send(0, 5, "held")
        await asyncio.wait_for(new.reopener.ready(5), 5)
        assert new.sent == ["held"] and links.steps == []
        assert peer.opened == new.opened == []
        assert not peer.reopener.holds(1, 5)

    asyncio.run(main())


def test_a_peer_lost_before_it_answers_releases_what_was_held() -> None:
    async def main() -> None:
        net, links, _peer, new = _pair()
        net.hold(1, 0)  # the proposal never gets there
        new.reopener.propose(0, 5)
        new.send(0, 6, "held")
        ready = asyncio.ensure_future(new.reopener.ready(6))
        await asyncio.sleep(0)
        assert not ready.done()
        new.comm._lost(0)
        await asyncio.wait_for(ready, 5)
        assert new.sent == ["held"] and new.opened == [] and links.steps == []

    asyncio.run(main())


def test_closing_drops_what_was_held_and_removes_every_handler() -> None:
    async def main() -> None:
        net, _links, peer, new = _pair()
        net.hold(1, 0)
        new.reopener.propose(0, 5)
        new.send(0, 6, "held")
        new.reopener.close()
        await asyncio.wait_for(new.reopener.ready(6), 5)
        assert new.sent == []
        for side in (peer, new):
            for remove in side.removers:
                remove()
            assert side.comm.installed() == 0

    asyncio.run(main())


def test_sends_held_for_more_steps_than_the_bound_are_dropped() -> None:
    """A peer's lanes that take long to open hold at most ``held_steps`` steps of sends to
    it (memory stays bounded; a tree asks again for what it missed)."""

    async def main() -> None:
        net, _links, _peer, new = _pair()
        net.hold(1, 0)  # no answer comes: the sends wait
        new.reopener.propose(0, 5)
        for step in (5, 5, 6, 7, 8):
            new.send(0, step, f"s{step}")
        assert new.reopener.opening[0].held_steps == {5, 6}
        new.comm._lost(0)
        await asyncio.wait_for(new.reopener.ready(8), 5)
        assert new.sent == ["s5", "s5", "s6"]

    asyncio.run(main())


def test_a_peer_that_asks_again_has_one_opening_under_way_not_two() -> None:
    """Asked again for the same step, a rank answers the same and keeps its opening; asked
    for another (or a hostile peer's flood), it gives up the first opening (its task
    cancelled) before it starts the next: one opening per peer at a time, however often it
    asks."""

    async def main() -> None:
        net, _links, peer, new = _pair(touched=3)
        net.hold(0, 1)  # the answers wait: the replacement asks again meanwhile
        new.reopener.propose(0, 4)
        await until(lambda: 1 in peer.reopener.opening)
        first = peer.reopener.opening[1].task
        new.reopener.propose(0, 4)  # the same again: the same opening
        for _ in range(20):
            await asyncio.sleep(0)
        assert peer.reopener.opening[1].task is first and first is not None
        assert not first.done()
        new.reopener.propose(0, 5)
        await until(lambda: peer.reopener.opening.get(1) is not None
                     and peer.reopener.opening[1].task is not first)
        await until(lambda: first is not None and first.done())
        assert first is not None and first.cancelled()
        net.release(0, 1)
        await asyncio.wait_for(new.reopener.ready(5), 5)
        await asyncio.wait_for(peer.reopener.ready(5), 5)
        assert peer.opened == [(1, "0->1@5", "1->0@5", 5)]
        assert new.opened == [(0, "1->0@5", "0->1@5", 5)]

    asyncio.run(main())


def test_two_ends_replaced_at_once_open_at_the_lower_ranks_step_and_keep_their_order() -> None:
    """Both ends of a path were replaced: each proposes to the other (crossing). The lower
    rank's proposal stands: the higher answers it and gives its own up, and what its own had
    held goes through the agreed opening, held again from its step, in order. One opening a
    side, at one step."""

    async def main() -> None:
        net, links = MemoryNetwork(2), Links()
        low = Side(net, links, 0, touched=4, has_lanes=True)
        high = Side(net, links, 1, touched=6, has_lanes=True)
        net.hold(1, 0)  # high's proposal and answer wait: low's gets there first
        low.reopener.propose(1, 5)
        high.reopener.propose(0, 7)
        high.send(0, 6, "high:6")  # before its own step: at once
        high.send(0, 7, "high:7a")  # held by its own proposal
        high.send(0, 8, "high:8")
        low.send(1, 7, "low:7")
        await until(lambda: 0 in high.reopener.opening
                     and high.reopener.opening[0].answer is None)  # it answered low's
        for _ in range(20):
            await asyncio.sleep(0)
        # What its own proposal held is held again by the agreed opening (from 7), not sent
        # over the comm while low expects it on the lanes.
        assert high.sent == ["high:6"] and high.reopener.opening[0].held_steps == {7, 8}
        net.release(1, 0)
        await asyncio.wait_for(asyncio.gather(low.reopener.ready(99),
                                              high.reopener.ready(99)), 5)
        # high answered low's 5 with the first step it had not touched: 7
        assert low.opened == [(1, "0->1@7", "1->0@7", 7)]
        assert high.opened == [(0, "1->0@7", "0->1@7", 7)]
        assert sorted(links.steps) == [(0, 7), (1, 7)]
        assert high.sent == ["high:6", "high:7a", "high:8"] and low.sent == ["low:7"]
        assert not low.reopener.opening and not high.reopener.opening

    asyncio.run(main())


def test_a_replacement_that_does_not_know_yet_whether_it_has_lanes_answers_once_it_does(
        ) -> None:
    """A replacement asked before its first step (which tells whether its session uses
    lanes) answers at :meth:`Reopener.decided`: then the lanes open, at the step asked."""

    async def main() -> None:
        net, links = MemoryNetwork(2), Links()
        asker = Side(net, links, 0, touched=4, has_lanes=True)
        unsure = Side(net, links, 1, touched=-1, has_lanes=None)  # type: ignore[arg-type]
        asker.reopener.propose(1, 5)
        asker.send(1, 5, "held")
        await until(lambda: 0 in unsure.reopener._deferred)
        for _ in range(20):  # no answer while it does not know
            await asyncio.sleep(0)
        assert asker.sent == [] and links.steps == []
        unsure.has_lanes = True
        unsure.reopener.decided()
        await asyncio.wait_for(asker.reopener.ready(5), 5)
        assert asker.opened == [(1, "0->1@5", "1->0@5", 5)] and asker.sent == ["held"]
        assert unsure.opened == [(0, "1->0@5", "0->1@5", 5)]

    asyncio.run(main())


def test_an_asker_that_gives_up_waiting_withdraws_and_the_late_answerer_drops_its_opening(
        ) -> None:
    """The answer is held past the asker's timeout (fake clock): the asker gives up (its
    held sends go over the comm) and withdraws its ask; the peer, which had answered and was
    opening lanes and holding its steps with the asker, drops that opening at once instead
    of holding them until it times out."""

    async def main(loop: ClockLoop) -> None:
        net, links, peer, new = _pair(touched=3)
        net.hold(0, 1)  # the answer never gets there in time
        new.reopener.propose(0, 5)
        new.send(0, 5, "new:5")
        await until(lambda: 1 in peer.reopener.opening)
        peer.send(1, 5, "peer:5")  # held: its lanes with the replacement are opening
        assert peer.sent == [] and peer.reopener.holds(1, 5)
        await advance(loop, ANSWER_TIMEOUT_S + 1)
        await until(lambda: new.sent == ["new:5"])  # gave up: over the comm
        await until(lambda: 1 not in peer.reopener.opening)
        assert peer.sent == ["peer:5"] and not peer.reopener.holds(1, 5)
        await asyncio.wait_for(peer.reopener.ready(5), 5)
        assert peer.opened == new.opened == [] and links.steps == [(0, 5)]

    clockloop.run(main)
