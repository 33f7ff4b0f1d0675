"""The deadline every scheme waits with: it judges peers only after reading what they sent.

uvloop runs due timers before it polls the sockets, so a process that was kept off the CPU
past a deadline would expire it with the peers' data already in its socket buffer (seen as
transpose stages cut at "66.7 % of the data" with 4 ranks on 2 cores, the timer 25 ms late).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
import uvloop

from aioreduce.schemes.deadline import LATE, Deadline

T = TypeVar("T")

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def _run(loop_name: str, main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``main()`` run on a fresh event loop of kind ``loop_name``; what it returns."""
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        return runner.run(main())


class _Recorder(asyncio.Protocol):
    def __init__(self, name: str, order: list[str], on_data: Callable[[], None]) -> None:
        self.name, self.order, self.on_data = name, order, on_data

    def data_received(self, data: bytes) -> None:
        self.order.append(self.name)
        self.on_data()


async def _starved_past_the_deadline(block: float, seconds: float = 0.005
                                     ) -> tuple[list[str], Deadline]:
    """A deadline of ``seconds`` that falls due while the loop is busy for ``block`` reading
    peer A (as a decoder would be), with peer B's bytes arriving meanwhile. Returns the order
    in which the loop saw them: the deadline must come after B."""
    loop = asyncio.get_running_loop()
    order: list[str] = []
    pairs = [socket.socketpair() for _ in range(2)]

    def busy() -> None:
        pairs[1][1].send(b"b")
        # Not synchronisation: the loop is busy (or the scheduler gave the CPU to others)
        # while the deadline falls due and B's bytes arrive.
        time.sleep(block)

    transports = [(await loop.connect_accepted_socket(
        functools.partial(_Recorder, name, order, fn), pair[0]))[0]
        for name, fn, pair in [("a", busy, pairs[0]), ("b", lambda: None, pairs[1])]]
    try:
        deadline = Deadline(seconds)
        deadline.fired.add_done_callback(lambda _f: order.append("fired"))
        pairs[0][1].send(b"a")
        await deadline.fired
        return order, deadline
    finally:
        for transport in transports:
            transport.close()
        for _ours, peer in pairs:
            peer.close()


def _starved(loop_name: str, block: float, seconds: float = 0.005
             ) -> tuple[list[str], Deadline]:
    """:func:`_starved_past_the_deadline` run on a fresh loop of kind ``loop_name``."""
    return _run(loop_name, lambda: _starved_past_the_deadline(block, seconds))


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_a_late_deadline_reads_what_arrived_before_it_fires(loop_name: str) -> None:
    # Busy for a little longer than the deadline: found late by less than its own length
    # (and than LATE), so starved, not stalled: no grace, only a last look.
    order, deadline = _starved(loop_name, LATE / 2, seconds=LATE * 0.45)
    assert deadline.paused == 0.0
    assert order == ["a", "b", "fired"]


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_a_deadline_found_far_past_due_says_we_were_paused(loop_name: str) -> None:
    order, deadline = _starved(loop_name, LATE * 1.5)
    assert deadline.paused > LATE  # the grace path was taken
    assert order == ["a", "b", "fired"]


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_a_deadline_found_later_than_its_own_length_says_we_stalled(loop_name: str) -> None:
    order, deadline = _starved(loop_name, LATE / 4)  # a 5 ms deadline found about 20 ms late
    assert deadline.paused > 0.0  # a grace was taken (the stall's, or a pause's)
    assert order == ["a", "b", "fired"]


def test_a_stall_longer_than_the_deadline_waits_as_long_again() -> None:
    # Our process (or its host) did not run for longer than the whole bound: the peers had
    # none of that time either, so the deadline waits as long again before it expires. A
    # timer late by less than its own length (a loop busy for a moment), or by less than
    # STALL, takes only its last look.
    from aioreduce.schemes.deadline import STALL

    from .clockloop import ClockLoop, advance, run

    async def body(loop: ClockLoop) -> None:
        stalled = Deadline(0.020)
        await advance(loop, 0.045)  # found 25 ms late: more than its 20 ms
        assert not stalled.fired.done() and stalled.paused == pytest.approx(0.025)
        await advance(loop, 0.024)
        assert not stalled.fired.done()
        await advance(loop, 0.002)
        assert stalled.fired.done()

        busy = Deadline(0.020)
        await advance(loop, 0.035)  # 15 ms late: less than its length
        assert busy.fired.done() and busy.paused == 0.0

        short = Deadline(STALL / 5)
        await advance(loop, STALL / 5 + STALL * 0.8)  # later than its length, not than STALL
        assert short.fired.done() and short.paused == 0.0

        long = Deadline(10.0)
        await advance(loop, 10.0 + LATE * 2)  # a pause: the fixed grace, whatever the length
        assert not long.fired.done() and long.paused == pytest.approx(LATE * 2)

    run(body)


def test_a_cancelled_deadline_never_fires_even_during_its_last_look() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        calls: list[str] = []
        deadline = Deadline(0.0, lambda: calls.append("callback"))
        looking = loop.create_future()
        loop.call_soon(looking.set_result, None)  # runs after the timer put its look in line
        time.sleep(0.002)  # the timer is due when the loop next runs (not synchronisation)
        await looking
        deadline.cancel()
        for _ in range(5):  # the look's hops through the ready queue, and more
            await asyncio.sleep(0)
        assert calls == [] and deadline.fired.cancelled()
    _run("uvloop", main)


def test_our_own_garbage_collection_moves_the_deadline_by_its_length() -> None:
    # A full collection holds every thread of ours (the lanes' readers too): the peers'
    # slices wait in our sockets meanwhile, so that time does not count against them.
    from aioreduce.schemes.deadline import COLLECTIONS, GC_MIN

    from .clockloop import ClockLoop, advance, run

    async def body(loop: ClockLoop) -> None:
        deadline = Deadline(0.020)
        COLLECTIONS.total += 0.050  # as if a collection took 50 ms since the deadline was set
        await advance(loop, 0.020)
        assert not deadline.fired.done() and deadline.excused == pytest.approx(0.050)
        await advance(loop, 0.049)
        assert not deadline.fired.done()
        await advance(loop, 0.002)
        assert deadline.fired.done()
        # Collections shorter than GC_MIN in all leave it where it was.
        short = Deadline(0.020)
        COLLECTIONS.total += GC_MIN / 2
        await advance(loop, 0.020)
        assert short.fired.done() and short.excused == 0.0

    # (The collector is off during unit tests, conftest.py: a real collection would move the
    # fake clock's deadlines too.)
    run(body)


def test_the_collections_are_counted_from_the_collectors_callbacks() -> None:
    from aioreduce.schemes.deadline import COLLECTIONS

    COLLECTIONS.install()
    before = COLLECTIONS.total
    gc.collect()
    assert COLLECTIONS.total > before
