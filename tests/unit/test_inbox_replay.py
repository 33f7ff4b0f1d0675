"""Early handlers installed after their frames were staged (a peer opened the next session
first) are handed those frames: of the steps asked for, once each, after the install returns,
never a frame a receive has claimed, and one still within its emulated latency only when it
ends."""

from __future__ import annotations

import numpy as np

from aioreduce.delayline import LoopTimer
from aioreduce.transport.inbox import Inbox

from .test_inbox_latency import LATENCY, ClockLoop, _arrive, _data, advance, run


def test_staged_frames_of_the_sessions_steps_reach_a_handler_installed_later() -> None:
    async def body(loop: ClockLoop) -> None:
        inbox = Inbox(1, stage_limit=1 << 20)
        for step, tag in ((2, 0), (3, 0), (3, 7), (4, 1)):
            _arrive(inbox, _data(step, tag), step)
        claimed = inbox.post((4, 1), memoryview(np.zeros(8, np.uint8)), "|u1")
        assert claimed.done()
        seen: list[tuple[int, int]] = []
        inbox.on_early(1, lambda h, p: seen.append((h.step, h.tag)), since=3)
        assert seen == []  # not inside the install: the session is still being built
        await advance(loop, 0)
        # Step 2 is before the session; tag 0 is below the handler's; (4, 1) was claimed.
        assert seen == [(3, 7)]
        await advance(loop, 0)
        assert seen == [(3, 7)]  # once
        plain: list[tuple[int, int]] = []
        inbox.on_early(0, lambda h, p: plain.append((h.step, h.tag)))
        await advance(loop, 0)
        assert plain == []  # without since: only frames arriving from now on

    run(body)


def test_a_handler_removed_before_the_replay_hears_nothing() -> None:
    async def body(loop: ClockLoop) -> None:
        inbox = Inbox(1, stage_limit=1 << 20)
        _arrive(inbox, _data(5, 0), 1)
        seen: list[int] = []
        remove = inbox.on_early(0, lambda h, p: seen.append(h.step), since=0)
        remove()
        await advance(loop, 0)
        assert seen == []

    run(body)


def test_a_frame_within_its_latency_is_handed_over_once_when_it_ends() -> None:
    async def body(loop: ClockLoop) -> None:
        inbox = Inbox(1, stage_limit=1 << 20, latency=LATENCY, timer=LoopTimer())
        _arrive(inbox, _data(5, 0), 1)  # staged, on the wire for LATENCY more
        await advance(loop, LATENCY / 2)
        seen: list[int] = []
        inbox.on_early(0, lambda h, p: seen.append(h.step), since=0)
        await advance(loop, 0)
        assert seen == []
        await advance(loop, LATENCY)
        assert seen == [5]
        seen.clear()
        _arrive(inbox, _data(6, 0), 1)
        await advance(loop, 2 * LATENCY)  # arrived and handed to the first handler
        later: list[int] = []
        inbox.on_early(0, lambda h, p: later.append(h.step), since=0)
        await advance(loop, 0)
        assert seen == [6] and later == [5, 6]  # the new one hears both, the old one no more

    run(body)
