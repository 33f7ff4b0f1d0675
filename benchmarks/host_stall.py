"""Run a command while the whole host stalls now and then, as a hypervisor's or a noisy
neighbour's stall does: every core taken at once for a burst, at a fixed period.

``python benchmarks/host_stall.py [--procs 2] [--burst 0.08] [--period 0.9] -- CMD...``
starts ``procs`` busy processes (one per core to stall the whole host; at nice -20 where
the user may raise priority, so they take the cores from the ranks), each spinning for
``burst`` seconds in every ``period``, runs ``CMD``, stops them and exits with CMD's status.
Used for the transpose's calm steps under host stalls (docs/transpose.md, "A stall of the
whole host"): ``python benchmarks/host_stall.py -- aioreduce-bench allreduce --scheme
transpose,ring --nodes 4 --size 16M --iters 200 --in-place``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import time


def _spin(burst: float, period: float, stop: mp.synchronize.Event) -> None:
    with contextlib.suppress(OSError):  # not allowed: the bursts take the cores all the same
        os.nice(-20)
    while not stop.is_set():
        began = time.monotonic()
        while time.monotonic() - began < burst:
            pass
        stop.wait(max(0.0, period - burst))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 1,
                        help="busy processes (default: one per core)")
    parser.add_argument("--burst", type=float, default=0.08, help="seconds each stall lasts")
    parser.add_argument("--period", type=float, default=0.9, help="seconds between stalls")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    opts = parser.parse_args()
    cmd = opts.cmd[1:] if opts.cmd[:1] == ["--"] else opts.cmd
    if not cmd or not 0 < opts.burst < opts.period:
        parser.error("give a command after --, and 0 < burst < period")
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(opts.burst, opts.period, stop), daemon=True)
                for _ in range(opts.procs)]
    for spinner in spinners:
        spinner.start()
    try:
        return subprocess.run(cmd, check=False).returncode
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join(timeout=5)
            if spinner.is_alive():
                spinner.kill()


if __name__ == "__main__":
    sys.exit(main())
