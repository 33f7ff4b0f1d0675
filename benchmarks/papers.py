"""The papers' experiments from one command: the dose-response runs, the code comparison, the
OptiReduce tail and time to accuracy, the simulator scored out of sample, and
``reproduction.md`` made from what they wrote.

    python benchmarks/papers.py [--out DIR] [--quick]

Every step is a command of its own (the ones the docs name), run in turn; its results land in
``DIR`` (``dose/*.jsonl``, ``optireduce/{tail,tta}.jsonl``, ``sweep/out_of_sample.*``) and
``DIR/commands.md`` lists each command with its results file and how long it took, so every
number of ``DIR/reproduction.md`` can be traced to a file and a command. The cluster sweep
and its held-out cell are not run again (hours on this machine): they are read from
``docs/sweep``, made by the commands in its README.

``--quick`` (CI): the same steps at the smallest sizes that still make every table (one or
two cluster sizes, two doses, two launches, a few steps), emulated hosts only as root, no time
to accuracy, the simulator's out-of-sample scores read from ``docs/sweep``: minutes, and a
check that the whole chain runs, not figures to quote. Without torch (an optional extra),
the tail runs without Gloo and there is no time to accuracy; ``commands.md`` says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = [sys.executable, "-m", "aioreduce.bench.cli"]
NETNS = ["--netns", "--link-mbit", "1000", "--latency", "0.0001"]
CODES = 'gc+code="default",gc+code="gaussian"'
SWEEPS = ("", "heldout", "heldout-params")  # under docs/sweep: the sweeps scored out of sample


@dataclass(frozen=True)
class Step:
    """One command; ``results``: the file it leaves (``None``: it writes its own); ``lines``:
    keep only the output lines that start so (a benchmark's JSON or ``RESULT`` rows)."""

    name: str
    argv: list[str]
    results: Path | None = None
    copied_from: Path | None = None  # the command's own output file, copied to ``results``
    lines: str = ""


def steps(out: Path, quick: bool, root: bool, torch: bool) -> list[Step]:
    netns = NETNS if root else []
    dose = out / "dose"
    if quick:
        common = ["--repeats", "2", "--iters", "3", "--warmup", "1", *netns]
        runs = [("delay", ["--nodes", "7", "--delays", "0,0.2"]),
                ("slow", ["--nodes", "7", "--slow", "1,3", "--compute", "0.05"]),
                ("codes-40k", ["--nodes", "13", "--slow", "1", "--compute", "0.05",
                               "--straggle", "all:load-exp=2", "--scheme", CODES])]
        tail = ["--nodes", "4", "--size", "256K", "--iters", "10"]
    else:
        common = ["--repeats", "3", "--iters", "8", "--warmup", "3", *netns]
        runs = [("delay", ["--nodes", "7,13", "--delays", "0,0.05,0.2,0.5"]),
                ("delay-large", ["--nodes", "21,31,40", "--delays", "0,0.05,0.5",
                                 "--repeats", "2", "--iters", "6"]),
                ("slow", ["--nodes", "13", "--slow", "1,2,3,5", "--compute", "0.05"]),
                ("codes-40k", ["--nodes", "13,40", "--slow", "1", "--compute", "0.05",
                               "--straggle", "all:load-exp=2", "--scheme", CODES]),
                ("codes-4m", ["--nodes", "13,40", "--slow", "1", "--compute", "0.05",
                              "--straggle", "all:load-exp=2", "--scheme", CODES,
                              "--size", "4M"])]
        tail = ["--nodes", "4", "--size", "1M", "--iters", "300"]
    plan = [Step(f"dose: {name}", [*BENCH, "dose", "--out", str(dose / name), *common, *extra],
                 dose / f"{name}.jsonl", dose / name / "results.jsonl")
            for name, extra in runs]
    plan.append(Step("OptiReduce: tail", [
        *BENCH, "allreduce", *tail, "--scheme", "transpose,ring",
        *(["--vs-gloo"] if torch else []),
        "--compute", "0.2", "--straggle", "all:shifted-exp=0.002,500;all:spike=0.005,0.2",
        "--options", '{"max_loss": 1}', "--gc-every", "50", "--json"],
        out / "optireduce" / "tail.jsonl", lines="{"))
    if not quick and root and torch:
        plan.append(Step("OptiReduce: time to accuracy", [
            sys.executable, str(ROOT / "benchmarks" / "time_to_accuracy.py"), "--hosts", "8",
            "--flows", "16", "--repeats", "1", "--json"],
            out / "optireduce" / "tta.jsonl", lines="RESULT"))
    # The simulator scored on every sweep it was not fitted to: the main one's held-out
    # splits, and the sweeps of other cluster sizes and of new straggler parameters (the
    # advisor's margin over the simple rules is counted over all of them).
    sweeps = [ROOT / "docs" / "sweep" / sub for sub in SWEEPS]
    scores = [(sweep if quick else out / "sweep" / sub) / "out_of_sample.json"
              for sub, sweep in zip(SWEEPS, sweeps, strict=True)]
    if not quick:
        for sub, sweep in zip(SWEEPS, sweeps, strict=True):
            plan.append(Step(f"simulator out of sample{': ' + sub if sub else ''}", [
                sys.executable, str(ROOT / "benchmarks" / "sim_out_of_sample.py"), "--sweep",
                str(sweep), "--out", str(out / "sweep" / sub / "out_of_sample.md")]))
    plan.append(Step("reproduction.md", [
        sys.executable, str(ROOT / "benchmarks" / "reproduction.py"), "--sweep",
        str(ROOT / "docs" / "sweep"), "--dose", str(dose), "--optireduce",
        str(out / "optireduce"), "--scores", *map(str, scores), "--out",
        str(out / "reproduction.md"), *(["--sim-steps", "3"] if quick else [])],
        out / "reproduction.md"))
    return plan


def run(step: Step) -> float:
    """Run ``step``; its seconds. Raises if the command fails."""
    t0 = time.perf_counter()
    if step.results is not None:
        step.results.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(step.argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{step.name}: exit {proc.returncode}: {' '.join(step.argv)}")
    if step.lines and step.results is not None:
        with step.results.open("a") as f:
            f.writelines(line + "\n" for line in proc.stdout.splitlines()
                         if line.startswith(step.lines))
    if step.copied_from is not None and step.results is not None:
        shutil.copyfile(step.copied_from, step.results)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("papers"))
    ap.add_argument("--quick", action="store_true", help="minutes, for CI (see above)")
    opts = ap.parse_args()
    out = opts.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)  # (each step makes its results folder: run)
    root = os.geteuid() == 0
    torch = importlib.util.find_spec("torch") is not None  # Gloo, and DDP's time to accuracy
    log = ["# Commands behind this directory", "",
           f"`python benchmarks/papers.py --out {opts.out}{' --quick' if opts.quick else ''}`"
           f"{'' if root else ' (not root: no emulated hosts)'}"
           f"{'' if torch else ' (no torch: no Gloo, no time to accuracy)'}; the sweep and "
           "its held-out "
           "cell are read from `docs/sweep` (its README has their commands).", "",
           "| step | command | results | seconds |", "|---|---|---|---|"]
    total = 0.0
    for step in steps(out, opts.quick, root, torch):
        took = run(step)
        total += took
        shown = " ".join(a if " " not in a and '"' not in a else repr(a) for a in step.argv)
        where = step.results.relative_to(out) if step.results is not None else "-"
        log.append(f"| {step.name} | `{shown}` | `{where}` | {took:.0f} |")
        print(f"{step.name}: {took:.0f} s", flush=True)
    log.append(f"| all | | | {total:.0f} |")
    (out / "commands.md").write_text("\n".join(log) + "\n")
    print(f"{out / 'reproduction.md'} in {total / 60:.1f} min")


if __name__ == "__main__":
    main()
