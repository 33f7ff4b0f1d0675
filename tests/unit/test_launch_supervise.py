"""The supervisor over fake ranks, on a clock that moves only when the test says: the rank
whose error caused the others' is named whatever order the deaths arrive in; with only lost
peers the wait is bounded; a traceback is said once; held tracebacks of a rank that goes on
are written as they were."""

from __future__ import annotations

import asyncio
import io
import itertools
import signal

import pytest

from aioreduce_launch.output import RankOutput
from aioreduce_launch.supervise import Supervisor
from aioreduce_launch.tracebacks import TracebackHold, rank_ranges, same_error

from .clockloop import ClockLoop, run

LOST = ["Traceback (most recent call last):", '  File "t.py", line 1, in <module>',
        "aioreduce.errors.PeerLost: rank 2: lane from rank 2 closed"]
CAUSE = {"caller": (1, ["Traceback (most recent call last):", '  File "t.py", line 9, in f',
                        "ValueError: rank 2, step 3: this vector is float64 [19]"]),
         "signal": (128 + signal.SIGKILL, [])}


class FakeRank:
    def __init__(self, rank: int, out: io.BytesIO) -> None:
        self.rank, self.host = rank, "localhost"
        self.outputs = (RankOutput(rank, "stdout", out=out), RankOutput(rank, "stderr", out=out))
        self.code: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def die(self, code: int, lines: list[str]) -> None:
        self.outputs[1].feed("".join(f"{line}\n" for line in lines).encode())
        self.code.set_result(code)

    async def wait(self) -> int:
        return await self.code

    async def close(self) -> None:
        pass

    def signal(self, sig: int) -> None:
        if not self.code.done():
            self.code.set_result(128 + sig)


async def settle() -> None:
    for _ in range(12):
        await asyncio.sleep(0)


@pytest.mark.parametrize("cause", ["caller", "signal"])
@pytest.mark.parametrize("order", list(itertools.permutations([0, 1, 2])))
def test_the_cause_is_named_whatever_the_order_of_deaths(cause: str,
                                                         order: tuple[int, ...]) -> None:
    async def body(loop: ClockLoop) -> None:
        out = io.BytesIO()
        ranks = [FakeRank(r, out) for r in range(4)]
        sup = Supervisor(ranks, kill_timeout=10, cause_wait=3.0)  # type: ignore[arg-type]
        job = asyncio.ensure_future(sup.run())
        await settle()
        dying = {0: (1, LOST), 1: (1, LOST), 2: CAUSE[cause]}  # rank 2 caused it
        for r in order:
            if not ranks[r].code.done():  # not already stopped by the launcher
                ranks[r].die(*dying[r])
            await settle()
        loop.now += 3.0  # the wait for a cause is bounded
        await settle()
        code = await asyncio.wait_for(job, 10)
        culprit = sup.policy.culprit
        assert culprit is not None and culprit.rank == 2, (order, sup.policy.deaths)
        assert code == CAUSE[cause][0]
        assert not ranks[3].code.done() or ranks[3].code.result() == 128 + signal.SIGTERM

    run(body)


def test_with_only_lost_peers_the_wait_ends_and_the_first_is_named() -> None:
    async def body(loop: ClockLoop) -> None:
        out = io.BytesIO()
        ranks = [FakeRank(r, out) for r in range(3)]
        sup = Supervisor(ranks, cause_wait=3.0)  # type: ignore[arg-type]
        job = asyncio.ensure_future(sup.run())
        ranks[1].die(1, LOST)
        await settle()
        loop.now += 2.9
        await settle()
        assert not job.done() and not ranks[0].code.done()  # still waiting for a cause
        loop.now += 0.2
        await settle()
        assert ranks[0].code.done()  # stopped now
        await asyncio.wait_for(job, 10)
        culprit = sup.policy.culprit
        assert culprit is not None and culprit.rank == 1 and culprit.victim

    run(body)


def test_identical_errors_are_said_once(capsys: pytest.CaptureFixture[str]) -> None:
    async def body(loop: ClockLoop) -> None:
        out = io.BytesIO()
        ranks = [FakeRank(r, out) for r in range(13)]
        sup = Supervisor(ranks)  # type: ignore[arg-type]
        job = asyncio.ensure_future(sup.run())
        for r in range(13):  # the same caller mistake everywhere, each naming itself
            ranks[r].outputs[1].feed(b"Traceback (most recent call last):\n  x\n"
                                     b"ValueError: rank %d: needs exactly 13\n" % r)
        ranks[5].code.set_result(1)  # one exits first; the launcher stops the others
        await asyncio.wait_for(job, 10)
        assert "Traceback" not in out.getvalue().decode()  # nothing of it live

    run(body)
    said = [line for line in capsys.readouterr().err.splitlines()]
    assert "aioreduce-launch:   rank 5 on localhost exited with code 1: ValueError: rank 5: " \
        "needs exactly 13" in said
    assert said[-1] == ("aioreduce-launch: ranks 0-4,6-12, stopped, had printed the culprit's "
                        "error")
    assert len(said) <= 10


def test_a_rank_stopped_while_printing_the_culprits_traceback_is_counted_with_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    # CI once saw rank 8 of 12 stopped two lines into the same traceback: it was said on a line
    # of its own ("had printed:   File ...") instead of with the others. A traceback cut short
    # that matches the culprit's so far is the culprit's; one that does not is said as it is.
    async def body(loop: ClockLoop) -> None:
        out = io.BytesIO()
        ranks = [FakeRank(r, out) for r in range(5)]
        sup = Supervisor(ranks)  # type: ignore[arg-type]
        job = asyncio.ensure_future(sup.run())
        for r in (0, 1, 2):
            ranks[r].outputs[1].feed(b"Traceback (most recent call last):\n  File a\n"
                                     b"  File b, rank %d\nValueError: rank %d: needs 13\n"
                                     % (r, r))
        ranks[3].outputs[1].feed(b"Traceback (most recent call last):\n  File a\n")
        ranks[4].outputs[1].feed(b"Traceback (most recent call last):\n  File z\n")
        ranks[1].code.set_result(1)
        await asyncio.wait_for(job, 10)

    run(body)
    said = capsys.readouterr().err.splitlines()
    assert "aioreduce-launch: ranks 0,2-3, stopped, had printed the culprit's error" in said
    assert "aioreduce-launch: rank 4, stopped, had printed:   File z" in said


def test_a_traceback_is_held_until_the_rank_goes_on() -> None:
    hold = TracebackHold()
    assert hold.feed("step 1") == ["step 1"]
    lines = ["Traceback (most recent call last):", '  File "x.py", line 1', "    f()",
             "KeyError: 3", "", "During handling of the above exception, another exception "
             "occurred:", "", "Traceback (most recent call last):", '  File "x.py", line 2',
             "ValueError: bad"]
    assert [out for line in lines for out in hold.feed(line)] == []
    assert hold.error == "ValueError: bad"
    assert hold.feed("step 2") == [*lines, "step 2"]  # logged, not fatal: written as it was
    assert hold.block == []


def test_rank_ranges_and_same_error() -> None:
    assert rank_ranges([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    assert same_error("ValueError: rank 3: bad (rank 31)", 3) == \
        same_error("ValueError: rank 4: bad (rank 31)", 4)


def test_a_dead_rank_is_restarted_up_to_the_limit_then_tolerated_then_the_job_stops() -> None:
    """``--restart 2 --tolerate 1``: the first two deaths get a new process each (which the
    supervisor then watches like the rank it replaced), the third is tolerated, the fourth
    stops the job; the summary names every death and restart."""
    async def body(loop: ClockLoop) -> None:
        out = io.BytesIO()
        ranks = [FakeRank(r, out) for r in range(3)]
        started: list[FakeRank] = []

        async def restarter(old: FakeRank) -> FakeRank:
            new = FakeRank(old.rank, out)
            started.append(new)
            return new

        sup = Supervisor(ranks, kill_timeout=10, tolerate=1, restart=2,  # type: ignore[arg-type]
                         restarter=restarter)  # type: ignore[arg-type]
        job = asyncio.ensure_future(sup.run())
        await settle()
        ranks[1].die(128 + signal.SIGKILL, [])
        await settle()
        assert [r.rank for r in started] == [1] and sup.ranks[1] is started[0]
        started[0].die(128 + signal.SIGKILL, [])  # the replacement dies too
        await settle()
        assert [r.rank for r in started] == [1, 1]
        started[1].die(1, ["ValueError: bad"])  # no restart left: tolerated
        await settle()
        assert len(started) == 2 and not job.done()
        ranks[0].code.set_result(0)
        ranks[2].die(1, ["RuntimeError: worse"])  # past the tolerance: the job stops
        code = await asyncio.wait_for(job, 10)
        assert code == 1
        text = "\n".join(sup.policy.summary())
        assert text.count("restarted (") == 2 and "restarted (2 of at most 2)" in text
        assert "rank 2 on localhost exited with code 1" in text

    run(body)


def test_a_rank_that_cannot_be_restarted_counts_as_a_death() -> None:
    async def body(loop: ClockLoop) -> None:
        out = io.BytesIO()
        ranks = [FakeRank(r, out) for r in range(2)]

        async def restarter(old: FakeRank) -> FakeRank:
            raise OSError("no such file")

        sup = Supervisor(ranks, kill_timeout=10, restart=3,  # type: ignore[arg-type]
                         restarter=restarter)  # type: ignore[arg-type]
        job = asyncio.ensure_future(sup.run())
        await settle()
        ranks[1].die(128 + signal.SIGKILL, [])
        code = await asyncio.wait_for(job, 10)
        assert code == 1 and [d.rank for d in sup.policy.deaths] == [1]
        assert ranks[0].code.result() == 128 + signal.SIGTERM  # the job was stopped

    run(body)
