"""The delay line that times emulated latency: callbacks run on their own loop, in the order
they are due, each once, not before its moment less the line's bounded lead."""

from __future__ import annotations

import asyncio
import os
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


def test_a_forked_child_starts_a_line_of_its_own() -> None:
    # The parent's line thread has run (and survives only in the parent): a child that
    # delays a callback still gets it.
    line = DelayLine()

    async def once() -> str:
        loop = asyncio.get_running_loop()
        got: asyncio.Future[str] = loop.create_future()
        line.at(line.now() + 0.0002, loop, got.set_result, "ran")
        return await asyncio.wait_for(got, 30)

    assert run(once()) == "ran"
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its callback ran
        try:
            os._exit(0 if run(once()) == "ran" else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
