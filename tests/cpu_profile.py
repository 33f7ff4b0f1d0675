"""Where the suite's time goes: per test, wall seconds against the whole machine's busy CPU
seconds (``/proc/stat``, so the rank processes a test starts count, reaped or not).

A serial suite on a machine with few cores is bound by one of two things per test: its CPU
(torch start-ups, many ranks) or its waiting (deadlines, paced steps, a replacement's start).
Only the waiting can be cut without cutting what a test runs; this says which tests wait.

Record (a pytest plugin), then summarise::

    python -m pytest -p tests.cpu_profile            # appends to suite-cpu.tsv (CPU_PROFILE)
    python -m tests.cpu_profile suite-cpu.tsv        # by module and the tests that wait most

``idle`` is core-seconds the machine had and did not use while the test ran
(cores x wall - busy); other processes on the machine count as the test's.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent not idle since boot (every core)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / _TICK  # less idle and iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, None, None]:
    t0, b0 = time.monotonic(), busy_seconds()
    yield
    wall, busy = time.monotonic() - t0, busy_seconds() - b0
    with open(os.environ.get("CPU_PROFILE", "suite-cpu.tsv"), "a") as out:
        out.write(f"{item.nodeid}\t{wall:.2f}\t{busy:.2f}\n")


def summary(path: Path, cores: int, top: int) -> str:
    """The recorded tests by module (most idle first) and the ``top`` tests that wait most."""
    rows: list[tuple[str, float, float]] = []
    for line in path.read_text().splitlines():
        nodeid, wall_s, busy_s = line.split("\t")
        rows.append((nodeid, float(wall_s), float(busy_s)))
    wall_total = sum(w for _n, w, _b in rows)
    busy_total = sum(b for _n, _w, b in rows)
    lines = [f"{len(rows)} tests, {wall_total:.0f} s wall, {busy_total:.0f} CPU-s busy on "
             f"{cores} cores: {busy_total / (cores * wall_total):.0%} used; at full use "
             f"{busy_total / cores:.0f} s", "", "  idle    wall    busy  tests  module"]
    by_module: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for nodeid, wall, busy in rows:
        m = by_module[nodeid.split("::", 1)[0]]
        m[0] += wall
        m[1] += busy
        m[2] += 1
    for module, (wall, busy, n) in sorted(by_module.items(),
                                          key=lambda kv: kv[1][1] - cores * kv[1][0]):
        lines.append(f"{cores * wall - busy:6.0f} {wall:7.1f} {busy:7.1f} {n:6.0f}  {module}")
    lines += ["", "  idle    wall    busy  test"]
    for nodeid, wall, busy in sorted(rows, key=lambda r: r[2] - cores * r[1])[:top]:
        lines.append(f"{cores * wall - busy:6.1f} {wall:7.1f} {busy:7.1f}  {nodeid}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tsv", type=Path)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    print(summary(args.tsv, args.cores, args.top))


if __name__ == "__main__":
    main()
