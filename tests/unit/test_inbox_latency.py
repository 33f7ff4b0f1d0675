"""Emulated link latency in the inbox, on a loop whose clock the test moves (no sleeps).

What it must do: a frame counts as arrived ``latency`` after its bytes did, whether a receive
was posted for it, it was staged and claimed later, or an early handler sees it; a frame whose
stage ended within its latency is stale; a receive withdrawn meanwhile stays withdrawn.
"""

from __future__ import annotations

import numpy as np
import pytest

from aioreduce import Node
from aioreduce.delayline import LoopTimer
from aioreduce.errors import ConfigError
from aioreduce.transport.inbox import Inbox
from aioreduce.wire import Header, Kind
from aioreduce.wire.decoder import Frame

from .clockloop import ClockLoop, advance, run

LATENCY = 0.25
CONN = object()  # the inbox only keys state by connection here


def _data(step: int, tag: int, nbytes: int = 8) -> Header:
    return Header(Kind.DATA, step, tag, 1, "|u1", (nbytes,))


def _arrive(inbox: Inbox, header: Header, fill: int) -> None:
    """A frame's bytes land (wherever the inbox chose) and it completes."""
    dest = inbox.choose(CONN, header)
    assert isinstance(dest, memoryview)
    dest[:] = bytes([fill]) * header.payload_nbytes()
    inbox.delivered(CONN, Frame(header, dest))


def test_a_posted_receive_resolves_one_latency_after_its_bytes_land() -> None:
    async def body(loop: ClockLoop) -> None:
        inbox = Inbox(1, stage_limit=1 << 20, latency=LATENCY, timer=LoopTimer())
        out = np.zeros(8, np.uint8)
        fut = inbox.post((3, 0), memoryview(out), "|u1")
        await advance(loop, 1.0)  # nothing in flight: waiting costs no latency
        _arrive(inbox, _data(3, 0), 7)
        assert (out == 7).all()  # the bytes are there at once (zero-copy)...
        await advance(loop, LATENCY * 0.99)
        assert not fut.done()  # ...the scheme learns of them one latency later
        await advance(loop, LATENCY * 0.02)
        assert fut.done() and fut.result().step == 3

    run(body)


def test_frames_in_flight_overlap_their_latencies() -> None:
    async def body(loop: ClockLoop) -> None:
        inbox = Inbox(1, stage_limit=1 << 20, latency=LATENCY, timer=LoopTimer())
        outs = [np.zeros(8, np.uint8) for _ in range(4)]
        futs = [inbox.post((3, t), memoryview(o), "|u1") for t, o in enumerate(outs)]
        for t in range(4):  # back to back, a hundredth of the latency apart
            _arrive(inbox, _data(3, t), t)
            await advance(loop, LATENCY / 100)
        await advance(loop, LATENCY)
        assert all(f.done() for f in futs)  # not 4 latencies: one, as on a real link

    run(body)


def test_a_staged_frame_claimed_later_keeps_its_arrival_time() -> None:
    async def body(loop: ClockLoop) -> None:
        inbox = Inbox(1, stage_limit=1 << 20, latency=LATENCY, timer=LoopTimer())
        _arrive(inbox, _data(4, 0), 5)  # early: staged
        _arrive(inbox, _data(4, 1), 6)
        await advance(loop, LATENCY / 2)
        early = inbox.post((4, 0), memoryview(np.zeros(8, np.uint8)), "|u1")
        assert not early.done()  # claimed within its latency: still on the wire
        await advance(loop, LATENCY / 2 + 1e-6)
        assert early.done()
        await advance(loop, 1.0)
        out = np.zeros(8, np.uint8)
        late = inbox.post((4, 1), memoryview(out), "|u1")
        assert late.done() and (out == 6).all()  # arrived long ago: no latency added again

    run(body)


def test_early_handlers_see_a_frame_after_its_latency_unless_its_stage_ended() -> None:
    async def body(loop: ClockLoop) -> None:
        inbox = Inbox(1, stage_limit=1 << 20, latency=LATENCY, timer=LoopTimer())
        seen: list[tuple[int, int]] = []
        inbox.on_early(0, lambda h, p: seen.append((h.step, h.tag)))
        _arrive(inbox, _data(5, 0), 1)
        _arrive(inbox, _data(5, 9), 1)
        await advance(loop, LATENCY / 2)
        assert seen == []
        inbox.set_floor(5, 5)  # the stage of tags below 5 ends while tag 0 is in flight
        await advance(loop, LATENCY)
        assert seen == [(5, 9)]

    run(body)


def test_a_receive_withdrawn_during_the_latency_stays_withdrawn() -> None:
    async def body(loop: ClockLoop) -> None:
        inbox = Inbox(1, stage_limit=1 << 20, latency=LATENCY, timer=LoopTimer())
        fut = inbox.post((6, 0), memoryview(np.zeros(8, np.uint8)), "|u1")
        _arrive(inbox, _data(6, 0), 1)
        fut.cancel()
        inbox.cancel((6, 0), fut)
        await advance(loop, 2 * LATENCY)  # the timer finds it cancelled and leaves it be
        assert fut.cancelled()

    run(body)


def test_no_latency_resolves_at_once() -> None:
    async def body(loop: ClockLoop) -> None:
        inbox = Inbox(1, stage_limit=1 << 20)
        fut = inbox.post((7, 0), memoryview(np.zeros(8, np.uint8)), "|u1")
        _arrive(inbox, _data(7, 0), 1)
        assert fut.done()

    run(body)


ENV = {"AIOREDUCE_SECRET": "s3cret-for-tests", "AIOREDUCE_RANK": "0",
       "AIOREDUCE_WORLD_SIZE": "2", "AIOREDUCE_MASTER_ADDR": "127.0.0.1",
       "AIOREDUCE_MASTER_PORT": "4000", "AIOREDUCE_MAX_FRAME": "4096"}


def test_the_environment_sets_a_nodes_latency() -> None:
    async def body(loop: ClockLoop) -> None:
        node = Node.from_env({**ENV, "AIOREDUCE_LATENCY": "0.0001"})
        assert node.mesh.options.latency == 0.0001
        assert node.mesh.options.max_payload == 4096  # the other variables still count
        assert Node.from_env(ENV).mesh.options.latency == 0.0

    run(body)


@pytest.mark.parametrize("value", ["fast", "-1", "3600"])
def test_a_latency_that_makes_no_sense_is_refused_by_name(value: str) -> None:
    with pytest.raises(ConfigError, match=f"AIOREDUCE_LATENCY='{value}'"):
        Node.from_env({**ENV, "AIOREDUCE_LATENCY": value})


def test_the_environment_can_keep_ranks_on_one_host_on_tcp() -> None:
    """``AIOREDUCE_LOCAL_UNIX=0``: ranks on one host talk over TCP (for comparing,
    or a host without abstract Unix sockets); a value other than 0 or 1 is named."""
    async def body(loop: ClockLoop) -> None:
        assert Node.from_env(ENV).mesh.options.local_unix
        node = Node.from_env({**ENV, "AIOREDUCE_LOCAL_UNIX": "0"})
        assert not node.mesh.options.local_unix
        assert node.mesh.options.max_payload == 4096
        with pytest.raises(ConfigError, match="AIOREDUCE_LOCAL_UNIX='no'"):
            Node.from_env({**ENV, "AIOREDUCE_LOCAL_UNIX": "no"})

    run(body)
