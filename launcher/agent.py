"""The remote agent: ``python -m aioreduce_launch.agent``, one per host, started over SSH.

It talks to the launcher with msgpack messages on its stdin and stdout, never with a command
line that ``ps`` would show:

* launcher to agent: ``{"t": "start", "argv", "cwd", "ranks": [{"rank", "env"}], "heartbeat",
  "kill_timeout", "torch_store"?}`` once (the env carries the job secret; ``torch_store``,
  ``[addr, port]``: serve torch's store there, see :mod:`.torchstore`), then ``{"t":
  "signal", "sig", "rank"?}``, ``{"t": "restart", "rank", "env"}`` (a new process for a
  rank that died, with the same command) and ``{"t": "ping"}`` heartbeats;
* agent to launcher: ``{"t": "started", "rank", "pid"}``, ``{"t": "out", "rank", "fd", "data"}``,
  ``{"t": "exit", "rank", "code"}``, ``{"t": "error", "message"}``.

Each rank runs in its own process group (and asks the kernel to kill it if the agent dies).
The agent kills its ranks (SIGTERM, then SIGKILL after ``kill_timeout``) when its stdin closes
(the SSH connection dropped), when heartbeats stop for three intervals, or when it is told to,
so a lost launcher never leaves orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from typing import Any

import msgpack

from . import torchstore
from .local import OUTPUT_GRACE_S, _die_with_parent, exit_code

HEARTBEAT_MISSES = 3
_STARTED: list[int] = []  # process groups of every rank this agent started


class Agent:
    """The agent's state: the launcher link and the ranks it started."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.kill_timeout = 10.0
        self.heartbeat = 2.0
        self.last_heard = time.monotonic()
        self.stopping = False
        self.stopped = asyncio.Event()
        self.watchers: list[asyncio.Future[None]] = []
        self.argv: list[str] = []
        self.cwd: str | None = None
        self.threads = 1  # OMP_NUM_THREADS for each rank
        self.started = False
        self.store: Any = None  # torch's store, where this agent serves it (torchstore)
        self.rank_env: dict[str, str] = {}  # what every rank's environment gets from here

    def send(self, msg: dict[str, Any]) -> None:
        if not self.writer.is_closing():
            self.writer.write(msgpack.packb(msg, use_bin_type=True))

    async def start(self, msg: dict[str, Any]) -> None:
        self.kill_timeout = float(msg.get("kill_timeout", 10.0))
        self.heartbeat = float(msg.get("heartbeat", 2.0))
        self.argv = [str(a) for a in msg["argv"]]
        self.cwd = msg.get("cwd") or None
        ranks = msg["ranks"]
        # Like torchrun: do not let every rank start a BLAS thread per core.
        self.threads = max(1, (os.cpu_count() or 1) // max(1, len(ranks)))
        self.started = True  # (a spare host's agent starts with no rank)
        where = msg.get("torch_store")  # [addr, port]: rank 0's host, under --restart
        if where and torchstore.available():
            self.store = torchstore.serve(str(where[0]), int(where[1]))
            self.rank_env.update(torchstore.AGENT_STORE)
        for item in ranks:
            await self.spawn(item)

    async def spawn(self, item: dict[str, Any]) -> None:
        """Start (or restart) the rank ``item`` describes (its number and environment)."""
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in item["env"].items()})
        env.update(self.rank_env)
        env.setdefault("OMP_NUM_THREADS", str(self.threads))
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv, env=env, cwd=self.cwd,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True,
                preexec_fn=_die_with_parent)
        except OSError as exc:
            self.send({"t": "error", "message": f"cannot start {self.argv[0]!r}: {exc}"})
            self.send({"t": "exit", "rank": item["rank"], "code": 127})
            return
        self.procs[item["rank"]] = proc
        _STARTED.append(proc.pid)
        self.send({"t": "started", "rank": item["rank"], "pid": proc.pid})
        self.watchers.append(asyncio.ensure_future(self._watch(item["rank"], proc)))

    async def _watch(self, rank: int, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        pumps = asyncio.gather(self._pump(rank, 1, proc.stdout),
                               self._pump(rank, 2, proc.stderr))
        await proc.wait()
        # Something the rank started may still hold its output open: a grace, then the group.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(pumps), OUTPUT_GRACE_S)
        # Whatever the rank left behind in its group goes with it.
        self._signal_group(proc.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(pumps, OUTPUT_GRACE_S)
        self.send({"t": "exit", "rank": rank, "code": exit_code(proc.returncode or 0)})

    async def _pump(self, rank: int, fd: int, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 16):
            self.send({"t": "out", "rank": rank, "fd": fd, "data": chunk})
            await self.writer.drain()

    @staticmethod
    def _signal_group(pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)

    def signal(self, sig: int, rank: int | None = None) -> None:
        for r, proc in self.procs.items():
            if rank is None or r == rank:
                self._signal_group(proc.pid, sig)

    async def stop(self, why: str) -> None:
        """Terminate every rank: SIGTERM, then SIGKILL after the kill timeout."""
        if self.stopping:
            return
        self.stopping = True
        self.signal(signal.SIGTERM)  # first: the messages below may fail on a dead link
        with contextlib.suppress(OSError):
            sys.stderr.write(f"aioreduce agent: {why}; stopping the ranks\n")
            sys.stderr.flush()
        deadline = time.monotonic() + self.kill_timeout
        while any(p.returncode is None for p in self.procs.values()):
            if time.monotonic() > deadline:
                self.signal(signal.SIGKILL)
                break
            await asyncio.sleep(0.05)
        self.signal(signal.SIGKILL)
        self.stopped.set()

    def all_done(self) -> bool:
        return bool(self.procs) and all(p.returncode is not None for p in self.procs.values())


async def _heartbeat_watch(agent: Agent) -> None:
    while not agent.stopping:
        await asyncio.sleep(agent.heartbeat)
        if time.monotonic() - agent.last_heard > HEARTBEAT_MISSES * agent.heartbeat:
            await agent.stop("no heartbeat from the launcher")
            return


async def main() -> int:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                        sys.stdout)
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    agent = Agent(writer)
    def on_signal(sig: int) -> None:
        agent.watchers.append(asyncio.ensure_future(
            agent.stop(f"got {signal.Signals(sig).name}")))

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    unpacker = msgpack.Unpacker(raw=False)
    watch: asyncio.Task[None] | None = None
    stopped = asyncio.ensure_future(agent.stopped.wait())
    while True:
        read = asyncio.ensure_future(reader.read(1 << 16))
        await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not read.done():  # stopped by a heartbeat timeout or a signal
            read.cancel()
            break
        data = read.result()
        if not data:
            await agent.stop("the launcher's connection closed")
            break
        agent.last_heard = time.monotonic()
        unpacker.feed(data)
        for msg in unpacker:
            kind = msg.get("t")
            if kind == "start" and not agent.started:
                await agent.start(msg)
                watch = asyncio.ensure_future(_heartbeat_watch(agent))
            elif kind == "restart" and agent.started and not agent.stopping:
                await agent.spawn(msg)
            elif kind == "signal":
                agent.signal(int(msg["sig"]), msg.get("rank"))
            elif kind == "stop":
                await agent.stop("told to stop")
        if agent.stopping:
            break
    if watch is not None:
        watch.cancel()
    # Let the exit reports and last output lines go out before closing.
    for _ in range(100):
        if agent.all_done() or not agent.procs:
            break
        await asyncio.sleep(0.05)
    with contextlib.suppress(Exception):
        await writer.drain()
    return 0


def _run() -> int:
    from aioreduce.transport.loop import run

    # uvloop, like the launcher: its Process.wait() returns when the rank exits, even while
    # something the rank started still holds the output pipes open.
    return run(main())


if __name__ == "__main__":
    try:
        sys.exit(_run())
    finally:
        # Whatever happened to the agent, the ranks' process groups do not outlive it (the
        # ranks themselves also die with it through PR_SET_PDEATHSIG; what they started does
        # not, hence the groups).
        for pgid in _STARTED:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
