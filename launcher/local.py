"""Ranks that run on this machine, as child processes in their own process groups.

Each rank gets its own session (process group), so a signal reaches everything the rank
started, not just its first process. On Linux each rank also asks the kernel to SIGKILL it
if the launcher dies without cleaning up (``PR_SET_PDEATHSIG``), so even ``kill -9`` of the
launcher does not leave ranks running.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Sequence

from aioreduce.jobplan import RankSpec

from .output import RankOutput

_PR_SET_PDEATHSIG = 1
OUTPUT_GRACE_S = 2.0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def exit_code(returncode: int) -> int:
    """Shell convention: a death by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class LocalRank:
    """A running local rank: its process, its tagged output, its exit code."""

    def __init__(self, spec: RankSpec, proc: asyncio.subprocess.Process,
                 outputs: tuple[RankOutput, RankOutput]) -> None:
        self.rank = spec.rank
        self.host = spec.host.name
        self.proc = proc
        self.outputs = outputs
        assert proc.stdout is not None and proc.stderr is not None
        self._output = asyncio.gather(self._pump(proc.stdout, outputs[0]),
                                      self._pump(proc.stderr, outputs[1]))

    @classmethod
    async def start(cls, spec: RankSpec, argv: Sequence[str], *, tag: bool = True,
                    output_dir: str | None = None, cwd: str | None = None,
                    restarted: bool = False) -> LocalRank:
        """Start ``spec``'s rank; ``restarted``: it replaces a dead process of that rank
        (its output files go on)."""
        env = dict(os.environ)
        env.update(spec.env)
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, preexec_fn=_die_with_parent)
        outputs = (RankOutput(spec.rank, "stdout", tag=tag, copy_to=output_dir,
                              append=restarted),
                   RankOutput(spec.rank, "stderr", tag=tag, copy_to=output_dir,
                              append=restarted))
        return cls(spec, proc, outputs)

    @staticmethod
    async def _pump(stream: asyncio.StreamReader, out: RankOutput) -> None:
        while chunk := await stream.read(1 << 16):
            out.feed(chunk)
        out.close()

    async def wait(self) -> int:
        """Wait for the rank's process to exit; return its shell exit code at once."""
        rc = await self.proc.wait()
        with contextlib.suppress(TimeoutError):  # usually the output is complete by now
            await asyncio.wait_for(asyncio.shield(self._output), 0.5)
        return exit_code(rc)

    async def close(self) -> None:
        """Finish writing the rank's output (bounded) once its group is gone.

        Processes a rank left behind keep the pipes open; the supervisor kills the group when
        the job ends, after which the pipes close. Something that escaped the group is not
        waited for beyond a grace period.
        """
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._output, OUTPUT_GRACE_S)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the rank's whole process group (no-op if it is gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
