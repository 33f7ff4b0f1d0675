"""A receive cancelled by its owner (``future.cancel()``, as schemes withdraw theirs) is
withdrawn from the inbox only when the future's done-callback runs, a turn of the loop later.
A frame for it that arrives in between must find no receive: before, an empty-payload frame
there (a lane offer) resolved the cancelled future, ``InvalidStateError`` escaped the
protocol's ``buffer_updated``, and the loop closed that peer's connection (seen while
reproducing a replaced rank's recovery: the peer was then taken for lost)."""

from __future__ import annotations

import numpy as np

from aioreduce.transport.inbox import Inbox
from aioreduce.wire import Header, Kind
from aioreduce.wire.decoder import Frame

from .clockloop import ClockLoop, advance, run

CONN = object()


def _empty(step: int, tag: int) -> Header:
    return Header(Kind.DATA, step, tag, 1, "|u1", (0,))


def test_a_frame_for_a_receive_cancelled_this_turn_is_kept_for_the_next_one() -> None:
    async def body(loop: ClockLoop) -> None:
        inbox = Inbox(1, stage_limit=1 << 20)
        fut = inbox.post((5, 9), memoryview(np.zeros(0, np.uint8)), "|u1")
        fut.add_done_callback(lambda f: inbox.cancel((5, 9), f))  # as Mesh.post_recv does
        fut.cancel()
        inbox.delivered(CONN, Frame(_empty(5, 9), None))  # the same turn: no error
        assert fut.cancelled()
        again = inbox.post((5, 9), memoryview(np.zeros(0, np.uint8)), "|u1")
        assert again.done() and again.result().step == 5  # the frame was kept for it
        await advance(loop, 0)  # the withdrawal runs now and withdraws nothing else
        assert again.result().tag == 9

    run(body)


def test_a_receive_reposted_before_its_cancelled_one_was_withdrawn_is_the_one_served() -> None:
    async def body(loop: ClockLoop) -> None:
        inbox = Inbox(1, stage_limit=1 << 20)
        first = inbox.post((5, 9), memoryview(np.zeros(0, np.uint8)), "|u1")
        first.add_done_callback(lambda f: inbox.cancel((5, 9), f))
        first.cancel()
        second = inbox.post((5, 9), memoryview(np.zeros(0, np.uint8)), "|u1")
        await advance(loop, 0)  # the first one's withdrawal leaves the second posted
        inbox.delivered(CONN, Frame(_empty(5, 9), None))
        assert second.done() and second.result().step == 5

    run(body)


def test_a_payload_for_a_receive_cancelled_this_turn_never_lands_in_its_buffer() -> None:
    async def body(loop: ClockLoop) -> None:
        inbox = Inbox(1, stage_limit=1 << 20)
        out = np.zeros(8, np.uint8)
        fut = inbox.post((5, 0), memoryview(out), "|u1")
        fut.add_done_callback(lambda f: inbox.cancel((5, 0), f))
        fut.cancel()
        header = Header(Kind.DATA, 5, 0, 1, "|u1", (8,))
        dest = inbox.choose(CONN, header)  # the same turn
        assert isinstance(dest, memoryview) and not np.shares_memory(np.asarray(dest), out)
        dest[:] = b"\x07" * 8
        inbox.delivered(CONN, Frame(header, dest))
        assert (out == 0).all()  # the withdrawn buffer was never written
        got = np.zeros(8, np.uint8)
        assert inbox.post((5, 0), memoryview(got), "|u1").done() and (got == 7).all()

    run(body)
