"""Accuracy of the bounded-time transpose allreduce under loss: ``examples/logreg.py`` on
N local ranks with 0 / 1 / 5 % of slices dropped on arrival, with the Hadamard rotation
always, only after a loss (the default) and never, zero-filled (OptiReduce) or rescaled
(unbiased), against the exact single-process reference. Prints a Markdown table. ``final
loss`` is the exact loss of rank 0's parameters at the last step (the same point as the
reference's last loss).

    python benchmarks/transpose_accuracy.py [--ranks 8] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGREG = str(ROOT / "examples" / "logreg.py")


def summary(out: str) -> dict[str, object]:
    for line in out.splitlines():
        if "SUMMARY " in line:
            return json.loads(line.split("SUMMARY ", 1)[1])  # type: ignore[no-any-return]
    raise RuntimeError(f"no SUMMARY line in:\n{out[-2000:]}")


def run(cmd: list[str]) -> dict[str, object]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return summary(proc.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--losses", default="0,0.01,0.05")
    a = p.parse_args()
    ref = run([sys.executable, LOGREG, "--reference", "--steps", str(a.steps)])
    exact = float(ref["final_loss"])  # type: ignore[arg-type]
    print(f"logreg, {a.ranks} ranks, {a.steps} steps (10 warm-up steps without loss); "
          f"exact reference final loss {exact:.6f}\n")
    print("| dropped slices | Hadamard | missing | final loss | vs exact | mean received |")
    print("|---|---|---|---|---|---|")
    for loss in (float(x) for x in a.losses.split(",")):
        for missing in ("zero", "rescale") if loss else ("zero",):
            for hadamard in ("always", "after_loss", "never"):
                cmd = [sys.executable, "-m", "aioreduce_launch.cli", "-n", str(a.ranks), "--",
                       sys.executable, LOGREG, "--scheme", "transpose", "--steps",
                       str(a.steps), "--loss", str(loss), "--missing", missing]
                got = run([*cmd, "--hadamard", hadamard])
                final = float(got["final_loss"])  # type: ignore[arg-type]
                received = float(got["received"])  # type: ignore[arg-type]
                print(f"| {loss:.0%} | {hadamard} | {missing} | "
                      f"{final:.6f} | {final / exact - 1:+.2%} | {received:.2%} |",
                      flush=True)


if __name__ == "__main__":
    main()
