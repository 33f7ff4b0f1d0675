"""Ranks that die come back, over real processes: a killed leaf and a killed intermediate of
the coded tree are replaced by new processes that rejoin the running job, heal the program's
state from a live peer and contribute again; every step exact on every rank, every rank's
final state identical; a replaced process that comes back and a second live process for a
rank are refused and named. The long chaos soak: ``python -m tests.loopback.heal_soak``."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from aioreduce.errors import AuthError
from aioreduce.transport import Mesh

from .harness import SCHEMEPROG, Ranks

pytestmark = pytest.mark.loopback

ARGS = ("coded-tree", "--state", "--steps", "110", "--pace", "0.05", "--deadline", "2",
        "--dim", "1000")
FAMILIES = {0: [1, 2, 3], 1: [4, 5, 6], 2: [7, 8, 9], 3: [10, 11, 12]}
# each rank's parent and children: the peers its chunks travel to and from
FAMILY = {r: sorted([*([p for p, cs in FAMILIES.items() if r in cs]), *FAMILIES.get(r, [])])
          for r in range(13)}
DIE_AT = 8


class Lines:
    """Every line a process prints, read as it comes (a full pipe never blocks it)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=self._read, args=(pipe, buf), daemon=True)
                         for pipe, buf in ((proc.stdout, self.out), (proc.stderr, self.err))]
        for t in self._threads:
            t.start()

    @staticmethod
    def _read(pipe, buf: list[str]) -> None:  # type: ignore[no-untyped-def]
        for line in pipe:
            buf.append(line)

    def join(self) -> None:
        for t in self._threads:
            t.join(10)

    def tagged(self, tag: str) -> list[dict]:
        return [json.loads(line.split(" ", 1)[1]) for line in list(self.out)
                if line.startswith(tag + " ")]


def _stale_claim(job: Ranks, rank: int) -> str:
    """Dial rank 0 as an old process of ``rank`` would (the job's secret, incarnation 0)."""
    env = job.specs[rank].env

    async def dial() -> str:
        mesh = Mesh(rank, len(job.specs), env["AIOREDUCE_SECRET"].encode(),
                    env["AIOREDUCE_JOB"])
        try:
            await mesh.connect(0, ("127.0.0.1", int(env["AIOREDUCE_MASTER_PORT"])))
        except AuthError as exc:
            return str(exc)
        finally:
            await mesh.close()
        return "accepted"

    return asyncio.run(dial())


def test_a_replacement_on_another_host_cuts_chunks_as_the_job_began(ranks) -> None:
    """Leaf 9 alone on a second "host" (127.0.0.2); it dies and its replacement comes up on
    the first (127.0.0.1), as on a spare: counting hosts anew would say one host and cut 16
    chunks where its parent cuts 64. It takes the job's count from rank 0's table, and its
    contributions are in the root's sums again."""
    job: Ranks = ranks(13)
    victim = 9
    steps = 40
    args = ("coded-tree", "--state", "--steps", str(steps), "--pace", "0.05", "--deadline", "2",
            "--dim", "50000", "--chunk-bytes", "4096")  # 16 chunks on one host, 64 across
    lines: dict[int, Lines] = {}
    for r in range(13):
        die = ["--die", str(r), "--die-step", str(DIE_AT)] if r == victim else []
        addr = "127.0.0.2" if r == victim else "127.0.0.1"
        lines[r] = Lines(job.start(r, *args, *die, prog=SCHEMEPROG, AIOREDUCE_ADDR=addr))
    assert job.procs[victim].wait(60) == -9
    lines[victim] = Lines(job.start(victim, *args, prog=SCHEMEPROG, AIOREDUCE_ADDR="127.0.0.1"))
    codes = {r: p.wait(120) for r, p in job.procs.items()}
    for r in lines:
        lines[r].join()
    assert codes == dict.fromkeys(range(13), 0), {r: lines[r].err[-5:] for r in codes}
    assert {lines[r].tagged("FINAL")[0]["hosts"] for r in range(13)} == {2}
    assert lines[victim].tagged("FINAL")[0]["incarnation"] == 1
    root = {s["step"]: s for s in lines[0].tagged("STEP")}
    first = lines[victim].tagged("STEP")[0]["step"]
    assert any(victim in root[s]["used"] for s in range(first, steps))
    for r in range(13):
        assert all(s.get("exact") for s in lines[r].tagged("STEP")), r
    assert len({lines[r].tagged("FINAL")[0]["digest"] for r in range(13)}) == 1


@pytest.mark.parametrize("extra, victims", [
    ([], (5, 2)),  # a leaf (parent 1) and an intermediate (heads 7, 8, 9)
    (["--options", '{"lanes": true}'], (5, 2)),
    (["--options", '{"lanes": true}'], (1, 5)),  # a parent and its child at once
], ids=["event-loop", "lanes", "lanes-neighbours"])
def test_killed_ranks_rejoin_heal_and_contribute_again_and_impostors_are_named(
        ranks, extra, victims) -> None:
    """With lanes, each replacement and its parent and children open lanes again (from a
    step they agree on), and the job ends with every rank's chunks on lanes to its whole
    family, as it began, also between two neighbours replaced at once; without (small
    vectors), nobody opens any."""
    job: Ranks = ranks(13)
    lines: dict[int, Lines] = {}
    for r in range(13):
        die = ["--die", str(r), "--die-step", str(DIE_AT)] if r in victims else []
        lines[r] = Lines(job.start(r, *ARGS, *extra, *die, prog=SCHEMEPROG))
    old: dict[int, Lines] = {}
    for v in victims:
        assert job.procs[v].wait(60) == -9
        old[v] = lines[v]
        lines[v] = Lines(job.start(v, *ARGS, *extra, prog=SCHEMEPROG))  # the same rank, anew
    end = time.monotonic() + 60
    while any(not lines[v].tagged("STEP") for v in victims) and time.monotonic() < end:
        time.sleep(0.02)  # polling the replacements' progress: both are in the job
    assert all(lines[v].tagged("STEP") for v in victims), [lines[v].err for v in victims]

    stale = _stale_claim(job, 5)
    duplicate = subprocess.run([sys.executable, SCHEMEPROG, *ARGS, *extra], env=job.env(5),
                               capture_output=True, text=True, timeout=60)
    codes = {r: p.wait(120) for r, p in job.procs.items()}
    for r in lines:
        lines[r].join()

    assert codes == dict.fromkeys(range(13), 0), {r: lines[r].err[-5:] for r in codes}
    # The impostors: refused, and every rank's log says why.
    assert "stale incarnation 0" in stale or "refused" in stale, stale
    assert duplicate.returncode != 0
    assert "started twice" in duplicate.stderr, duplicate.stderr[-2000:]
    for r in range(13):
        err = "".join(lines[r].err)
        assert "a replaced process of rank 5 (incarnation 0" in err, (r, err[-2000:])
        assert "rank 5 was started twice" in err, (r, err[-2000:])

    # Every step every rank returned is exact; the dead processes stopped at DIE_AT.
    for v in victims:
        assert [s["step"] for s in old[v].tagged("STEP")] == list(range(DIE_AT))
    root = {s["step"]: s for s in lines[0].tagged("STEP")}
    for r in range(13):
        got = lines[r].tagged("STEP")
        assert got and all(s.get("exact") and s["rel_err"] < 1e-9 for s in got), (r, got[-1])
        if not extra:
            assert all(s["lanes"] is False and s["lane_peers"] == [] for s in got), r
        else:  # the lanes with the dead processes left, and opened again with the new ones
            assert got[-1]["lane_peers"] == FAMILY[r], (r, got[-1])
            assert all(s["lanes"] for s in got if r not in victims), r
        steps = [s["step"] for s in got]
        assert steps == list(range(steps[0], 110)), (r, steps[:5])
    # The path: away (not in the root's sums) while dead, in them again after healing.
    for v in victims:
        first = lines[v].tagged("STEP")[0]["step"]
        assert first > DIE_AT
        assert all(v not in root[s]["used"] for s in range(DIE_AT + 1, first)), v
        assert any(v in root[s]["used"] for s in range(first, 110)), v
        assert lines[v].tagged("FINAL")[0]["incarnation"] == 1
        assert any("healed from rank" in e for e in lines[v].err)
    digests = {lines[r].tagged("FINAL")[0]["digest"] for r in range(13)}
    assert len(digests) == 1  # every rank's model the same, the healed ones included


def test_a_rank_that_fell_behind_the_window_heals_by_itself(ranks) -> None:
    """Rank 5 is stopped while the job runs on past its peers' result window (two results;
    the 35 or so results sent meanwhile, 240 KB each, do not all fit in its socket buffers):
    resumed, it gets FellBehind, already healed from its parent (nobody else's code asked for
    anything), and ends with the same model as every other rank."""
    job: Ranks = ranks(13)
    args = ("coded-tree", "--state", "--steps", "60", "--pace", "0.02", "--deadline", "2",
            "--dim", "30000", "--options", '{"history_bytes": 480000}')
    lines = {r: Lines(job.start(r, *args, *(["--stop", "5", "--die-step", "5"] if r == 5
                                            else []), prog=SCHEMEPROG))
             for r in range(13)}
    end = time.monotonic() + 60
    while len(lines[0].tagged("STEP")) < 40 and time.monotonic() < end:
        time.sleep(0.02)  # polling the job's progress: well past rank 5's window
    job.procs[5].send_signal(signal.SIGCONT)
    codes = {r: p.wait(120) for r, p in job.procs.items()}
    for r in lines:
        lines[r].join()
    assert codes == dict.fromkeys(range(13), 0), {r: lines[r].err[-5:] for r in codes}
    mine = lines[5].tagged("STEP")
    behind = [s for s in mine if s.get("error") == "behind"]
    assert len(behind) == 1 and behind[0]["healed"], [s for s in mine if "error" in s]
    steps = [s["step"] for s in mine]
    at = steps.index(behind[0]["step"])
    assert steps[:at + 1] == list(range(at + 1)) and steps[at + 1] >= 40  # a jump ahead
    assert steps[at + 1:] == list(range(steps[at + 1], 60))
    assert all(s["rel_err"] < 1e-9 for s in mine if "error" not in s)
    assert any("healed from rank 1" in e for e in lines[5].err)
    digests = {lines[r].tagged("FINAL")[0]["digest"] for r in range(13)}
    assert len(digests) == 1


# The short soaks' length: kills come from step 40 until 150 steps before the end (the last
# victim's time to heal), so the first victim's replacement has about 110 steps (2.2 s at the
# pace) to be back for the second kill. With 250 it had 60, which a replacement missed once in
# the README's fresh venv on a slow hour (one kill, not two). With two pytest workers on 2
# cores 300 missed too (the suite runs serially), and the ring's soak found a gap in healing,
# fixed since (docs/heal.md, "A plain step that some ranks finished").
SHORT_STEPS = 300


@pytest.mark.parametrize("lanes", [False, True], ids=["event-loop", "lanes"])
def test_chaos_soak_short(lanes: bool) -> None:
    """The chaos soak's short version (see heal_soak.py): random ranks killed and restarted
    by the launcher while the job runs; exit 0, every step exact, identical models. With
    lanes, every replacement and its family open theirs again (each rank ends with lanes to
    the peers it began with)."""
    from .heal_soak import HealSoak, check

    soak = HealSoak(steps=SHORT_STEPS, every=40, pace=0.02, seed=1, lanes=lanes)
    rep = soak.report(soak.run())
    assert rep["kills"] >= 2, rep
    assert rep["lanes_as_at_start"] == (13 if lanes else 0), rep
    assert check(rep) == [], (rep, soak.err[-40:])


def test_chaos_soak_short_with_the_root_among_the_victims() -> None:
    """The same with rank 0 (the rendezvous and the coded tree's root) killed first: the
    launcher restarts it at its address, it takes the job's table from a live rank, heals,
    and the step it died in runs again with it on every rank."""
    from .heal_soak import HealSoak, check

    soak = HealSoak(steps=SHORT_STEPS, every=40, pace=0.02, seed=2, root_too=True)
    rep = soak.report(soak.run())
    assert rep["kills"] >= 2 and rep["killed"][0] == 0, rep  # the path under test
    assert rep["incarnations"][0] == 1 and rep["steps_run_again"] >= 1, rep
    assert check(rep) == [], (rep, soak.err[-40:])


# (The tree's seed kills rank 4 first, whose children are leaves: they send before they wait
# for the result, the order that once dropped their sends to the replacement.)
@pytest.mark.parametrize("scheme, n, seed", [("ring", 8, 2), ("transpose", 4, 2), ("tree", 15, 4)])
def test_chaos_soak_short_ring_transpose_and_tree(scheme: str, n: int, seed: int) -> None:
    """The short soaks of the schemes whose step fails when a rank dies: it waits for the
    replacement the launcher starts and runs again with it; the same result on every rank,
    identical models. The transpose's replacements and their peers open their lanes again
    (every rank ends with lanes to every other). The tree is binary and uncoded, 4 levels:
    most victims have ranks above them that never talk to them, and learn the death from
    the step's verdict; a victim's children send to its replacement again."""
    from .heal_soak import HealSoak, check

    lanes = scheme == "transpose"
    soak = HealSoak(steps=SHORT_STEPS, every=40, pace=0.02, seed=seed, scheme=scheme, ranks=n,
                    lanes=lanes)
    rep = soak.report(soak.run())
    assert rep["kills"] >= 2 and rep["steps_run_again"] == rep["kills"], rep
    # (A ring's segments always go on lanes, opened again after every kill.)
    assert rep["lanes_as_at_start"] == (n if lanes or scheme == "ring" else 0), rep
    assert check(rep) == [], (rep, soak.err[-40:])


@pytest.mark.parametrize("scheme, n", [("ring", 8), ("transpose", 4)])
def test_chaos_soak_short_that_goes_on_without_the_victims(scheme: str, n: int) -> None:
    """The short soaks with a rejoin wait shorter than a restart: after every kill the steps
    run without the victim (re-formed) until its replacement healed and was taken back;
    every step exact over the ranks it used, identical models. The transpose's members open
    new lanes at every change, the replacement taken back too (every rank ends with lanes
    to every other)."""
    from .heal_soak import HealSoak, check

    lanes = scheme == "transpose"
    # (0.05 s: shorter than any replacement takes to start Python and rejoin)
    soak = HealSoak(steps=SHORT_STEPS, every=40, pace=0.02, seed=3, scheme=scheme, ranks=n,
                    rejoin_wait=0.05, lanes=lanes)
    rep = soak.report(soak.run())
    assert rep["kills"] >= 2 and rep["kills_left_out"] == rep["kills"], rep
    assert rep["lanes_as_at_start"] == (n if lanes or scheme == "ring" else 0), rep
    assert check(rep) == [], (rep, soak.err[-40:])


def test_ranks_that_left_a_group_at_different_steps_are_named_on_every_rank() -> None:
    # groupprog.py: rank 3 dies in a group of steps; rank 1 runs one step more of it (as a
    # rank does that finished the step the others failed) before replace_lost(). Running
    # the group again would pair different steps: every live rank raises, named, instead.
    prog = Path(__file__).resolve().parent / "groupprog.py"
    res = subprocess.run([sys.executable, "-m", "aioreduce_launch.cli", "-n", "4",
                          "--restart", "1", "--kill-timeout", "2", "--", sys.executable,
                          str(prog)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in (0, 1, 2):
        assert (f"[{rank}] MISMATCH rank {rank}: ranks [3] died while some ranks had finished "
                "a step of the group that others had not (rank 0 at step 4, rank 1 at step 5, "
                "rank 2 at step 4)") in res.stdout, res.stdout + res.stderr[-2000:]


@pytest.mark.parametrize("old_port", ["closed", "silent"])
def test_a_groups_last_step_that_some_ranks_finished_is_taken_by_those_that_did_not(
        old_port: str, tmp_path: Path) -> None:
    # rollprog.py: rank 3 is killed as it is about to send the ring's last all-gather
    # segment of group 1's last step, to rank 0: ranks 1 and 2 finish the step and go on,
    # rank 0 cannot. Rank 0 takes the step's result from a rank that finished it; group 2
    # fails at once on every rank, the replacement heals, and the group runs with it. (With
    # last=False the job ends there: rank 0 waits in replace_lost() for ranks already in
    # the next group.) "silent": rank 3's old port accepts and never answers (CI once met
    # that: another process's listener had taken it). Rank 0's dial for group 2 reaches it
    # and hangs until the replacement registers, or until a peer whose lane to rank 3
    # broke reports the step failed; either way the group runs again as above (before,
    # where the dial outlived the step's failure, rank 0 waited out the handshake timeout
    # and the job ended on an AuthError; docs/status.md has the runs). Which comes first is
    # timing: the check below asks that the old port was dialed, not which failure won.
    prog = Path(__file__).resolve().parent / "rollprog.py"
    dialed = tmp_path / "dialed"
    env = dict(os.environ, ROLL_SILENT_OLD_PORT=str(dialed) if old_port == "silent" else "")
    res = subprocess.run([sys.executable, "-m", "aioreduce_launch.cli", "-n", "4",
                          "--restart", "1", "--kill-timeout", "2", "--", sys.executable,
                          str(prog)], capture_output=True, text=True, timeout=120, env=env)
    out = res.stdout + res.stderr[-3000:]
    assert res.returncode == 0, out
    if old_port == "silent":
        assert dialed.exists(), out  # the old port was dialed (and answered nothing)
        _wait_gone(str(prog))  # the silent listener's holder ends with the launcher
    for rank in range(4):
        # Every group's sums exact on every rank that ran it (the replacement: from group 2).
        for g in range(2 if rank == 3 else 0, 4):
            want = [10.0 * (g + 1) * (k + 1) * 1000 for k in range(3)]
            assert f"[{rank}] GROUP {g} {want}" in res.stdout, (rank, g, out)
    # Rank 0 (and no rank that finished) took the step from a peer, the path meant here.
    assert "[0] ROLLED 1" in res.stdout and "[1] ROLLED 0" in res.stdout, out
    assert "[0] rank 0: step 5 failed here when ranks [3] died, but rank " in res.stderr, out
    assert "killed by SIGKILL; restarting it" in res.stderr, out


def test_a_plain_step_that_some_ranks_finished_is_taken_by_those_that_did_not() -> None:
    # rollprog.py with ROLL_PLAIN=1: the same death as above, in plain steps (each runs again
    # by itself). Ranks 1 and 2 finish step 5 and fail step 6; rank 0 fails step 5 and takes
    # it from one of them; every rank then runs step 6 again with the replacement. (Before,
    # the live ranks looked for agreement at different steps and the job ended on rank 0's
    # PeerLost: found by a short ring soak on two loaded cores, where deaths fall in this
    # window more often.)
    prog = Path(__file__).resolve().parent / "rollprog.py"
    res = subprocess.run([sys.executable, "-m", "aioreduce_launch.cli", "-n", "4",
                          "--restart", "1", "--kill-timeout", "2", "--", sys.executable,
                          str(prog)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, ROLL_PLAIN="1"))
    out = res.stdout + res.stderr[-3000:]
    assert res.returncode == 0, out
    # The path: rank 3 died in step 5's window, ranks 1 and 2 finished that step, rank 0
    # took it from one of them.
    assert "killed by SIGKILL; restarting it" in res.stderr, out
    assert "[0] rank 0: step 5 failed here when ranks [3] died, but rank " in res.stderr, out
    assert "[1] rank 1: step 5 failed" not in res.stderr, out
    for rank in range(4):  # every step exact on every rank that ran it
        for i in range(6 if rank == 3 else 0, 12):
            g, k = divmod(i, 3)
            assert f"[{rank}] STEP {i} {10.0 * (g + 1) * (k + 1) * 1000}" in res.stdout, (rank, i)


@pytest.mark.parametrize("scheme", ["ring", "transpose"])
def test_a_ring_goes_on_without_a_rank_that_does_not_come_back_and_takes_it_back(
        ranks, scheme: str) -> None:
    """Ring (and transpose, its dead rank's shard re-cut over the others), 4 ranks,
    ``rejoin_wait`` 1 s: rank 2 dies and nothing restarts it, so the step
    it failed runs again over ranks 0, 1 and 3 (the live members agree on that through rank
    0) and the job goes on with them; a replacement started later heals, is left out by its
    neighbour's answer, asks rank 0 to take it back, and the ring runs over all four again
    from a step boundary. Every step exact over the ranks it used, every model the same."""
    job: Ranks = ranks(4)
    args = (scheme, "--state", "--steps", "90", "--pace", "0.03", "--dim", "20000")
    wait = {"AIOREDUCE_REJOIN_WAIT": "1"}
    lines = {r: Lines(job.start(r, *args, *(["--die", "2", "--die-step", "8"] if r == 2
                                            else []), prog=SCHEMEPROG, **wait))
             for r in range(4)}
    assert job.procs[2].wait(60) == -9
    old = lines[2]
    end = time.monotonic() + 60
    while (not any(s.get("used") == [0, 1, 3] for s in lines[0].tagged("STEP"))
           and time.monotonic() < end):
        time.sleep(0.02)  # polling the job's progress: it goes on without rank 2
    left_at = len(lines[0].tagged("STEP"))
    lines[2] = Lines(job.start(2, *args, prog=SCHEMEPROG, **wait))  # the same rank, anew
    codes = {r: p.wait(120) for r, p in job.procs.items()}
    for r in lines:
        lines[r].join()
    assert codes == dict.fromkeys(range(4), 0), {r: lines[r].err[-8:] for r in codes}

    assert [s["step"] for s in old.tagged("STEP")] == list(range(8))
    root = lines[0].tagged("STEP")
    without = [s["step"] for s in root if s["used"] == [0, 1, 3]]
    back = lines[2].tagged("STEP")
    assert without and back, (root[-3:], lines[2].err[-8:])
    assert back[0]["step"] > max(without) >= left_at - 1
    # The step rank 2 failed ran again without it, as the next step; from the first step of
    # its replacement every step uses all four again.
    failed = next(s for s in root if s["step"] == 8)
    assert failed["retried"] and failed["used"] == [0, 1, 3], failed
    assert all(s["used"] == [0, 1, 2, 3] for s in root if s["step"] >= back[0]["step"])
    assert all(s["used"] == [0, 1, 2, 3] for s in root if s["step"] < 8)
    for r in range(4):
        got = lines[r].tagged("STEP")
        assert got and all("error" not in s and s["rel_err"] < 1e-9 for s in got), (r, got[-1])
    errs = "".join(lines[0].err)
    assert "ranks [2] did not come back within 1 s; the steps run over the 3 others" in errs
    assert "ranks [2] healed; the steps take them back at step" in errs
    assert any("asking rank 0 to take it back" in e for e in lines[2].err)
    assert lines[2].tagged("FINAL")[0]["incarnation"] == 1
    digests = {lines[r].tagged("FINAL")[0]["digest"] for r in range(4)}
    assert len(digests) == 1  # every rank's model the same, the one taken back included


def test_groups_that_do_not_mark_their_last_step_take_a_late_replacement_back(ranks) -> None:
    """backprog.py: groups of 3 ring steps, none marked ``last``, 4 ranks, ``rejoin_wait``
    1 s. Rank 2 dies in group 3 and nothing restarts it: the group runs again over ranks 0,
    1 and 3, and the job goes on with them. A replacement started later heals, asks rank 0
    to take it back, and is taken back at a step of a group (where the groups start is not
    known here): that group fails on every member and runs again over all four. Every
    group's sums exact over the ranks it used, every rank ends at the same group."""
    job: Ranks = ranks(4)
    prog = str(Path(__file__).resolve().parent / "backprog.py")
    wait = {"AIOREDUCE_REJOIN_WAIT": "1"}
    lines = {r: Lines(job.start(r, prog=prog, **wait)) for r in range(4)}
    assert job.procs[2].wait(60) == -9
    end = time.monotonic() + 60
    while (not any(s["used"] == [0, 1, 3] for s in lines[0].tagged("GROUP"))
           and time.monotonic() < end):
        time.sleep(0.02)  # polling the job's progress: it goes on without rank 2
    lines[2] = Lines(job.start(2, prog=prog, **wait))  # the same rank, anew
    codes = {r: p.wait(120) for r, p in job.procs.items()}
    for r in lines:
        lines[r].join()
    assert codes == dict.fromkeys(range(4), 0), {r: lines[r].err[-8:] for r in codes}
    groups = {r: lines[r].tagged("GROUP") for r in range(4)}
    for r, got in groups.items():
        for grp in got:
            g, used = grp["g"], grp["used"]
            want = [float(sum(u + 1 for u in used) * (g + 1) * (k + 1) * 1000)
                    for k in range(3)]
            assert grp["sums"] == want, (r, grp)
    root = [grp["used"] for grp in groups[0]]
    assert root[:3] == [[0, 1, 2, 3]] * 3 and root[3] == [0, 1, 3], root[:5]
    assert root[-1] == [0, 1, 2, 3], root[-3:]
    back = groups[2]
    assert back and back[0]["g"] == groups[0][-1]["g"], (back, groups[0][-3:])
    ends = {lines[r].out[-1].strip() for r in (0, 1, 3)}
    assert ends == {f"END {groups[0][-1]['g'] + 1} taken_back=False"}, ends
    assert lines[2].out[-1].strip() == f"END {groups[0][-1]['g'] + 1} taken_back=True"
    errs = "".join(lines[0].err)
    assert "ranks [2] did not come back within 1 s; the steps run over the 3 others" in errs
    assert "ranks [2] healed; the steps take them back at step" in errs
    assert any("asking rank 0 to take it back" in e for e in lines[2].err)


@pytest.mark.parametrize("scheme, n", [("coded-tree", 13), ("ring", 4)])
def test_rank_0_killed_is_replaced_at_its_address_and_heals(ranks, scheme: str, n: int) -> None:
    """Rank 0 (the rendezvous, the coded tree's root) is SIGKILLed and restarted at its
    address: the others dial it until the new process listens, the first to reach it tells
    it the job runs, and it takes rank 0's next incarnation, heals the step and the model
    from a live peer and runs on with them; the step it died in runs again with it (the
    others wait for it: ``rejoin_wait``). Every step exact on every rank, every model the
    same; the job ends as usual, rank 0's last barrier included."""
    job: Ranks = ranks(n)
    args = (scheme, "--state", "--steps", "60", "--pace", "0.03", "--deadline", "2",
            "--dim", "1000")
    wait = {"AIOREDUCE_REJOIN_WAIT": "60"}
    lines = {r: Lines(job.start(r, *args, *(["--die", "0", "--die-step", str(DIE_AT)]
                                            if r == 0 else []), prog=SCHEMEPROG, **wait))
             for r in range(n)}
    assert job.procs[0].wait(60) == -9
    old = lines[0]
    lines[0] = Lines(job.start(0, *args, prog=SCHEMEPROG, **wait))  # the same rank, anew
    codes = {r: p.wait(120) for r, p in job.procs.items()}
    for r in lines:
        lines[r].join()
    assert codes == dict.fromkeys(range(n), 0), "\n".join(
        f"rank {r} exited {c}:\n" + "".join(lines[r].err[-40:]) for r, c in codes.items() if c)
    assert [s["step"] for s in old.tagged("STEP")] == list(range(DIE_AT))
    back = lines[0].tagged("STEP")
    assert back and back[0]["step"] >= DIE_AT, back[:2]
    assert lines[0].tagged("FINAL")[0]["incarnation"] == 1
    assert any("rank 0 rejoined the running job as incarnation 1" in e for e in lines[0].err)
    assert any("healed from rank" in e for e in lines[0].err), lines[0].err[-5:]
    # The step rank 0 died in ran again, as the next step, with the new rank 0: it sums the
    # others' vectors of that step and the newcomer's of the next (its first), so it is
    # checked to be the same sum on every rank; every other step is exact.
    rerun = back[0]["result_step"]
    again: dict[int, str] = {}
    for r in range(n):
        got = lines[r].tagged("STEP")
        assert got and all("error" not in s for s in got), (r, [s for s in got if "error" in s])
        assert all(s["rel_err"] < 1e-9 for s in got if s["result_step"] != rerun), r
        assert [s["result_step"] for s in got].count(rerun) == 1, r
        again[r] = next(s["value"] for s in got if s["result_step"] == rerun)
        assert got[-1]["result_step"] == 59
    assert len(set(again.values())) == 1, again
    assert all(s["retried"] for r in range(1, n) for s in lines[r].tagged("STEP")
               if s["result_step"] == rerun)  # the path: the others ran it again
    assert any(0 in s["used"] for s in back)  # its contribution is in the sums again
    digests = {lines[r].tagged("FINAL")[0]["digest"] for r in range(n)}
    assert len(digests) == 1  # every rank's model the same, the new rank 0's included


def test_rank_0_and_a_leaf_killed_together_both_come_back(ranks) -> None:
    """Rank 0 and leaf 5 are SIGKILLed at once and restarted together, the leaf first: its
    replacement may register with the new rank 0 before any live rank has told that one the
    job runs; it is then admitted as a replacement too (the next incarnation, the others
    told). Both heal; every step on every rank returns; every model the same at the end."""
    job: Ranks = ranks(13)
    args = ("coded-tree", "--state", "--steps", "60", "--pace", "0.03", "--deadline", "2",
            "--dim", "1000")
    wait = {"AIOREDUCE_REJOIN_WAIT": "60"}
    lines = {r: Lines(job.start(r, *args, prog=SCHEMEPROG, **wait)) for r in range(13)}
    end = time.monotonic() + 60
    while len(lines[12].tagged("STEP")) < DIE_AT and time.monotonic() < end:
        time.sleep(0.01)  # polling the job's progress
    for r in (0, 5):
        job.procs[r].kill()
    for r in (0, 5):
        assert job.procs[r].wait(60) == -9
    for r in (5, 0):  # the leaf's replacement first
        lines[r] = Lines(job.start(r, *args, prog=SCHEMEPROG, **wait))
    codes = {r: p.wait(120) for r, p in job.procs.items()}
    for r in lines:
        lines[r].join()
    assert codes == dict.fromkeys(range(13), 0), "\n".join(
        f"rank {r} exited {c}:\n" + "".join(lines[r].err[-40:]) for r, c in codes.items() if c)
    for r in (0, 5):
        assert lines[r].tagged("FINAL")[0]["incarnation"] == 1, r
        assert any("healed from rank" in e for e in lines[r].err), (r, lines[r].err[-5:])
        assert lines[r].tagged("STEP"), r
    # Either way in: registered with the new rank 0 before or after it heard the job runs.
    err0 = "".join(lines[0].err)
    assert ("ranks [5] registered before a live rank said the job runs" in err0
            or "rank 0: rank 5 rejoined as incarnation 1" in err0), err0[-3000:]
    for r in range(13):
        errors = [(s["step"], s["missing"], s["message"]) for s in lines[r].tagged("STEP")
                  if "error" in s]
        assert not errors, (r, errors, "".join(lines[r].err[-20:]))
    digests = {lines[r].tagged("FINAL")[0]["digest"] for r in range(13)}
    assert len(digests) == 1


def _wait_gone(marker: str, timeout: float = 30) -> None:
    """Every process whose command line names ``marker`` exits within ``timeout`` (waited
    for on its pidfd, not polled)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() not in (entry / "cmdline").read_bytes():
                continue
            fd = os.pidfd_open(int(entry.name))
        except OSError:  # gone meanwhile
            continue
        try:
            ready, _w, _x = select.select([fd], [], [], timeout)
            assert ready, f"process {entry.name} still runs"
        finally:
            os.close(fd)
