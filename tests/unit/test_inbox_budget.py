"""What an authenticated peer can make a rank hold: the inbox's budget, without sockets.

The live version (a real rank flooding its parent, memory measured) is in
``tests/loopback/test_hostile.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from aioreduce.transport.inbox import Inbox, PeerBudget
from aioreduce.wire import Header, Kind, ProtocolError
from aioreduce.wire.decoder import Frame

BUDGET = PeerBudget(staged_bytes=4096, staged_frames=10, control=3, steps_ahead=100)


def _inbox() -> Inbox:
    inbox = Inbox(5, stage_limit=1 << 20, budget=BUDGET)
    inbox.set_floor(10)  # this rank is at step 10
    return inbox


def _data(step: int, tag: int, nbytes: int = 0) -> Header:
    return Header(Kind.DATA, step, tag, 5, "|u1" if nbytes else "", (nbytes,) if nbytes else ())


CONN = object()  # the inbox only keys state by connection here


def test_frames_far_ahead_of_our_step_are_a_protocol_error() -> None:
    inbox = _inbox()
    inbox.delivered(CONN, Frame(_data(110, 0), memoryview(b"")))  # the window's edge: fine
    with pytest.raises(ProtocolError, match="more than 100 steps ahead of step 10"):
        inbox.delivered(CONN, Frame(_data(111, 0), memoryview(b"")))
    with pytest.raises(ProtocolError, match="steps ahead"):
        inbox.choose(CONN, _data(10**9, 0, 8))  # refused before a buffer is allocated


async def test_staged_bytes_and_frames_are_bounded_and_freed_when_used() -> None:
    inbox = _inbox()
    for i in range(4):  # 4 x 1 KiB: the whole byte budget
        buf = inbox.choose(CONN, _data(12, i, 1024))
        assert isinstance(buf, memoryview)
        inbox.delivered(CONN, Frame(_data(12, i, 1024), buf))
    assert inbox.staged_bytes == 4096
    with pytest.raises(ProtocolError, match="more early data than its budget"):
        inbox.choose(CONN, _data(12, 99, 1))
    out = np.empty(1024, np.uint8)
    fut = inbox.post((12, 0), memoryview(out), "|u1")  # a receive takes a staged frame
    assert fut.done() and inbox.staged_bytes == 3072
    inbox.set_floor(13)  # the step is over: the rest is dropped and the budget is free
    assert inbox.staged_bytes == 0
    for i in range(10):
        inbox.delivered(CONN, Frame(_data(20, i), memoryview(b"")))
    with pytest.raises(ProtocolError, match="more than 10 frames nobody has asked for"):
        inbox.delivered(CONN, Frame(_data(20, 10), memoryview(b"")))


async def test_unread_control_messages_are_bounded() -> None:
    inbox = _inbox()
    for _ in range(3):
        inbox.delivered(CONN, Frame(Header(Kind.CONTROL, meta={"op": "x"}), None))
    with pytest.raises(ProtocolError, match="more than 3 control messages"):
        inbox.delivered(CONN, Frame(Header(Kind.CONTROL, meta={"op": "x"}), None))
    inbox.control.get_nowait()  # read one: room for one more
    inbox.delivered(CONN, Frame(Header(Kind.CONTROL, meta={"op": "x"}), None))
