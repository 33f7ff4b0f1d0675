"""The delay line that times emulated latency: callbacks run on their own loop, in the order
they are due, each once, not before its moment less the line's bounded lead."""

from __future__ import annotations

import asyncio
import threading

from aioreduce.delayline import DelayLine
from aioreduce.transport.loop import run


def test_callbacks_run_on_their_loop_in_the_order_due() -> None:
    line = DelayLine()
    ran: list[tuple[str, bool, float, float]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        t0 = line.now()

        def call(name: str, due: float) -> None:
            ran.append((name, threading.current_thread() is threading.main_thread(), due,
                        line.now()))
            if len(ran) == 3:
                done.set_result(None)

        # Given out of order; the third is the earliest and wakes the sleeping line.
        line.at(t0 + 0.003, loop, call, "c", t0 + 0.003)
        line.at(t0 + 0.002, loop, call, "b", t0 + 0.002)
        line.at(t0 + 0.001, loop, call, "a", t0 + 0.001)
        await done

    run(main())
    assert [r[0] for r in ran] == ["a", "b", "c"]
    assert all(on_loop for _n, on_loop, _d, _t in ran)
    # Never earlier than the lead it may aim ahead by (at most half a millisecond).
    assert all(t >= due - 0.0005 for _n, _l, due, t in ran), ran
