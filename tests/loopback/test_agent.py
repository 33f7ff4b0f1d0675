"""The remote agent on its own (no SSH): stdin carries the job; losing it kills the ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from .harness import gone

pytestmark = pytest.mark.loopback

RANK = ("import os, subprocess, sys, time\n"
        "c = subprocess.Popen(['sleep', '300'])\n"
        "print('up', os.environ['RANK'], os.environ['AIOREDUCE_SECRET'], c.pid, flush=True)\n"
        "time.sleep(300)\n")


def _agent() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "aioreduce_launch.agent"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def _start(agent: subprocess.Popen[bytes], heartbeat: float = 2.0) -> list[int]:
    """Send a two-rank job; return the pids of the ranks and of what they started."""
    assert agent.stdin is not None and agent.stdout is not None
    ranks = [{"rank": r, "env": {"RANK": str(r), "AIOREDUCE_SECRET": "s3cr3t-on-stdin"}}
             for r in (0, 1)]
    agent.stdin.write(msgpack.packb({"t": "start", "argv": [sys.executable, "-c", RANK],
                                     "cwd": None, "ranks": ranks, "kill_timeout": 2,
                                     "heartbeat": heartbeat}))
    agent.stdin.flush()
    unpacker = msgpack.Unpacker(raw=False)
    pids: list[int] = []
    text = {0: b"", 1: b""}  # output arrives in chunks, not lines
    while sum(t.count(b"\n") for t in text.values()) < 2:
        data = os.read(agent.stdout.fileno(), 1 << 16)
        if not data:  # the agent ended before both ranks spoke: show why, do not spin
            assert agent.stderr is not None
            pytest.fail(f"agent exited early: {agent.stderr.read().decode(errors='replace')}")
        unpacker.feed(data)
        for msg in unpacker:
            if msg["t"] == "started":
                pids.append(msg["pid"])
            elif msg["t"] == "out" and msg["fd"] == 1:
                text[msg["rank"]] += msg["data"]
    for out in text.values():
        words = out.decode().split()
        assert words[:1] == ["up"] and words[2] == "s3cr3t-on-stdin", words
        pids.append(int(words[3]))
    return pids


def test_closing_stdin_kills_every_rank_and_what_it_started() -> None:
    agent = _agent()
    try:
        pids = _start(agent)
        assert len(pids) == 4
        for pid in pids:  # the secret came on stdin, not on any command line
            assert b"s3cr3t" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert agent.stdin is not None
        agent.stdin.close()
        assert gone(pids, 5)
        assert agent.wait(10) == 0
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)


def test_missing_heartbeats_kill_the_ranks() -> None:
    agent = _agent()
    try:
        pids = _start(agent, heartbeat=0.3)  # the test never pings: a frozen launcher
        assert gone(pids, 0.3 * 3 + 4)
        assert agent.wait(10) == 0
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
