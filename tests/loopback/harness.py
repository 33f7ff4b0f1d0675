"""Start real rank processes on 127.0.0.1 with the launcher's env contract, and clean up.

Every process gets its own process group; :class:`Ranks` kills the groups it started (and only
those) when the test ends, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from aioreduce.jobplan import HostSlots, JobConfig, RankSpec, free_ports, plan_ranks

HERE = Path(__file__).parent
RANKPROG = str(HERE / "rankprog.py")
SCHEMEPROG = str(HERE / "schemeprog.py")
BARRIERPROG = str(HERE / "barrierprog.py")


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has ended; a pid gone mid-check has too)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(pids: list[int], within: float = 5.0) -> bool:
    """Whether every one of ``pids`` has ended within ``within`` seconds.

    These are not our children (the launcher or agent started them), so there is no wait() to
    block on; polling /proc is the only event there is.
    """
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@dataclass
class Done:
    rank: int
    returncode: int
    out: str
    err: str


class Ranks:
    """The processes of one test job."""

    def __init__(self, n: int) -> None:
        master, rendezvous = free_ports(2)
        self.job = JobConfig(master_addr="127.0.0.1", master_port=master,
                             rendezvous_port=rendezvous)
        # With the host's cores known, as aioreduce-launch plans local ranks: one BLAS thread
        # per rank. Without it, 4 ranks on 2 cores each ran a BLAS thread per core and a
        # 160 KB transpose step took 50 ms instead of 16 (13 under the launcher).
        self.specs: list[RankSpec] = plan_ranks(
            [HostSlots("localhost", n, cores=os.cpu_count())], self.job)
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self._drained: dict[int, tuple[list[str], list[str]]] = {}
        self._readers: list[threading.Thread] = []

    def env(self, rank: int, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.specs[rank].env)
        env.update(extra)
        return env

    def start(self, rank: int, *args: str, prog: str = RANKPROG,
              **extra_env: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, prog, *args], env=self.env(rank, **extra_env),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        self.procs[rank] = proc
        return proc

    def start_all(self, *args: str, prog: str = RANKPROG, **extra_env: str) -> None:
        for rank in range(len(self.specs)):
            self.start(rank, *args, prog=prog, **extra_env)

    def drain(self) -> None:
        """Read every rank's output in the background from now on (a rank that prints more
        than a pipe holds would otherwise block in ``print`` while the test waits)."""
        for rank, proc in self.procs.items():
            if rank in self._drained:
                continue
            bufs: tuple[list[str], list[str]] = ([], [])
            self._drained[rank] = bufs
            for pipe, buf in zip((proc.stdout, proc.stderr), bufs, strict=True):
                assert pipe is not None
                thread = threading.Thread(target=lambda p=pipe, b=buf: b.extend(p), daemon=True)
                thread.start()
                self._readers.append(thread)

    def output(self, rank: int) -> str:
        """What ``rank`` has printed on stdout so far (after :meth:`drain`)."""
        return "".join(list(self._drained[rank][0]))

    def wait(self, timeout: float = 60.0) -> dict[int, Done]:
        """Wait for every started rank (reading all their output at once); on timeout kill
        them all and fail with their output."""
        self.drain()
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                for thread in self._readers:
                    thread.join(timeout=10)
                outputs = {r: ("".join(o)[-3000:], "".join(e)[-3000:])
                           for r, (o, e) in self._drained.items()}
                raise AssertionError(f"ranks still running after {timeout} s: {outputs}"
                                     ) from None
        for thread in self._readers:
            thread.join(timeout=30)
        return {rank: Done(rank, proc.returncode, "".join(self._drained[rank][0]),
                           "".join(self._drained[rank][1]))
                for rank, proc in self.procs.items()}

    def kill(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
