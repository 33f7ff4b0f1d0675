"""Ranks on remote hosts: one asyncssh connection and one agent per host.

:func:`connect_all` opens every host's connection in parallel (at most ``CONCURRENCY`` at a
time: sshd refuses beyond ``MaxStartups``, 10 by default) with a connect timeout, and fails the
whole launch, naming each host and its reason, before any rank starts. :class:`RemoteHost`
then starts the agent (``python -m aioreduce_launch.agent``), sends it the ranks' argv and env
on stdin, relays its messages to :class:`RemoteRank` handles, and sends heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal
import sys
from dataclasses import dataclass
from typing import Any

import msgpack

from aioreduce.jobplan import RankSpec

from .hostfile import HostEntry
from .output import RankOutput

CONCURRENCY = 8
LOST_CODE = 255  # exit code reported for ranks whose host connection broke


class SSHError(Exception):
    """A host could not be reached or authenticated; the message names the host."""


@dataclass(frozen=True)
class SSHOptions:
    """SSH settings from the command line (None: asyncssh's defaults and ~/.ssh/config)."""

    port: int | None = None
    user: str | None = None
    identity_file: str | None = None
    config: str | None = None
    known_hosts: str | None = None  # a file, "none" to disable checking, None for default
    connect_timeout: float = 15.0
    python: str = "python3"
    heartbeat: float = 2.0


def _connect_kwargs(entry: HostEntry, opts: SSHOptions) -> dict[str, Any]:
    kw: dict[str, Any] = {"connect_timeout": opts.connect_timeout,
                          "keepalive_interval": 5, "keepalive_count_max": 3}
    port = entry.ssh_port or opts.port
    if port:
        kw["port"] = port
    user = entry.user or opts.user
    if user:
        kw["username"] = user
    if opts.identity_file:
        kw["client_keys"] = [opts.identity_file]
    if opts.config:
        kw["config"] = [opts.config]
    if opts.known_hosts is not None:
        kw["known_hosts"] = None if opts.known_hosts == "none" else opts.known_hosts
    return kw


async def connect_all(entries: list[HostEntry], opts: SSHOptions) -> dict[str, Any]:
    """An SSH connection per remote host; :class:`SSHError` naming every host that failed."""
    import asyncssh

    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(entry: HostEntry) -> Any:
        async with gate:
            try:
                return await asyncio.wait_for(
                    asyncssh.connect(entry.host, **_connect_kwargs(entry, opts)),
                    opts.connect_timeout + 1)
            except TimeoutError:
                raise SSHError(f"{entry.host}: no SSH connection within "
                               f"{opts.connect_timeout:g} s") from None
            except asyncssh.Error as exc:
                raise SSHError(f"{entry.host}: {exc.reason or exc}") from None
            except OSError as exc:
                raise SSHError(f"{entry.host}: {exc.strerror or exc}") from None

    results = await asyncio.gather(*(one(e) for e in entries), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for r in results:
            if not isinstance(r, BaseException):
                r.close()
        raise SSHError("; ".join(str(f) for f in failed))
    return {e.host: conn for e, conn in zip(entries, results, strict=True)}


class RemoteRank:
    """A rank on a remote host, as the supervisor sees it."""

    def __init__(self, spec: RankSpec, host: RemoteHost, tag: bool,
                 output_dir: str | None, restarted: bool = False) -> None:
        self.rank = spec.rank
        self.host = host.name
        self._host = host
        self.outputs = (RankOutput(spec.rank, "stdout", tag=tag, copy_to=output_dir,
                                   append=restarted),
                        RankOutput(spec.rank, "stderr", tag=tag, copy_to=output_dir,
                                   append=restarted))
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)

    async def close(self) -> None:
        for out in self.outputs:
            out.close()

    def signal(self, sig: int) -> None:
        self._host.send({"t": "signal", "sig": int(sig), "rank": self.rank})

    def _exit(self, code: int) -> None:
        if not self.exited.done():
            self.exited.set_result(code)


class RemoteHost:
    """The agent on one host and the ranks it runs."""

    def __init__(self, name: str, conn: Any, opts: SSHOptions) -> None:
        self.name = name
        self.conn = conn
        self.opts = opts
        self.ranks: dict[int, RemoteRank] = {}
        self.process: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self.lost = False  # the connection to the host broke: its ranks are gone with it

    async def start(self, specs: list[RankSpec], argv: list[str], cwd: str | None,
                    kill_timeout: float, tag: bool, output_dir: str | None,
                    torch_store: tuple[str, int] | None = None) -> list[RemoteRank]:
        """Start the agent and its ranks; ``torch_store``: it serves torch's store there."""
        self.ranks = {s.rank: RemoteRank(s, self, tag, output_dir) for s in specs}
        command = f"{shlex.quote(self.opts.python)} -m aioreduce_launch.agent"
        self.process = await self.conn.create_process(command, encoding=None)
        self.send({"t": "start", "argv": argv, "cwd": cwd, "kill_timeout": kill_timeout,
                   "heartbeat": self.opts.heartbeat,
                   "ranks": [{"rank": s.rank, "env": s.env} for s in specs],
                   **({"torch_store": list(torch_store)} if torch_store else {})})
        self._tasks = [asyncio.ensure_future(self._read()),
                       asyncio.ensure_future(self._read_stderr()),
                       asyncio.ensure_future(self._heartbeat())]
        return list(self.ranks.values())

    def restart(self, spec: RankSpec, tag: bool, output_dir: str | None) -> RemoteRank:
        """A new process for ``spec``'s rank, which died (the agent runs the same command)."""
        rank = RemoteRank(spec, self, tag, output_dir, restarted=True)
        self.ranks[spec.rank] = rank
        self.send({"t": "restart", "rank": spec.rank, "env": spec.env})
        return rank

    def send(self, msg: dict[str, Any]) -> None:
        if self.process is not None and not self.process.stdin.is_closing():
            with contextlib.suppress(Exception):
                self.process.stdin.write(msgpack.packb(msg, use_bin_type=True))

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.opts.heartbeat)
            self.send({"t": "ping"})

    async def _read(self) -> None:
        unpacker = msgpack.Unpacker(raw=False)
        reason = "the agent exited"
        try:
            while data := await self.process.stdout.read(1 << 16):
                unpacker.feed(data)
                for msg in unpacker:
                    self._dispatch(msg)
        except Exception as exc:  # the connection broke
            reason = f"lost the SSH connection ({exc})"
        self.lost = True
        for rank in self.ranks.values():
            if not rank.exited.done():
                rank.outputs[1].feed(f"aioreduce-launch: {self.name}: {reason}\n".encode())
                rank._exit(LOST_CODE)

    async def _read_stderr(self) -> None:
        """The agent's own complaints (not the ranks'), shown with the host's name."""
        with contextlib.suppress(Exception):
            while line := await self.process.stderr.readline():
                text = line.decode(errors="replace").rstrip()
                if text:
                    sys.stderr.write(f"[{self.name}] {text}\n")

    def _dispatch(self, msg: dict[str, Any]) -> None:
        kind = msg.get("t")
        rank = self.ranks.get(msg.get("rank", -1))
        if kind == "out" and rank is not None:
            rank.outputs[0 if msg.get("fd") == 1 else 1].feed(msg["data"])
        elif kind == "exit" and rank is not None:
            rank._exit(int(msg["code"]))
        elif kind == "error":
            sys.stderr.write(f"aioreduce-launch: {self.name}: {msg.get('message')}\n")

    async def close(self) -> None:
        """Stop the agent (it kills what is left) and drop the connection."""
        self.send({"t": "signal", "sig": int(signal.SIGKILL)})
        for t in self._tasks[2:]:
            t.cancel()
        if self.process is not None:
            with contextlib.suppress(Exception):
                self.process.stdin.write_eof()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(asyncio.gather(*self._tasks[:2])), 5)
        self.conn.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.conn.wait_closed(), 5)
