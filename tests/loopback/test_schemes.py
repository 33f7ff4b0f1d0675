"""Every scheme over real processes: exact sums, stragglers skipped, dead ranks tolerated,
too many dead ranks reported by name, approximate decoding bounded, no frame mixed across steps.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from aioreduce.schemes.base import LANES_FROM

from .harness import SCHEMEPROG, Done, Ranks

pytestmark = pytest.mark.loopback


def steps_of(done: Done) -> list[dict]:
    return [json.loads(line[5:]) for line in done.out.splitlines() if line.startswith("STEP ")]


def run(ranks, n: int, *args: str, timeout: float = 180, **env: str) -> dict[int, Done]:
    job: Ranks = ranks(n)
    job.start_all(*args, prog=SCHEMEPROG, **env)
    return job.wait(timeout)


def assert_all_exact(done: dict[int, Done], steps: int, skip: tuple[int, ...] = ()) -> None:
    per_step: dict[int, set[str]] = {}
    for rank, d in done.items():
        if rank in skip:
            continue
        assert d.returncode == 0, (rank, d.err[-2000:])
        got = steps_of(d)
        assert [s["step"] for s in got] == list(range(steps)), (rank, got[-1:])
        for s in got:
            assert s["result_step"] == s["step"]
            assert s["exact"] and s["rel_err"] < 1e-9, (rank, s)
            per_step.setdefault(s["step"], set()).add(json.dumps([s["used"], s["late"]]))
    assert all(len(v) == 1 for v in per_step.values()), "ranks disagree on a step's result"


SCHEMES = [
    ("coded-tree", 13, ["--fanout", "3", "--levels", "2", "--stragglers", "1"]),
    ("gc-frc", 7, ["--stragglers", "2"]),
    ("gc-cyclic", 7, ["--stragglers", "1"]),
    ("gc-gaussian", 7, ["--stragglers", "1", "--dim", "1001"]),
    ("ring", 4, []),
    ("ring", 5, ["--dim", "7"]),
    ("ring", 13, ["--dim", "100003"]),
    ("ring", 4, ["--options", '{"lanes": false}']),
    ("tree", 7, ["--fanout", "2", "--chunk-bytes", "2048"]),
    ("star", 4, []),
]
LANES = ["--options", '{"lanes": true}']
# The trees and stars with their chunks over lanes (StepOptions.lanes; off by default).
SCHEMES_ON_LANES = [
    ("coded-tree", 13, [*SCHEMES[0][2], *LANES]),
    ("gc-frc", 7, ["--stragglers", "2", *LANES]),
    ("gc-gaussian", 7, ["--stragglers", "1", "--dim", "1001", *LANES]),
    ("tree", 7, ["--fanout", "2", "--chunk-bytes", "2048", *LANES]),
    ("star", 4, LANES),
    # Unasked, from a first vector of LANES_FROM bytes on (2.4 MB of float64 here).
    ("tree", 7, ["--fanout", "2", "--dim", "300000"]),
]


def _on_lanes(extra: list[str]) -> bool:
    said = " ".join(extra)
    if "lanes" in said:
        return '"lanes": true' in said
    return "--dim" in extra and 8 * int(extra[extra.index("--dim") + 1]) >= LANES_FROM  # f64


def assert_path(done: dict[int, Done], lanes: bool, skip: tuple[int, ...] = ()) -> None:
    """Every step of every rank (but ``skip``) ran over lanes, or over the event loop."""
    for rank, d in done.items():
        if rank not in skip:
            assert all(s["lanes"] is lanes for s in steps_of(d)), (rank, lanes)


def _path_id(scheme: str, extra: list[str]) -> str:
    said = "lanes" in " ".join(extra)
    if scheme == "ring":
        return "-event-loop" if said else ""
    if _on_lanes(extra):
        return "-lanes" if said else "-lanes-unasked"
    return ""


@pytest.mark.parametrize("scheme, n, extra", SCHEMES + SCHEMES_ON_LANES,
                         ids=[f"{s}-{n}{_path_id(s, e)}" for s, n, e in SCHEMES + SCHEMES_ON_LANES])
def test_exact_sum_on_every_step(ranks, scheme: str, n: int, extra: list[str]) -> None:
    done = run(ranks, n, scheme, "--steps", "20", *extra)
    assert_all_exact(done, 20)
    # The path taken: the ring over lanes unless told otherwise, the others as told.
    assert_path(done, _on_lanes(extra) or (scheme == "ring" and "lanes" not in " ".join(extra)))


@pytest.mark.parametrize("scheme, n, extra", [SCHEMES[0], SCHEMES[4]], ids=["coded-tree", "ring"])
def test_emulated_latency_delays_every_hop_and_sums_stay_exact(ranks, scheme: str, n: int,
                                                               extra: list[str]) -> None:
    latency = 0.05
    done = run(ranks, n, scheme, "--steps", "5", *extra, AIOREDUCE_LATENCY=str(latency))
    assert_all_exact(done, 5)
    # The path was taken: a ring step is 2(N-1) hops one after another, a 2-level tree's
    # result comes up two hops and down two, and none can beat its latency (but the first hop
    # may have begun before a rank started its clock).
    hops = 2 * (n - 1) if scheme == "ring" else 4
    for step in range(1, 5):
        slowest = max(steps_of(d)[step]["seconds"] for d in done.values())
        assert slowest >= (hops - 1) * latency, (step, slowest)


@pytest.mark.parametrize("extra", [[], LANES], ids=["event-loop", "lanes"])
def test_coded_tree_does_not_wait_for_one_slow_child_per_family(ranks, extra) -> None:
    # One child in each of the four families a second late.
    done = run(ranks, 13, "coded-tree", "--steps", "4", *extra,
               AIOREDUCE_STRAGGLE="rank=3,6,9,12:delay=1.0")
    assert_all_exact(done, 4)
    assert_path(done, bool(extra))
    # No parent waited for its slow child: on every step each slow child of a fast parent (a
    # second late) is among the root's late ranks, its share decoded from its siblings'. (A
    # parent that waited would have used it; 12's parent, 3, is slow itself and is the one
    # the root reports.)
    for s in steps_of(done[0]):
        assert {3, 6, 9} <= set(s["late"]), s


def test_gc_does_not_wait_for_a_slow_worker(ranks) -> None:
    done = run(ranks, 7, "gc-cyclic", "--steps", "4", "--stragglers", "1",
               AIOREDUCE_STRAGGLE="rank=4:delay=1.0")
    assert_all_exact(done, 4)
    # The master never waited for it: a second late on every step, it is never used.
    assert all(4 in s["late"] and 4 not in s["used"] for s in steps_of(done[0])), steps_of(done[0])


@pytest.mark.parametrize("extra", [[], LANES], ids=["event-loop", "lanes"])
def test_one_killed_child_per_family_later_steps_exact(ranks, extra) -> None:
    killed = (3, 6, 9, 12)  # rank 3 heads a family: its children get results from rank 0
    done = run(ranks, 13, "coded-tree", "--steps", "20", "--die", "3,6,9,12", "--die-step", "5",
               *extra)
    for rank in killed:
        assert done[rank].returncode == -9
        assert [s["step"] for s in steps_of(done[rank])] == list(range(5))
    assert_all_exact(done, 20, skip=killed)
    assert_path(done, bool(extra), skip=killed)
    for s in steps_of(done[0])[5:]:
        assert {3, 6, 9} <= set(s["late"])  # 12 sat under 3, which is skipped as a whole
        assert not set(killed) & set(s["used"])


@pytest.mark.parametrize("extra", [[], LANES], ids=["event-loop", "lanes"])
def test_a_rank_dead_before_the_first_step_is_a_lost_child(ranks, extra) -> None:
    # Lanes open at the first step: its parent's opening leaves the dead child out instead
    # of failing (and taking its family's and the root's openings down with it).
    done = run(ranks, 13, "coded-tree", "--steps", "6", "--die", "12", "--die-step", "0",
               *extra)
    assert done[12].returncode == -9 and not steps_of(done[12])
    assert_all_exact(done, 6, skip=(12,))
    assert_path(done, bool(extra), skip=(12,))
    assert all(12 not in s["used"] for s in steps_of(done[3]))


def test_a_killed_rank_in_the_ring_over_lanes_is_named_on_every_rank(ranks) -> None:
    # Lanes block in a thread: a dead neighbour's lane ends, and the ranks further round
    # hear it through the mesh (the abort); every survivor raises PeerLost naming rank 2.
    done = run(ranks, 5, "ring", "--steps", "8", "--dim", "300001", "--die", "2",
               "--die-step", "3", timeout=120)
    assert done[2].returncode == -9
    for rank in (0, 1, 3, 4):
        got = steps_of(done[rank])
        assert [s["step"] for s in got] == [0, 1, 2], (rank, got[-1:])
        assert all(s["exact"] and s["rel_err"] < 1e-6 and s["lanes"] for s in got)
        assert done[rank].returncode != 0
        last = done[rank].err.strip().splitlines()[-1]
        assert last.startswith("aioreduce.errors.PeerLost: rank 2"), (rank, last)


def test_a_paused_rank_in_the_ring_over_lanes_resumes_and_every_step_is_exact(ranks) -> None:
    # SIGSTOP at step 3 (the others are in step 3 or entering it, and cannot leave it), SIGCONT
    # once it is stopped: the ring has no deadline, so how long the pause lasts does not change
    # its path; its lanes survive it and every step is exact, over lanes, on every rank.
    job: Ranks = ranks(4)
    job.start_all("ring", "--steps", "8", "--dim", "300001", "--stop", "2", "--die-step", "3",
                  prog=SCHEMEPROG)
    try:
        job.drain()
        pid = job.procs[2].pid
        _, status = os.waitpid(pid, os.WUNTRACED)  # returns once rank 2 has stopped itself
        assert os.WIFSTOPPED(status)
        assert not any('"step": 3' in job.output(r) for r in range(4))  # nobody got past it
        os.kill(pid, signal.SIGCONT)
        done = job.wait(120)
    finally:
        job.kill()
    assert_all_exact(done, 8)
    assert all(s["lanes"] for d in done.values() for s in steps_of(d))


def test_step_telemetry_counts_the_same_bytes_over_lanes_as_over_the_event_loop(
        ranks, tmp_path) -> None:
    counted = {}
    for path in ("lanes", "event-loop"):
        trace = tmp_path / path
        options = "{}" if path == "lanes" else '{"lanes": false}'
        done = run(ranks, 4, "ring", "--steps", "4", "--dim", "1001", "--options", options,
                   AIOREDUCE_TRACE=str(trace))
        assert_all_exact(done, 4)
        assert all(s["lanes"] is (path == "lanes") for d in done.values() for s in steps_of(d))
        counted[path] = {
            (rank, rec["step"]): (rec["sent_bytes"], rec["recv_bytes"],
                                  {src: (v["bytes"], v["frames"])
                                   for src, v in rec["recv"].items()})
            for rank in range(4)
            for rec in map(json.loads, (trace / f"rank.{rank}.jsonl").read_text().splitlines())}
    lanes, loop = counted["lanes"], counted["event-loop"]
    assert {k: v for k, v in lanes.items() if k[1] > 0} == {
        k: v for k, v in loop.items() if k[1] > 0}
    for rank in range(4):  # step 0 opened the lanes: the successor's offer (an empty frame)
        sent, got, by_src = lanes[(rank, 0)]  # is counted if it came after the step began
        assert by_src.pop(str((rank + 1) % 4), None) in (None, (0, 1))
        assert (sent, got, by_src) == loop[(rank, 0)]
    # Rank 0 of 4, 1001 float64 in segments of 250, 250, 250, 251: it sends all but two, and
    # receives 6 frames of all but two from rank 3.
    assert counted["lanes"][(0, 1)] == (2 * 1001 * 8 - 500 * 8, 2 * 1001 * 8 - 500 * 8,
                                        {"3": (2 * 1001 * 8 - 500 * 8, 6)})


@pytest.mark.parametrize("extra", [[], LANES], ids=["event-loop", "lanes"])
def test_gc_killed_worker_later_steps_exact(ranks, extra) -> None:
    done = run(ranks, 7, "gc-frc", "--steps", "20", "--stragglers", "2", "--die", "2,4",
               "--die-step", "5", *extra)
    assert_all_exact(done, 20, skip=(2, 4))
    assert_path(done, bool(extra), skip=(2, 4))


def test_s_plus_one_killed_in_one_family_raises_naming_them(ranks) -> None:
    done = run(ranks, 7, "gc-cyclic", "--steps", "6", "--stragglers", "1", "--die", "2,5",
               "--die-step", "3", "--deadline", "300")
    # Killed ranks are known at once (their connections break): with a deadline of 300 s a
    # step that waited for them would outlast the run's timeout.
    for rank in (0, 1, 3, 4, 6):
        got = steps_of(done[rank])
        assert done[rank].returncode == 0, done[rank].err[-2000:]
        assert all(s["exact"] and s["rel_err"] < 1e-9 for s in got[:3])
        for s in got[3:]:
            assert s["error"] == "straggler" and s["missing"] == [2, 5], s
            assert "ranks [2, 5]" in s["message"]


@pytest.mark.parametrize("extra", [[], LANES], ids=["event-loop", "lanes"])
def test_s_plus_one_silent_children_raise_within_the_deadline(ranks, extra) -> None:
    # SIGSTOP: no connection breaks, only the deadline can tell.
    job: Ranks = ranks(7)
    job.start_all("gc-cyclic", "--steps", "4", "--stragglers", "1", "--stop", "2,5",
                  "--die-step", "2", "--deadline", "1.5", "--close-timeout", "2", *extra,
                  prog=SCHEMEPROG)  # (2 s, not 10, for the stopped ranks at the close)
    try:
        for rank in (0, 1, 3, 4, 6):
            out, _err = job.procs[rank].communicate(timeout=60)
            got = [json.loads(x[5:]) for x in out.splitlines() if x.startswith("STEP ")]
            assert [s.get("error") for s in got] == [None, None, "straggler", "straggler"], got
            assert got[2]["missing"] == [2, 5]
            assert all(x["lanes"] is bool(extra) for x in got[:2]), got[:2]
            # Only the deadline can tell (no connection broke): it did, not a hang (the
            # timeout above).
    finally:
        job.kill()


def test_approximate_mode_returns_a_bounded_inexact_result(ranks) -> None:
    done = run(ranks, 7, "gc-cyclic", "--steps", "6", "--stragglers", "1", "--die", "2,5",
               "--die-step", "3", "--deadline", "2", "--approximate")
    got = steps_of(done[0])
    assert all(s["exact"] for s in got[:3])
    for s in got[3:]:
        assert not s["exact"] and s["error_bound"] > 0
        assert s["abs_err"] <= s["bound"] + 1e-9, s
    assert steps_of(done[1])[4]["exact"] is False  # the same verdict on every rank


@pytest.mark.parametrize("extra", [[], LANES], ids=["event-loop", "lanes"])
def test_no_frame_of_one_step_is_used_in_the_next(ranks, extra) -> None:
    # Worker 1 is slower than a whole step every time: its frame for step t arrives while the
    # master is in step t+1 or later, and would be a "first arrival" for its FRC group there.
    done = run(ranks, 7, "gc-frc", "--steps", "15", "--stragglers", "1", *extra,
               AIOREDUCE_STRAGGLE="rank=1:delay=0.2")
    assert_all_exact(done, 15)
    assert_path(done, bool(extra))
    assert sum(1 in s["late"] for s in steps_of(done[0])) >= 10
    slow = steps_of(done[1])
    assert all(s["rel_err"] < 1e-9 for s in slow)  # the straggler itself gets exact results


@pytest.mark.parametrize("extra", [[], LANES], ids=["event-loop", "lanes"])
def test_stopped_intermediate_rank_does_not_strand_its_children(ranks, extra) -> None:
    # Rank 3 heads the family {10, 11, 12}. SIGSTOPped, it keeps its connections open but
    # passes nothing on: its children ask rank 0 to adopt them and get every result from it
    # (over the mesh: with lanes, only parent and children have them).
    job: Ranks = ranks(13)
    # (Rank 3 never reaches the closing barrier: the others wait 2 s for it, not 10. The
    # deadline leaves a healthy parent 0.8 s over the injected 0.2: at 0.5 a child once
    # bypassed one that two pytest workers' load on 2 cores had made late.)
    job.start_all("coded-tree", "--steps", "14", "--stop", "3", "--die-step", "3",
                  "--deadline", "1.0", "--close-timeout", "2", *extra, prog=SCHEMEPROG,
                  AIOREDUCE_STRAGGLE="all:delay=0.2")
    try:
        for rank, proc in job.procs.items():
            if rank == 3:
                continue
            out, err = proc.communicate(timeout=90)
            got = [json.loads(x[5:]) for x in out.splitlines() if x.startswith("STEP ")]
            assert [s["step"] for s in got] == list(range(14)), (rank, err[-2000:])
            assert all("error" not in s and s["rel_err"] < 1e-9 for s in got), (rank, got)
            assert all(s["lanes"] is bool(extra) for s in got), rank
            # The orphans lose a deadline once, not one per step: from the stop on they take
            # every result from rank 0 without asking their silent parent first.
            links = ["bypassed"] * 11 if rank in (10, 11, 12) else [None] * 11 if rank == 0 \
                else ["healthy"] * 11
            assert [s["link"] for s in got][3:] == links, (rank, got)
    finally:
        job.kill()
