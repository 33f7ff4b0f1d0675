"""Equal CPU shares for emulated hosts: each host's processes in a cgroup of their own with a
CPU quota, so that contention is explicit and the same whatever the number of hosts (40
ranks on 2 cores otherwise get whatever the scheduler gives each, and a rank that does more
work, a tree's root, takes cores from the others).

A quota of ``cpus`` means ``cpus`` x the period of CPU time per period (cgroup v2's
``cpu.max``, or v1's ``cpu.cfs_quota_us``): 0.05 is a twentieth of one core. The period is
short (10 ms, longer only where the quota would fall below the kernel's least, 1 ms): a group
that spends its quota waits for the next period, and with the kernel's default of 100 ms a
4-rank ring held to 0.05 CPU each kept its median step and got a P99 of 195 ms, every rank
stalling for most of a period at once. The groups live under one parent named after the
cluster and are removed at teardown.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from .owner import orphaned

PERIOD_US = 10_000
MIN_QUOTA_US = 1_000
_V2 = Path("/sys/fs/cgroup")
_V1 = Path("/sys/fs/cgroup/cpu")


def _root() -> tuple[Path, bool] | None:
    """Where CPU groups can be made here, and whether it is cgroup v2."""
    if (_V2 / "cgroup.controllers").exists():
        if "cpu" in (_V2 / "cgroup.controllers").read_text().split():
            return _V2, True
        return None
    if (_V1 / "cpu.cfs_quota_us").exists():
        return _V1, False
    return None


def unavailable() -> str | None:
    """Why CPU shares cannot be set here, or None."""
    root = _root()
    if root is None:
        return "no cgroup cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us) on this machine"
    probe = root[0] / f"aioreduce-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError as exc:
        return f"cannot create a cgroup under {root[0]}: {exc}"
    probe.rmdir()
    return None


class CpuShares:
    """One CPU group per host under ``parent``, each allowed ``cpus`` CPUs."""

    def __init__(self, parent: str, hosts: int, cpus: float) -> None:
        if cpus <= 0:
            raise ValueError(f"a host's CPU share must be positive, not {cpus}")
        root = _root()
        if root is None:
            raise RuntimeError(unavailable() or "no cgroup cpu controller")
        self.base, self.v2 = root[0] / parent, root[1]
        self.hosts, self.cpus = hosts, cpus
        self.made: list[Path] = []

    def group(self, i: int) -> Path:
        """Host ``i``'s group."""
        return self.base / f"h{i}"

    def create(self) -> None:
        """Make the groups and set their quotas."""
        period = max(PERIOD_US, round(MIN_QUOTA_US / self.cpus))
        quota = max(MIN_QUOTA_US, round(self.cpus * period))
        self.base.mkdir()
        self.made.append(self.base)
        if self.v2:  # the children may only use what the parent hands down
            (self.base / "cgroup.subtree_control").write_text("+cpu")
        for i in range(self.hosts):
            group = self.group(i)
            group.mkdir()
            self.made.append(group)
            if self.v2:
                (group / "cpu.max").write_text(f"{quota} {period}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(period))
                (group / "cpu.cfs_quota_us").write_text(str(quota))

    def argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` started inside host ``i``'s group (its children stay in it)."""
        procs = shlex.quote(str(self.group(i) / "cgroup.procs"))
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]

    def throttled(self, i: int) -> int:
        """How many periods host ``i``'s group ran out of its quota so far."""
        for line in (self.group(i) / "cpu.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "nr_throttled":
                return int(value)
        return 0

    def remove(self) -> None:
        """Kill what still runs in the groups and remove them. Idempotent."""
        _remove(reversed(self.made))
        self.made.clear()


def _remove(groups: Iterable[Path], timeout: float = 5.0) -> None:
    """Kill what runs in each group, then remove it (children before their parent)."""
    deadline = time.monotonic() + timeout
    for group in groups:
        while True:
            with contextlib.suppress(OSError):
                for pid in (group / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # busy: a killed process has not left it yet
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)


def remove_stale(prefix: str) -> list[str]:
    """Remove the groups of clusters (``<prefix><pid>-...``) whose creating process is gone;
    return their paths."""
    root = _root()
    if root is None:
        return []
    removed = []
    for parent in root[0].glob(f"{prefix}*"):
        if parent.is_dir() and orphaned(parent.name, prefix):
            _remove([*(p for p in parent.iterdir() if p.is_dir()), parent])
            removed.append(str(parent))
    return removed
