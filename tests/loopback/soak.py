"""Pause soaks: 13 real ranks of ``CodedTree(3, 2, 1)``, stopped and resumed with SIGSTOP and
SIGCONT by a controller, every result checked against the exact sum on every rank.

Scenarios:

* ``random``: one non-root rank at a time is paused for 0.2–3 s (never two in one family:
  the next pause waits until the last paused rank has caught up), one leaf is SIGKILLed
  midway. Expected: no wrong result, no error at all, no step of a rank that was not paused
  longer than deadline + 0.5 s, and every resumed rank caught up.
* ``family``: two children of the root paused together for 6 s. Expected: while they are out
  every other rank raises within deadline + 0.5 s; a few steps after their resume every step
  is exact again.
* ``intermediate``: rank 3 (which heads {10, 11, 12}) paused for two deadlines, then 20 more
  steps: every step exact on every rank, and its children take results from it again.

Run the long version as a script (figures on stdout, exit 1 on a failed check)::

    python -m tests.loopback.soak random --steps 600
    python -m tests.loopback.soak family --steps 300
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

from .harness import SCHEMEPROG, Ranks

FAMILIES = {0: [1, 2, 3], 1: [4, 5, 6], 2: [7, 8, 9], 3: [10, 11, 12]}
PARENT = {c: p for p, kids in FAMILIES.items() for c in kids}
LEAVES = [4, 5, 6, 7, 8, 9, 10, 11, 12]
MARGIN = 0.5  # the acceptance's allowance over the deadline


@dataclass
class Pause:
    ranks: tuple[int, ...]
    stop: float
    cont: float = 0.0
    caught_up: float | None = None  # seconds after SIGCONT until back at the job's step


@dataclass
class Soak:
    """One soak run: the processes, what the controller did, and what every rank printed."""

    steps: int
    deadline: float
    pace: float
    extra: tuple[str, ...] = ()  # more schemeprog arguments (e.g. chunks over lanes)
    job: Ranks = field(init=False)
    lines: dict[int, list[dict]] = field(default_factory=dict)
    logs: dict[int, list[str]] = field(default_factory=dict)  # stderr, read so it never fills
    pauses: list[Pause] = field(default_factory=list)
    killed: int | None = None
    killed_at: float = 0.0
    # When the controller began killing a job that does not end by itself: a rank still
    # running then sees its peers' connections close and raises. Lines that end after it are
    # the teardown's, not the fault's, and are not judged.
    torn_down: float | None = None
    _readers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.job = Ranks(13)
        self.job.start_all("coded-tree", "--steps", str(self.steps), "--deadline",
                           str(self.deadline), "--pace", str(self.pace), "--dim", "1000",
                           *self.extra, prog=SCHEMEPROG)
        for rank, proc in self.job.procs.items():
            self.lines[rank], self.logs[rank] = [], []
            for target in (self._read, self._read_err):
                t = threading.Thread(target=target, args=(rank, proc), daemon=True)
                t.start()
                self._readers.append(t)

    def _read(self, rank: int, proc) -> None:  # type: ignore[no-untyped-def]
        for line in proc.stdout:
            if line.startswith("STEP "):
                self.lines[rank].append(json.loads(line[5:]))

    def _read_err(self, rank: int, proc) -> None:  # type: ignore[no-untyped-def]
        for line in proc.stderr:
            self.logs[rank].append(line.rstrip())

    def progress(self, rank: int) -> int:
        """The last step ``rank`` finished (-1 before the first)."""
        got = self.lines[rank]
        return got[-1]["step"] if got else -1

    def wait_for(self, cond, timeout: float) -> bool:  # type: ignore[no-untyped-def]
        """Poll ``cond`` (progress printed by the ranks) until true or ``timeout``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if cond():
                return True
            time.sleep(0.02)  # polling the ranks' output, not waiting for an event we own
        return cond()

    def pause(self, ranks: tuple[int, ...], seconds: float) -> Pause:
        p = Pause(ranks, time.time())
        for r in ranks:
            os.kill(self.job.procs[r].pid, signal.SIGSTOP)
        time.sleep(seconds)  # the fault's duration
        for r in ranks:
            os.kill(self.job.procs[r].pid, signal.SIGCONT)
        p.cont = time.time()
        self.pauses.append(p)
        return p

    def wait_caught_up(self, p: Pause, timeout: float = 30.0) -> None:
        def level() -> bool:
            return all(self.progress(r) >= self.progress(0) - 1 for r in p.ranks)
        if self.wait_for(level, timeout):
            p.caught_up = time.time() - p.cont

    def kill(self, rank: int) -> None:
        os.kill(self.job.procs[rank].pid, signal.SIGKILL)
        self.killed, self.killed_at = rank, time.time()

    def finish(self, timeout: float) -> dict[int, int]:
        codes = {}
        end = time.monotonic() + timeout
        for rank, proc in self.job.procs.items():
            try:
                codes[rank] = proc.wait(max(0.1, end - time.monotonic()))
            except Exception:
                self.job.kill()
                codes[rank] = proc.wait(5)
        for t in self._readers:
            t.join(5)
        return codes

    # -- checks -------------------------------------------------------------------------------
    def paused_during(self, rank: int, s: dict) -> bool:
        return any(rank in p.ranks and s["t0"] <= p.cont and s["t1"] >= p.stop
                   for p in self.pauses)

    def judged(self, rank: int) -> list[dict]:
        """The lines of ``rank`` that ended before the teardown (all, for a job that ends)."""
        end = self.torn_down if self.torn_down is not None else float("inf")
        return [s for s in self.lines[rank] if s["t1"] < end]

    def report(self) -> dict:
        alive = [r for r in range(13) if r != self.killed]
        judged = {r: self.judged(r) for r in alive}
        wrong = sum(1 for r in alive for s in judged[r]
                    if "error" not in s and (not s["exact"] or s["rel_err"] >= 1e-9))
        raised = [(r, s) for r in alive for s in judged[r] if "error" in s]
        errors = len(raised)
        t_ref = self.pauses[0].stop if self.pauses else 0.0
        # Enough to tell a failed CI run's cause from its assertion message alone.
        first_errors = [f"rank {r} step {s['step']} at {s['t0'] - t_ref:+.2f}s: "
                        f"{s['error']}: {str(s.get('message', ''))[:160]}" for r, s in raised[:8]]
        unpaused = [s["t1"] - s["t0"] for r in alive for s in judged[r]
                    if not self.paused_during(r, s)]
        return {"steps": self.steps, "pauses": len(self.pauses),
                "paused_seconds": round(sum(p.cont - p.stop for p in self.pauses), 2),
                "killed": self.killed, "wrong": wrong, "errors": errors,
                "first_errors": first_errors,
                "max_unpaused_step": round(max(unpaused, default=0.0), 3),
                "median_step": round(statistics.median(unpaused), 4) if unpaused else None,
                "max_catch_up": max((p.caught_up or 0 for p in self.pauses), default=0.0),
                "not_caught_up": sum(p.caught_up is None for p in self.pauses),
                "complete": all(len(self.lines[r]) >= self.steps and
                                [s["step"] for s in self.lines[r]]
                                == list(range(len(self.lines[r]))) for r in alive)}


def random_soak(steps: int, seed: int, deadline: float = 2.0, pace: float = 0.02,
                extra: tuple[str, ...] = ()) -> Soak:
    """At least ``steps`` steps, two pauses and the kill, whatever the host's speed: the ranks
    run until the controller has done all three and every live rank is past ``steps``, then
    the job is torn down (a fixed step count let a fast host finish before the kill)."""
    rng = random.Random(seed)
    soak = Soak(10 ** 6, deadline, pace, extra)
    soak.start()
    soak.steps = steps
    try:
        soak.wait_for(lambda: soak.progress(0) >= 5, 60)
        while (soak.progress(0) < steps or len(soak.pauses) < 2 or soak.killed is None) and (
                soak.job.procs[0].poll() is None):
            if soak.killed is None and (soak.progress(0) >= steps // 2 or len(soak.pauses) >= 2):
                soak.kill(rng.choice(LEAVES))
            barred = {soak.killed} | set(FAMILIES.get(PARENT.get(soak.killed, -1), []))
            rank = rng.choice([r for r in range(1, 13) if r not in barred])
            p = soak.pause((rank,), rng.uniform(0.2, 3.0))
            soak.wait_caught_up(p)  # so that no family has two ranks out at once
            soak.wait_for(lambda: False, rng.uniform(0.2, 1.0))  # a gap between faults
        alive = [r for r in range(13) if r != soak.killed]
        soak.wait_for(lambda: min(soak.progress(r) for r in alive) >= steps, 120)
    finally:
        soak.torn_down = time.time()
        soak.job.kill()
        for t in soak._readers:
            t.join(5)
    return soak


def family_soak(steps: int, deadline: float = 2.0, pace: float = 0.02,
                seconds: float = 6.0, extra: tuple[str, ...] = ()) -> Soak:
    soak = Soak(steps, deadline, pace, extra)
    soak.start()
    try:
        soak.wait_for(lambda: soak.progress(0) >= 20, 60)
        p = soak.pause((1, 2), seconds)
        soak.wait_caught_up(p)
        soak.finish(steps * 1.0 + 120)
    finally:
        soak.job.kill()
    return soak


def intermediate_soak(deadline: float = 1.0, pace: float = 0.02, after: int = 20,
                      extra: tuple[str, ...] = ()) -> Soak:
    soak = Soak(0, deadline, pace, extra)
    soak.steps = 10 ** 6  # set below, once the pause is over
    soak.start()
    try:
        soak.wait_for(lambda: soak.progress(0) >= 5, 60)
        p = soak.pause((3,), 2 * deadline)
        soak.wait_caught_up(p)
        end = soak.progress(0) + after
        soak.wait_for(lambda: min(soak.progress(r) for r in range(13)) >= end, 120)
        # How many steps rank 3's children take to take its results again is timing (one hop
        # more than rank 0's answer, see the test), so the soak runs on until each has had
        # ``after // 2`` healthy steps in a row since it caught up, or for ``after`` steps more.
        if p.caught_up is not None:
            level = p.cont + p.caught_up

            def healthy_run(rank: int) -> int:
                """Healthy steps in a row at the end of ``rank``'s lines since the catch-up."""
                links = [s["link"] for s in list(soak.lines[rank]) if s["t0"] >= level]
                return sum(1 for _ in itertools.takewhile(lambda x: x == "healthy",
                                                          reversed(links)))

            def settled() -> bool:
                return min(healthy_run(k) for k in (10, 11, 12)) >= after // 2
            more = soak.progress(0) + after
            soak.wait_for(lambda: settled() or soak.progress(0) >= more, 120)
    finally:
        soak.torn_down = time.time()
        soak.job.kill()
        for t in soak._readers:
            t.join(5)
    soak.steps = min(len(v) for v in soak.lines.values())
    return soak


def family_check(soak: Soak) -> dict:
    """During the double pause every other rank raised within deadline + margin; after it,
    the number of steps until every step is exact again."""
    p = soak.pauses[0]
    slow_errors, recover = 0, []
    for r in range(3, 13):
        for s in soak.lines[r]:
            if "error" in s and s["t1"] - s["t0"] > soak.deadline + MARGIN:
                slow_errors += 1
        after = [s for s in soak.lines[r] if s["t0"] >= p.cont]
        bad = [i for i, s in enumerate(after) if "error" in s or s["rel_err"] >= 1e-9]
        recover.append(bad[-1] + 1 if bad else 0)
    errors = [s for r in range(3, 13) for s in soak.lines[r] if "error" in s]
    return {"errors_while_out": len(errors), "slow_errors": slow_errors,
            "max_error_seconds": round(max((s["t1"] - s["t0"] for s in errors), default=0), 3),
            "steps_until_exact_after_resume": max(recover),
            "wrong": sum(1 for r in range(13) for s in soak.lines[r]
                         if "error" not in s and s["rel_err"] >= 1e-9)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", choices=["random", "family", "intermediate"])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=2.0)
    ap.add_argument("--pace", type=float, default=0.02)
    ap.add_argument("--dump", help="write every rank's step lines and the pauses here (JSON)")
    a = ap.parse_args(argv)
    t = time.monotonic()
    if a.scenario == "random":
        soak = random_soak(a.steps, a.seed, a.deadline, a.pace)
        rep = soak.report()
        ok = (rep["wrong"] == 0 and rep["errors"] == 0 and rep["complete"]
              and rep["max_unpaused_step"] <= a.deadline + MARGIN
              and rep["not_caught_up"] == 0)
    elif a.scenario == "family":
        soak = family_soak(a.steps, a.deadline, a.pace)
        rep = {**soak.report(), **family_check(soak)}
        ok = rep["wrong"] == 0 and rep["slow_errors"] == 0 and rep["complete"]
    else:
        soak = intermediate_soak(a.deadline, a.pace)
        rep = soak.report()
        rep["links_at_end"] = {r: soak.judged(r)[-1]["link"] for r in (10, 11, 12)}
        ok = rep["wrong"] == 0 and rep["errors"] == 0
    rep["pause_log"] = [(p.ranks, round(p.cont - p.stop, 2), p.caught_up and
                         round(p.caught_up, 2)) for p in soak.pauses]
    rep["wall_seconds"] = round(time.monotonic() - t, 1)
    if a.dump:
        with open(a.dump, "w") as f:
            json.dump({"lines": soak.lines, "logs": soak.logs,
                       "killed": [soak.killed, soak.killed_at],
                       "pauses": [[p.ranks, p.stop, p.cont] for p in soak.pauses]}, f)
    print(json.dumps(rep, indent=1))
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
