"""Step telemetry on the in-memory network: what the trace lines say, and the report."""

from __future__ import annotations

import asyncio

import pytest

import aioreduce as ar
from aioreduce.codes import cyclic_mds
from aioreduce.schemes.reduce import ReduceSession
from aioreduce.telemetry import StepRecord, Tracer, TracingComm, trace_path
from aioreduce.telemetry.report import load, summarize, table
from aioreduce.transport.memory import MemoryNetwork

from .memjob import DIM, Job


def traced_job(scheme: ar.Scheme, world: int, tmp_path) -> tuple[Job, list[Tracer]]:
    net = MemoryNetwork(world)
    tracers = [Tracer(r, trace_path(str(tmp_path), r)) for r in range(world)]
    job = Job(scheme, world, net)
    job.sessions = [scheme.open(TracingComm(c, t)) for c, t in zip(net.comms, tracers,
                                                                     strict=True)]
    return job, tracers


async def run_traced(job: Job, tracers: list[Tracer], step: int,
                     ranks: list[int] | None = None) -> None:
    ranks = list(range(job.world)) if ranks is None else ranks
    for r in ranks:
        tracers[r].begin(step, type(job.scheme).__name__)
    results = await job.run(step, ranks)
    for r, res in results.items():
        session = job.sessions[r]
        decode = session.decode_seconds(step) if isinstance(session, ReduceSession) else 0.0
        tracers[r].finish(step, None if isinstance(res, BaseException) else res,
                          res if isinstance(res, BaseException) else None, decode)


async def test_trace_counts_every_byte_and_names_the_late_rank(tmp_path) -> None:
    world = 5  # a gradient-coding master and 4 workers, one straggler tolerated
    job, tracers = traced_job(ar.GradientCoding(cyclic_mds(4, 1), deadline=0.25), world,
                              tmp_path)
    await run_traced(job, tracers, 0)
    job.net.hold(4, 0)  # rank 4's message does not reach the master in step 1
    await run_traced(job, tracers, 1)
    for t in tracers:
        t.close()
    recs = load(str(tmp_path))
    assert [(r.step, r.rank) for r in recs] == [(s, r) for s in (0, 1) for r in range(world)]
    vec = DIM * 8
    for r in recs:
        assert r.scheme == "GradientCoding" and r.exact is True and r.error is None
        # The master decodes from the first 3 to arrive: in step 0 any one may be skipped.
        assert len(r.late) <= 1 if r.step == 0 else r.late == [4]
        assert r.ready_s is None  # the node sets it; the sessions run without one here
        if r.rank == 0:  # the master: a message from each worker that arrived, the sum to each
            got = {k: p.bytes for k, p in r.recv.items()}
            # A skipped rank's message is counted too if it came before the line was written;
            # rank 4's, held back in step 1, never came.
            assert {1, 2, 3, 4} - set(r.late) <= set(got) <= ({1, 2, 3, 4} if r.step == 0
                                                              else {1, 2, 3})
            assert set(got.values()) == {vec} and r.recv_bytes == len(got) * vec
            assert r.sent_bytes == 4 * vec
            assert r.decode_s > 0
        else:
            assert r.sent_bytes == vec and {k: p.bytes for k, p in r.recv.items()} == {0: vec}
            assert r.decode_s == 0
    assert StepRecord.from_json(recs[0].to_json()) == recs[0]
    rows = {row.rank: row for row in summarize(recs)}
    assert rows[4].late >= 1 and sum(row.late for row in rows.values()) <= 2
    assert table(list(rows.values())).splitlines()[0].split()[:3] == ["rank", "steps", "late"]


async def test_frames_ahead_of_the_step_and_late_ones(tmp_path) -> None:
    t = Tracer(0, trace_path(str(tmp_path / "r{rank}.jsonl"), 0))
    t.received(1, 5, 100)  # before this rank began step 5: a negative time once it does
    await asyncio.sleep(0.01)
    t.begin(5, "Ring")
    t.finish(5, None, RuntimeError("boom"))
    t.received(2, 5, 50)  # after the step ended, before its line is written: counted
    t.begin(6, "Ring")
    t.finish(6, None, None)  # writes step 5
    t.received(3, 5, 7)  # too late: step 5 is written
    t.close()
    recs = load(str(tmp_path / "r0.jsonl"))
    assert [r.step for r in recs] == [5, 6]
    assert recs[0].recv[1].last_s < 0 < recs[0].recv[2].last_s
    assert recs[0].recv_bytes == 150 and recs[0].error == "RuntimeError: boom"
    assert trace_path("/x", 3) == "/x/rank.3.jsonl"


def test_png_is_drawn(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from aioreduce.telemetry.report import plot

    recs = [StepRecord(r, s, "Ring", 100.0 + s * 0.01, 0.01, 0.004, late=[2] if s == 3 else [])
            for s in range(5) for r in range(3)]
    plot(recs, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
