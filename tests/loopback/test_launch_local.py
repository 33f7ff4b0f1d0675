"""aioreduce-launch -n N here: tagged lines, the first failure's code, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .harness import alive, gone

pytestmark = pytest.mark.loopback

LAUNCH = [sys.executable, "-m", "aioreduce_launch.cli"]

# Each rank starts a grandchild (sleep) to prove the whole process group is torn down.
PROG = r"""
import os, subprocess, sys, time
r = int(os.environ["RANK"])
child = subprocess.Popen(["sleep", "300"])
print(f"rank {r} pid {os.getpid()} child {child.pid} world {os.environ['WORLD_SIZE']}", flush=True)
print(f"err line from {r}", file=sys.stderr, flush=True)
mode = sys.argv[1]
if mode == "fail" and r == 2:
    time.sleep(0.5)
    print("rank 2 gives up", file=sys.stderr, flush=True)
    sys.exit(3)
if mode == "ok":
    sys.exit(0)
time.sleep(300)
"""


def _pids(out: str) -> list[int]:
    pids = []
    for line in out.splitlines():
        if " pid " in line:
            words = line.split()
            pids += [int(words[words.index("pid") + 1]), int(words[words.index("child") + 1])]
    return pids


def _run(mode: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAUNCH, "-n", "4", "--kill-timeout", "2", *kw.pop("extra", []),
                           "--", sys.executable, "-c", PROG, mode],
                          capture_output=True, text=True, timeout=timeout, **kw)


def test_lines_are_tagged_and_success_is_zero() -> None:
    res = _run("ok")
    assert res.returncode == 0, res.stderr
    for r in range(4):
        assert any(line.startswith(f"[{r}] rank {r} pid ") and line.endswith("world 4")
                   for line in res.stdout.splitlines())
        assert f"[{r}] err line from {r}" in res.stderr
    assert gone(_pids(res.stdout))


def test_first_failure_code_propagates_and_nothing_is_left(tmp_path) -> None:
    res = _run("fail", extra=["--output-dir", str(tmp_path)])
    assert res.returncode == 3, res.stderr
    assert "rank 2 on localhost exited with code 3" in res.stderr
    assert "[2] rank 2 gives up" in res.stderr
    pids = _pids(res.stdout)
    assert len(pids) == 8
    assert gone(pids), [p for p in pids if alive(p)]
    assert "rank 2 gives up" in (tmp_path / "rank.2.stderr").read_text()


def test_sigint_stops_every_rank() -> None:
    proc = subprocess.Popen([*LAUNCH, "-n", "4", "--kill-timeout", "2", "--", sys.executable,
                             "-c", PROG, "hang"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        lines: list[str] = []
        assert proc.stdout is not None
        while len([x for x in lines if " pid " in x]) < 4:
            line = proc.stdout.readline()
            assert line, "launcher ended early"
            lines.append(line)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=2 + 5)  # within the kill timeout plus a margin
        assert proc.returncode == 130, err
        assert gone(_pids("".join(lines) + out), within=3)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_usage_errors_are_clear() -> None:
    res = subprocess.run([*LAUNCH, "-n", "2", "python"], capture_output=True, text=True)
    assert res.returncode == 2 and "separate the command with --" in res.stderr
    res = subprocess.run([*LAUNCH, "-n", "2", "--", "/nonexistent/prog"], capture_output=True,
                         text=True)
    assert res.returncode == 2 and "cannot start" in res.stderr


LOGREG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "logreg.py")
REFERENCE_LOSS = 0.03228846978368438  # examples/logreg.py --reference, 30 steps


def _launch_logreg(n: int, extra: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAUNCH, "-n", str(n), "--kill-timeout", "2", *extra, "--",
                           sys.executable, LOGREG, *args], capture_output=True, text=True,
                          timeout=240)


@pytest.mark.parametrize("dead", [5, 2])  # a leaf; an intermediate rank (3 children)
def test_tolerate_keeps_a_coded_job_alive_when_a_rank_is_killed(dead: int) -> None:
    # The rank SIGKILLs itself at step 10 (a real death: no cleanup, sockets reset).
    res = _launch_logreg(13, ["--tolerate", "1", "-x", f"AIOREDUCE_STRAGGLE=rank={dead}:kill=10"])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = [line for line in res.stdout.splitlines() if line.startswith("[0] SUMMARY ")]
    final = json.loads(summary[0].removeprefix("[0] SUMMARY "))["final_loss"]
    assert abs(final - REFERENCE_LOSS) < 1e-9
    # The killed rank really died mid-run, and the summary says who and how.
    assert f"[{dead}] total" not in res.stderr
    assert f"rank {dead} on localhost killed by SIGKILL; tolerated (1 of at most 1)" in res.stderr
    assert "1 rank(s) died, tolerated" in res.stderr
    assert sum(line.endswith(" total") or " total " in line
               for line in res.stderr.splitlines()) == 12


def test_beyond_the_tolerance_the_culprit_is_the_rank_that_died_first() -> None:
    # Under a ring that does not wait for a lost rank (rejoin wait 0: it does not re-form), a
    # lost rank stops its neighbours (PeerLost): the second death stops the job, and the
    # culprit named is the killed rank, not the neighbour reporting it.
    res = _launch_logreg(4, ["--tolerate", "1", "-x", "AIOREDUCE_STRAGGLE=rank=2:kill=5",
                             "-x", "AIOREDUCE_REJOIN_WAIT=0"],
                         "--scheme", "ring", "--steps", "20")
    assert res.returncode == 128 + signal.SIGKILL, res.stderr[-3000:]
    assert "the job was stopped" in res.stderr
    assert "(after another rank was lost)" in res.stderr
    assert "culprit: rank 2 on localhost killed by SIGKILL" in res.stderr
    assert "[2] total" not in res.stderr


def test_under_tolerate_the_ring_goes_on_without_dead_ranks() -> None:
    # --tolerate sets a rejoin wait (1 s): the ring's step that lost ranks 2 and 3 (its
    # failure names one: the step run again without it fails on the other) runs again over
    # the others, and the job ends as a coded tree's would, the deaths named.
    res = _launch_logreg(5, ["--tolerate", "2", "-x",
                             "AIOREDUCE_STRAGGLE=rank=2:kill=5;rank=3:kill=5"],
                         "--scheme", "ring", "--steps", "20")
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in (0, 1, 4):
        assert f"[{rank}] rank {rank}: ranks [" in res.stderr
        assert f"[{rank}] total" in res.stderr
    assert "the steps run over the 3 others" in res.stderr
    assert "skipped [2, 3]" in res.stderr + res.stdout
    assert "2 rank(s) died, tolerated (2 of at most 2)" in res.stderr
    assert "never retrieved" not in res.stderr


def test_trace_of_the_readme_job_names_the_slow_rank(tmp_path) -> None:
    # README line 1, traced: every rank writes one line per step; the slow rank is the one
    # skipped most and ready latest; the report renders.
    res = _launch_logreg(13, ["-x", f"AIOREDUCE_TRACE={tmp_path}"], "--straggle",
                         "rank=4:slow=3")
    assert res.returncode == 0, res.stderr[-3000:]
    from aioreduce.telemetry.report import load, summarize

    recs = load(str(tmp_path))
    assert sorted({(r.rank, r.step) for r in recs}) == [(k, s) for k in range(13)
                                                        for s in range(30)]
    assert all(r.scheme == "CodedTree" and r.exact and r.error is None for r in recs)
    rows = {row.rank: row for row in summarize(recs)}
    assert max(rows.values(), key=lambda row: row.median_lag_ms).rank == 4
    # Skipped often (its parent, rank 1, is skipped often too: it waits for both others).
    assert rows[4].late > 0
    assert all(row.sent_mb > 0 and row.recv_mb > 0 for row in rows.values())
    out = subprocess.run([sys.executable, "-m", "aioreduce.telemetry", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.splitlines()[0].split()[0] == "rank"


CULPRIT = str(Path(__file__).with_name("culpritprog.py"))


@pytest.mark.parametrize("mode,how", [("caller", "exited with code 1"),
                                      ("signal", "killed by SIGKILL")])
@pytest.mark.parametrize("run", range(3))
def test_the_rank_whose_error_caused_the_others_is_the_culprit(mode: str, how: str,
                                                                run: int) -> None:
    # Rank 2 fails at step 3; ranks 0, 1 and 3 die of PeerLost, often before rank 2 exits:
    # the launcher waits for the cause before it stops the job, and names rank 2.
    res = subprocess.run([sys.executable, "-m", "aioreduce_launch.cli", "-n", "4", "--",
                          sys.executable, CULPRIT, mode], capture_output=True, text=True,
                         timeout=120)
    summary = [line for line in res.stderr.splitlines() if line.startswith("aioreduce-launch")]
    assert f"aioreduce-launch: culprit: rank 2 on localhost {how}" in res.stderr, summary
    assert res.returncode == (1 if mode == "caller" else 128 + signal.SIGKILL), summary
    if mode == "caller":
        assert "[2] ValueError: rank 2, step 3: this vector is float64 [19]" in res.stderr


def test_a_wrong_rank_count_for_the_quickstart_is_said_once() -> None:
    # Every rank refuses 12 ranks for a 13-rank tree with the same traceback: the output is
    # the summary (the culprit's last lines), not twelve interleaved tracebacks.
    res = _launch_logreg(12, [])
    lines = (res.stdout + res.stderr).splitlines()
    assert res.returncode == 1 and len(lines) <= 15, "\n".join(lines)
    assert any("ValueError: TreeTopology(fanout=3, levels=2, size=13) needs exactly 13 "
               "ranks, the job has 12" in line for line in lines)


def test_a_replacement_that_comes_after_the_job_finished_is_stopped_not_a_death() -> None:
    """Rank 2 dies after the job's last step (``lateprog.py``); ``--restart`` starts it
    again, but nobody is left to heal it: once rank 0 has exited 0 and the others had the
    kill timeout to finish, the launcher stops the replacement and exits 0."""
    prog = Path(__file__).resolve().parent / "lateprog.py"
    res = subprocess.run([*LAUNCH, "-n", "4", "--restart", "2", "--kill-timeout", "2", "--",
                          sys.executable, str(prog)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rank 2 on localhost killed by SIGKILL; restarting it" in res.stderr
    assert "rank 2's replacement came after the job had finished" in res.stderr
    assert "rank(s) died" not in res.stderr
    assert all(f"[{r}] DONE {r}" in res.stdout for r in (0, 1, 3)), res.stdout
