"""Straggler-model soaks: every injected model (``AIOREDUCE_STRAGGLE``, see
:mod:`aioreduce.straggle`) under every scheme, on real ranks over 127.0.0.1, every result
checked on every rank.

Each run starts the ranks of one scheme (``schemeprog.py``, a compute of ``--pace`` seconds a
step, as a trainer's) with one model; the node itself injects the delays. Checked:

* every rank exits 0 and reports every step once, in order, of its own step number (no frame
  of one step used in another);
* a step that returned is exact (relative error below 1e-9) wherever the scheme says so: the
  coded schemes decode the exact sum without their late ranks, the ring, the tree and the
  star wait for everyone; the bounded-time transpose cuts late data (its ``max_loss`` 1 here:
  the soak checks the accounting, not the valve), and a step of it that lost nothing is exact;
* the coded schemes: the ranks agree on each step's used and late ranks, and a step that
  fails (too many late in one family) fails on every rank, as a ``StragglerError`` that names
  the missing ranks;
* the transpose: a step that lost something names its late ranks and reports what it
  received (below 1), and one that lost nothing names none;
* the model bit: a step left out a rank the model delayed past the deadline, and was exact
  (the coded schemes) or accounted for (the transpose, under the intermittent models: it
  follows a rank slow at every step as it follows a slower network), so the path that
  leaves stragglers out was taken; in the waiting schemes the steps took the injected delays
  (reported, not checked: a wall-clock figure);
* a rank far behind its peers (a straggler whose lag outlasts several of their steps) may
  jump ahead with ``FellBehind``; nowhere else is a step skipped.

Figures printed per run: steps that left a delayed rank out, failed steps (a coded step
without a sufficient set, or a rank's jump ahead), data lost (the transpose), the median and
p99 of the step time of ranks the model did not delay at that step. Run the long version as a script
(exit 1 on a failed check)::

    python -m tests.loopback.straggle_soak --steps 200            # every scheme x model
    python -m tests.loopback.straggle_soak --scheme coded-tree --model spike --steps 400
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from aioreduce.straggle import StraggleModel, parse_straggle

from .harness import SCHEMEPROG, Ranks

EXACT = 1e-9
PACE = 0.1  # each step's compute (slow and load-exp stretch it)
# The tolerant schemes' deadline: from the step's start, the rank's own compute included.
DEADLINE = PACE + 0.15


@dataclass(frozen=True)
class Setup:
    """How a scheme is run: its ranks, its arguments, and what a late rank does to a step."""

    ranks: int
    args: tuple[str, ...]
    kind: str  # "coded" (late ranks left out, exact), "waits" (every step exact), "bounded"


SETUPS = {
    "coded-tree": Setup(13, ("--fanout", "3", "--levels", "2", "--stragglers", "1",
                             "--deadline", str(DEADLINE)), "coded"),
    "gc-cyclic": Setup(7, ("--stragglers", "1", "--deadline", str(DEADLINE)), "coded"),
    "tree": Setup(7, ("--fanout", "2",), "waits"),
    "star": Setup(4, (), "waits"),
    "ring": Setup(4, (), "waits"),
    # (Its clocks set the stage bounds: no fixed deadline.)
    "transpose": Setup(4, ("--options", json.dumps({"max_loss": 1.0, "deadline": None})),
                       "bounded"),
}


# Delays far past the deadline where a rank is to be late (a loaded machine's jitter is tens of
# milliseconds) and near zero otherwise, so that "late" is the model's doing. LAST: the job's
# last rank, a leaf in every setup (never the coded tree's root or a gradient-coding master).
MODELS = {
    "delay": "rank=LAST:delay=0.4",
    "slow": "rank=LAST:slow=5",  # a 0.1 s compute becomes 0.5 s
    # (Rarer delays past the deadline left a 30-step run without one the tree could show.)
    "shifted-exp": "all:shifted-exp=0.001,10",  # mean 0.1 s: P(> 0.2 s) ~ 0.13
    "load-exp": "all:load-exp=1",  # compute x Exp(1): mean 0.1 s
    "spike": "all:spike=0.03,0.4",
    "pause": "all:pause=0.3,0.5",  # one rank a step (the root's: nobody is late)
}
# The bounded-time transpose follows a rank that is slow step after step (its bound adapts, as
# to a slower network) and cuts the intermittent ones.
PERSISTENT = frozenset({"delay", "slow"})
DELAYED_S = DEADLINE - PACE + 0.05  # a rank held back this much is delayed on purpose


def delayed(model: StraggleModel, step: int, n: int) -> list[int]:
    """The ranks ``model`` holds back past the deadline at ``step`` (with margin)."""
    return [r for r in range(n) if model.extra_delay(r, step, PACE, n) > DELAYED_S]


@dataclass
class Run:
    scheme: str
    model: str
    steps: int
    seed: int
    problems: list[str] = field(default_factory=list)
    figures: dict[str, object] = field(default_factory=dict)
    lines: dict[int, list[dict]] = field(default_factory=dict)  # every rank's step lines

    @property
    def ok(self) -> bool:
        return not self.problems


def soak(scheme: str, model: str, steps: int, seed: int = 0, lanes: bool = False,
         timeout: float = 600.0) -> Run:
    """One run of ``scheme`` under ``model``: its processes started, waited for, checked."""
    setup = SETUPS[scheme]
    args = list(setup.args)
    if lanes:
        args += ["--options", json.dumps({"lanes": True, **_options(args)})]
    job = Ranks(setup.ranks)
    spec = MODELS[model].replace("LAST", str(setup.ranks - 1))
    try:
        job.start_all(scheme, "--steps", str(steps), "--pace", str(PACE), *args,
                      prog=SCHEMEPROG, AIOREDUCE_STRAGGLE=spec,
                      AIOREDUCE_STRAGGLE_SEED=str(seed))
        done = job.wait(timeout)
    finally:
        job.kill()
    run = Run(scheme, model, steps, seed)
    lines = run.lines
    for rank, d in done.items():
        if d.returncode != 0:
            run.problems.append(f"rank {rank} exited {d.returncode}: {d.err[-1500:]}")
        lines[rank] = [json.loads(x[5:]) for x in d.out.splitlines() if x.startswith("STEP ")]
    check(run, setup, parse_straggle(spec, seed), lines, lanes)
    return run


def _options(args: list[str]) -> dict[str, object]:
    """The JSON of a setup's ``--options``, taken out of ``args`` (lanes are added to it)."""
    if "--options" not in args:
        return {}
    i = args.index("--options")
    opts: dict[str, object] = json.loads(args[i + 1])
    del args[i:i + 2]
    return opts


def check(run: Run, setup: Setup, model: StraggleModel, lines: dict[int, list[dict]],
          lanes: bool) -> None:
    """Everything the module docstring lists, into ``run.problems`` and ``run.figures``."""
    n, steps, bad = setup.ranks, run.steps, run.problems
    for rank, got in lines.items():
        if not _in_order(got, steps):
            bad.append(f"rank {rank} reported steps {[s['step'] for s in got][:30]}..., not "
                       f"0..{steps - 1} in order (ahead only after FellBehind)")
        for s in got:
            if s.get("error") == "behind" and setup.kind != "waits":
                continue  # far behind its peers (see _in_order): it jumps to their step
            if "error" in s:
                if setup.kind != "coded":
                    bad.append(f"rank {rank} step {s['step']}: {s['error']} ({s['message']}) "
                               f"in a scheme that {setup.kind}")
                elif s["error"] != "straggler" or not s["missing"]:
                    bad.append(f"rank {rank} step {s['step']}: failed without naming the "
                               f"missing ranks: {s}")
                continue
            if s["result_step"] != s["step"]:
                bad.append(f"rank {rank} step {s['step']}: the result of step "
                           f"{s['result_step']}")
            if lanes and s["lanes"] is not True:
                bad.append(f"rank {rank} step {s['step']}: not on lanes")
            lost_nothing = s["received"] is None or s["received"] >= 1.0
            if setup.kind == "bounded":
                if lost_nothing != (not s["late"]):
                    bad.append(f"rank {rank} step {s['step']}: received {s['received']} "
                               f"with late ranks {s['late']}")
                if lost_nothing and not (s["exact"] and s["rel_err"] < EXACT):
                    bad.append(f"rank {rank} step {s['step']}: lost nothing, not exact: "
                               f"{s['rel_err']}")
            elif not (s["exact"] and s["rel_err"] < EXACT):
                bad.append(f"rank {rank} step {s['step']}: not exact ({s['rel_err']}, "
                           f"exact={s['exact']})")
    by_step: dict[int, list[dict]] = {}
    for got in lines.values():
        for s in got:
            by_step.setdefault(s["step"], []).append(s)
    failed = [k for k, ss in by_step.items() if any("error" in s for s in ss)]
    # Steps that left a rank out which the model made late at that step, and were exact: the
    # path that skips stragglers, taken. (A coded tree leaves a child out every step by design,
    # the one it did not need: "late" alone says nothing about the model.)
    left_out = [k for k, ss in by_step.items()
                if any(r in s.get("late", ()) for s in ss if "error" not in s
                       for r in delayed(model, k, n))]
    if setup.kind == "coded":
        for k, ss in sorted(by_step.items()):
            errors = [s for s in ss if "error" in s]
            if errors and len(errors) != len(ss):
                bad.append(f"step {k}: failed on {len(errors)} of {len(ss)} ranks")
            seen = {json.dumps([s["used"], s["late"]]) for s in ss if "error" not in s}
            if len(seen) > 1:
                bad.append(f"step {k}: the ranks disagree on used and late: {sorted(seen)}")
    if not left_out and (setup.kind == "coded"
                         or (setup.kind == "bounded" and run.model not in PERSISTENT)):
        bad.append("no step left out a rank the model delayed: the path that leaves "
                   "stragglers out was not taken")
    # The step time of ranks not delayed at that step (one delayed before may still be
    # behind: its lag outlasts the steps it was delayed in).
    on_time = [s["seconds"] for rank, got in lines.items() for s in got
               if rank not in delayed(model, s["step"], n)]
    received = [s["received"] for got in lines.values() for s in got
                if s.get("received") is not None]
    run.figures = {
        "left a delayed rank out": len(left_out), "failed steps": len(failed),
        "lost %": round(100 * (1 - statistics.fmean(received)), 3) if received else 0.0,
    }
    if on_time:  # (as the bench computes its P50 and P99)
        run.figures["undelayed p50 s"] = round(float(np.median(on_time)), 3)
        run.figures["undelayed p99 s"] = round(float(np.quantile(on_time, 0.99)), 3)


def _in_order(got: list[dict], steps: int) -> bool:
    """Every step from 0 once, in order; a rank that fell behind (``FellBehind``: its peers
    are steps ahead, a straggler that cannot catch up otherwise) jumps ahead to theirs."""
    want = 0
    for s in got:
        if s["step"] != want:
            return False
        want = s["step"] + 1
        if s.get("error") == "behind":
            want = s["current"]  # where the node jumped to
    return want >= steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scheme", choices=[*SETUPS, "all"], default="all")
    p.add_argument("--model", choices=[*MODELS, "all"], default="all")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lanes", action="store_true", help="chunks and slices over lanes")
    a = p.parse_args()
    schemes = list(SETUPS) if a.scheme == "all" else [a.scheme]
    models = list(MODELS) if a.model == "all" else [a.model]
    failed = 0
    for scheme, model in itertools.product(schemes, models):
        t0 = time.monotonic()
        run = soak(scheme, model, a.steps, a.seed, a.lanes)
        print(f"{scheme:11s} {model:12s} {'OK  ' if run.ok else 'FAIL'} "
              f"{time.monotonic() - t0:6.1f} s  {json.dumps(run.figures)}", flush=True)
        for problem in run.problems[:10]:
            print(f"    {problem}", flush=True)
        failed += not run.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
