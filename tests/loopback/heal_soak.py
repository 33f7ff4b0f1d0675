"""Chaos soak of healing: ``aioreduce-launch -n 13 --restart 50`` runs the coded tree (3, 2, 1)
with a model (``schemeprog.py --state``) while a controller SIGKILLs a random rank other than 0
(``--root-too``: rank 0 too, the rendezvous and the tree's root, but not the last rank, whose
lines then say how far the job is) about every ``--every`` steps (intermediate ranks
included; the next kill waits until the last victim's replacement is back in the job, so two
ranks of one family are never away at once).
``--scheme ring --ranks 8``, ``--scheme transpose --ranks 4``, ``--scheme tree --ranks 15``
(binary, uncoded) and ``--scheme star --ranks 6``: the same for the schemes whose step that
lost a rank waits for the replacement and runs again
(``AIOREDUCE_REJOIN_WAIT``, which the launcher sets). ``--rejoin-wait S`` sets it shorter
than a replacement takes to start (0.05 s is; on an idle machine 0.2 s may not be): the ring
then runs again without the victim, re-formed over the live ranks, and takes the replacement
back once it healed (checked: every kill left the victim out of at least one root step, and
it was used again). The same for the transpose, whose dead rank's shard is then cut over the
others.

Checked: the launcher exits 0; every step every rank returned is exact (a ring step run again
sums the replacement's vector of the next step with the others' of this one: those steps are
checked to be the same on every rank instead); every rank's final model is identical; every
kill was answered by a replacement that healed. Printed: the kills, and the time from each kill
to the replacement's first step and to the first root step whose sum used it again (medians
and maxima). Run the long versions as scripts (exit 1 on a failed check)::

    python -m tests.loopback.heal_soak --steps 1000 --every 60
    python -m tests.loopback.heal_soak --scheme ring --ranks 8 --steps 1000 --every 60
    python -m tests.loopback.heal_soak --scheme transpose --ranks 4 --steps 1000 --every 60
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import psutil

from .harness import SCHEMEPROG

STALL_S = 60.0  # past its budget, a job whose observer has not stepped for this long is stuck


@dataclass
class Kill:
    rank: int
    at_step: int  # the root's step count when it was killed
    wall: float  # time.time() of the kill
    back_step: float | None = None  # seconds until the replacement's first step ended
    used_again: float | None = None  # seconds until the root's sum used it again


@dataclass
class HealSoak:
    steps: int
    every: int
    pace: float
    seed: int = 0
    scheme: str = "coded-tree"
    ranks: int = 13
    rejoin_wait: float | None = None  # None: the launcher's (60 s)
    # Rank 0 among the victims too (the rendezvous, a tree's root); the job's progress is
    # then read from the last rank, which is never killed.
    root_too: bool = False
    # The coded tree's chunks on lanes (--options '{"lanes": true}'; the ring's and the
    # transpose's are by default): every replacement and its peers open them again, checked
    # at the end (each rank's lane peers as at its start; a ring's: its steps on lanes).
    lanes: bool = False
    dim: int = 1000  # the vector's elements (float32): larger shows what a heal costs later
    steps_of: dict[int, list[dict]] = field(default_factory=dict)
    finals: dict[int, dict] = field(default_factory=dict)
    err: list[str] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)

    def _read(self, pipe) -> None:  # type: ignore[no-untyped-def]
        for line in pipe:
            rank_tag, _, rest = line.partition(" ")
            tag, _, body = rest.partition(" ")
            if not rank_tag.startswith("[") or tag not in ("STEP", "FINAL"):
                continue
            rank = int(rank_tag.strip("[]"))
            record = json.loads(body)
            record["_t"] = time.time()
            if tag == "STEP":
                self.steps_of.setdefault(rank, []).append(record)
            else:
                self.finals[rank] = record

    def _read_err(self, pipe) -> None:  # type: ignore[no-untyped-def]
        for line in pipe:
            self.err.append(line)

    def _pid_of(self, launcher: psutil.Process, rank: int) -> int | None:
        for child in launcher.children():
            try:
                if child.environ().get("RANK") == str(rank):
                    return child.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return None

    @property
    def observer(self) -> int:
        """The rank whose lines say how far the job is (rank 0, unless it may be killed)."""
        return self.ranks - 1 if self.root_too else 0

    def _back(self, kill: Kill) -> bool:
        """Is ``kill``'s rank back (its replacement stepped, the root used it)?"""
        inc = sum(k.rank == kill.rank for k in self.kills[:self.kills.index(kill) + 1])
        mine = [s for s in self.steps_of.get(kill.rank, []) if s.get("inc") == inc]
        if mine and kill.back_step is None:
            kill.back_step = mine[0]["t1"] - kill.wall
        root = [s for s in list(self.steps_of.get(self.observer, []))
                if s.get("t1", 0) > kill.wall and kill.rank in (s.get("used") or [])]
        if root and kill.used_again is None:
            kill.used_again = root[0]["t1"] - kill.wall
        return kill.back_step is not None and kill.used_again is not None

    def run(self) -> int:
        rng = random.Random(self.seed)
        cmd = [sys.executable, "-m", "aioreduce_launch.cli", "-n", str(self.ranks),
               "--restart", "50", "--", sys.executable, SCHEMEPROG, self.scheme, "--state",
               "--steps",
               str(self.steps), "--pace", str(self.pace), "--deadline", "2", "--dim", str(self.dim)]
        if self.lanes and self.scheme in ("coded-tree", "tree", "star"):  # (the transpose: always)
            cmd += ["--options", json.dumps({"lanes": True})]
        if self.scheme == "tree":  # binary: a leaf's death fails the step far from the root
            cmd += ["--fanout", "2", "--stragglers", "0"]
        env = dict(os.environ)
        if self.rejoin_wait is not None:
            env["AIOREDUCE_REJOIN_WAIT"] = str(self.rejoin_wait)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=env)
        readers = [threading.Thread(target=f, args=(p,), daemon=True)
                   for f, p in ((self._read, proc.stdout), (self._read_err, proc.stderr))]
        for t in readers:
            t.start()
        launcher = psutil.Process(proc.pid)
        next_kill = self.every
        quiet_from = self.steps - max(3 * self.every, 150)  # let the last victim heal
        # The job's time: steps x pace, six times over, and two minutes for its start and end.
        # Past that it may go on while its steps still come (a large --dim takes longer a
        # step than the pace), up to four times as long; a job whose observer has not
        # stepped for STALL_S is stuck.
        budget = self.steps * self.pace * 6 + 120
        start = time.monotonic()
        deadline, last = start + budget, (0, start)
        code: int | None = None
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if now >= deadline and (now - last[1] > STALL_S or now >= start + 4 * budget):
                    break
                time.sleep(0.01)  # polling the job's progress and the last victim's return
                done = len(self.steps_of.get(self.observer, []))
                if done != last[0]:
                    last = (done, now)
                if self.kills and not self._back(self.kills[-1]):
                    continue
                if done >= next_kill and done < quiet_from:
                    victim = (rng.randrange(0, self.ranks - 1) if self.root_too
                              else rng.randrange(1, self.ranks))
                    pid = self._pid_of(launcher, victim)
                    if pid is None:
                        continue
                    os.killpg(pid, signal.SIGKILL)
                    self.kills.append(Kill(victim, done, time.time()))
                    next_kill = done + self.every + rng.randrange(-self.every // 4,
                                                                 self.every // 4 + 1)
            # A job that does not end is reported below, with what it had done.
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(1.0)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            for t in readers:
                t.join(10)
        for k in self.kills:
            self._back(k)
        if code is None:
            raise AssertionError(f"the job did not end within {time.monotonic() - start:.0f} s "
                                 f"(budget {budget:.0f} s): {self.progress()}")
        return code

    def progress(self) -> str:
        """Where each rank was, the kills, and the launcher's last lines (stderr: the steps
        are on stdout): what a soak that did not end leaves to go on."""
        last = {r: (got[-1]["step"], got[-1].get("inc")) for r, got in
                sorted(self.steps_of.items()) if got}
        kills = [(k.rank, k.at_step, k.back_step is not None, k.used_again is not None)
                 for k in self.kills]
        lines = [x.rstrip() for x in self.err[-60:]]
        return (f"last (step, incarnation) per rank {last}; kills (rank, at step, stepped, "
                f"used again) {kills}; stderr's last lines:\n" + "\n".join(lines))

    def report(self, code: int) -> dict:
        again = {s["result_step"] for got in self.steps_of.values() for s in got
                 if s.get("retried")}
        wrong = [(r, s["step"]) for r, got in self.steps_of.items() for s in got
                 if "error" in s or (s["rel_err"] >= 1e-9 and s["result_step"] not in again)]
        # A step run again: what every rank got (the replacement's line is its first step).
        rerun: dict[int, set[str]] = {}
        for got in self.steps_of.values():
            for s in got:
                if s.get("result_step") in again:
                    rerun.setdefault(s["result_step"], set()).add(s["value"])
        digests = {f["digest"] for f in self.finals.values()}
        back = [k.back_step for k in self.kills if k.back_step is not None]
        used = [k.used_again for k in self.kills if k.used_again is not None]
        restarts = sum("restarting it" in line for line in self.err)
        healed = sum("healed from rank" in line for line in self.err)
        root = self.steps_of.get(self.observer, [])
        left_out = sum(any(s.get("t1", 0) > k.wall and "used" in s and k.rank not in s["used"]
                           for s in root) for k in self.kills)
        return {
            "launcher_exit": code, "steps": self.steps, "kills": len(self.kills),
            "killed": [k.rank for k in self.kills], "restarts": restarts, "healed": healed,
            "wrong_steps": len(wrong), "ranks_with_final": len(self.finals),
            "steps_run_again": len(rerun),
            "steps_run_again_differing": sum(len(v) > 1 for v in rerun.values()),
            "final_models_identical": len(digests) == 1 and len(self.finals) == self.ranks,
            "root_steps": len(root),
            # step numbers the observer's steps run again took (one per attempt)
            "root_steps_taken_by_reruns": sum(s["result_step"] - s["step"] for s in root
                                              if "result_step" in s),
            "observer": self.observer,
            "kill_to_first_step_s": _stats(back), "kill_to_used_again_s": _stats(used),
            "incarnations": {r: f.get("incarnation") for r, f in sorted(self.finals.items())},
            "rejoin_wait": self.rejoin_wait,
            # kills after which the root ran steps without the victim (a re-formed ring)
            "kills_left_out": left_out,
            "root_steps_without_a_rank": sum(len(s["used"]) < self.ranks for s in root
                                             if "used" in s),
            "lanes": self.lanes,
            # the observer's median step (its own part: Result.seconds) before the first
            # kill and over the last 100 steps (every victim back): what healing left behind
            "step_ms_before_kills": _median_ms([s for s in root if s.get("t1", 0) <
                                                min((k.wall for k in self.kills),
                                                    default=float("inf"))][5:]),
            "step_ms_last_100": _median_ms(root[-100:]),
            # ranks whose last step had lanes to the same peers as their first
            "lanes_as_at_start": sum(
                _lanes_as_at_start(self.steps_of.get(r, [])) for r in range(self.ranks)),
        }


def _lanes_as_at_start(steps: list[dict]) -> bool:
    """Whether a rank's last step ran on lanes to the same peers as its first. A ring's
    session names no lane peers (``lane_peers`` None: every rank has lanes to its two
    neighbours, opened again after every change), so there its steps' ``lanes`` flag says
    it: the first and the last ran on lanes."""
    if not steps:
        return False
    first, last = steps[0], steps[-1]
    if last.get("lane_peers") is None:
        return bool(first.get("lanes")) and bool(last.get("lanes"))
    return first.get("lane_peers") == last.get("lane_peers") and bool(last["lane_peers"])


def _median_ms(steps: list[dict]) -> float | None:
    xs = [s["seconds"] for s in steps if "seconds" in s and "error" not in s]
    return round(1e3 * statistics.median(xs), 2) if xs else None


def _stats(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median": round(statistics.median(xs), 2), "max": round(max(xs), 2),
            "n": len(xs)}


def check(rep: dict) -> list[str]:
    """What failed (empty: every check held)."""
    bad = []
    if rep["launcher_exit"] != 0:
        bad.append(f"launcher exited {rep['launcher_exit']}")
    if rep["wrong_steps"]:
        bad.append(f"{rep['wrong_steps']} steps not exact")
    if rep["steps_run_again_differing"]:
        bad.append(f"{rep['steps_run_again_differing']} steps run again differ between ranks")
    if not rep["final_models_identical"]:
        bad.append("final models differ (or a rank printed none)")
    if rep["restarts"] != rep["kills"] or rep["healed"] != rep["kills"]:
        bad.append(f"{rep['kills']} kills, {rep['restarts']} restarts, {rep['healed']} heals")
    if rep["rejoin_wait"] is not None and rep["kills_left_out"] != rep["kills"]:
        bad.append(f"{rep['kills']} kills, the steps left the victim out after "
                   f"{rep['kills_left_out']}")
    if rep["lanes"] and rep["lanes_as_at_start"] != rep["ranks_with_final"]:
        bad.append(f"{rep['lanes_as_at_start']} ranks ended with lanes to the peers they "
                   "began with")
    if rep["root_steps"] != rep["steps"] - rep["root_steps_taken_by_reruns"]:
        bad.append(f"the root did {rep['root_steps']} of {rep['steps']} steps "
                   f"({rep['root_steps_taken_by_reruns']} step numbers taken by reruns)")
    return bad


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=60)
    p.add_argument("--pace", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheme", default="coded-tree",
                   choices=["coded-tree", "tree", "star", "ring", "transpose"])
    p.add_argument("--ranks", type=int, default=13)
    p.add_argument("--rejoin-wait", type=float, default=None,
                   help="seconds a failed ring step waits for a replacement (default: the "
                        "launcher's 60); shorter than a restart: the ring re-forms")
    p.add_argument("--dim", type=int, default=1000, help="vector elements (float32)")
    p.add_argument("--lanes", action="store_true",
                   help="the coded tree's chunks on lanes (the ring's and the transpose's are "
                        "anyway), opened again with every replacement (checked)")
    p.add_argument("--root-too", action="store_true",
                   help="rank 0 (the rendezvous, the tree's root) may be killed too; the last "
                        "rank is not")
    p.add_argument("--log", type=argparse.FileType("w"), default=None,
                   help="write every line the launcher and the ranks wrote to stderr here")
    args = p.parse_args()
    soak = HealSoak(args.steps, args.every, args.pace, args.seed, args.scheme, args.ranks,
                    rejoin_wait=args.rejoin_wait, root_too=args.root_too, lanes=args.lanes,
                    dim=args.dim)
    rep = soak.report(soak.run())
    print(json.dumps(rep, indent=1))
    bad = check(rep)
    for line in bad:
        print("FAILED:", line)
    if args.log is not None:
        args.log.write("".join(soak.err))
    if bad:
        sys.stderr.write("".join(soak.err[-60:]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
