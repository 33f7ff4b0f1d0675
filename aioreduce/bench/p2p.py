"""``aioreduce-bench p2p``: aioreduce's framed transfer against a raw blocking socket.

Two rank processes on one host; the raw socket is of the kind the mesh uses between them
(an abstract Unix socket, or TCP on 127.0.0.1 with ``AIOREDUCE_LOCAL_UNIX=0``). For each
size, trials alternate between the two transports in ABBA order (raw, aioreduce, aioreduce,
raw, ...) so that both see the same machine noise and neither always goes first; every trial
streams enough messages to move at least ``--min-bytes`` and ends with an 8-byte ack, and the
receiver lands every message in one preallocated array on both sides. Reported: medians, GB/s
and the ratio aioreduce/raw; then the small-message round trip of both.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from ..node import Node
from ..transport.loop import run

ACK = 8


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("raw peer closed")
        got += n


async def _worker(sizes: list[int], trials: int, min_bytes: int, rtt_rounds: int) -> None:
    async with Node.from_env() as node:
        me = node.rank
        ack = np.zeros(ACK, np.uint8)
        step = 0
        # The raw baseline's connection, of the kind the mesh uses between these two ranks
        # (a Unix socket on one host unless AIOREDUCE_LOCAL_UNIX=0, else TCP): rank 1
        # listens and tells rank 0 where over the mesh.
        unix = node.mesh.options.local_unix
        nothing = np.empty(0, np.uint8)
        if me == 1:
            if unix:
                lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                name = "\0aioreduce-p2p-bench-" + os.urandom(8).hex()
                lsock.bind(name)
                lsock.listen(1)
                where = name
            else:
                lsock = socket.create_server(("127.0.0.1", 0))
                where = str(lsock.getsockname()[1])
            await node.send(0, nothing, step=0, tag=1, meta={"where": where})
            raw, _ = await asyncio.get_running_loop().run_in_executor(None, lsock.accept)
            lsock.close()
        else:
            where = str((await node.recv_into(1, nothing, step=0, tag=1, timeout=30)
                         ).meta["where"])
            if unix:
                raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                raw.connect(where)
            else:
                raw = socket.create_connection(("127.0.0.1", int(where)))
        if not unix:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw_ack = memoryview(bytearray(ACK))

        for size in sizes:
            reps = max(1, min_bytes // size)
            buf = np.ones(size, np.uint8) if me == 0 else np.empty(size, np.uint8)
            view = buf.data
            times: dict[str, list[float]] = {"aioreduce": [], "raw": []}
            for trial in range(trials + 1):  # trial 0 warms both paths up
                # ABBA order: whichever transport goes second in a pair is not favoured.
                for mode in ("aioreduce", "raw") if trial % 2 else ("raw", "aioreduce"):
                    if me == 0:
                        t0 = time.perf_counter()
                        if mode == "aioreduce":
                            for i in range(reps):
                                await node.send(1, buf, step=step + i)
                            await node.recv_into(1, ack, step=step, tag=2, timeout=120)
                        else:
                            for _ in range(reps):
                                raw.sendall(view)
                            _recv_exact(raw, raw_ack)
                        if trial:
                            times[mode].append(time.perf_counter() - t0)
                    elif mode == "aioreduce":
                        # Post every receive first: each frame lands in `buf` directly.
                        await asyncio.gather(*(node.post_recv(0, buf, step=step + i)
                                               for i in range(reps)))
                        await node.send(0, ack, step=step, tag=2)
                    else:
                        for _ in range(reps):
                            _recv_exact(raw, view)
                        raw.sendall(raw_ack)
                    step += reps
            if me == 0:
                a, r = statistics.median(times["aioreduce"]), statistics.median(times["raw"])
                moved = size * reps
                _emit({"kind": "throughput", "size_bytes": size, "reps": reps, "trials": trials,
                       "aioreduce_ms": a * 1e3, "raw_ms": r * 1e3,
                       "aioreduce_gbps": moved / a / 1e9, "raw_gbps": moved / r / 1e9,
                       "ratio": r / a})

        small = np.zeros(ACK, np.uint8)
        rtts: dict[str, list[float]] = {"aioreduce": [], "raw": []}
        for mode in ("aioreduce", "raw") * 2:
            for _ in range(rtt_rounds):
                t0 = time.perf_counter()
                if mode == "aioreduce":
                    if me == 0:
                        await node.send(1, small, step=step)
                        await node.recv_into(1, small, step=step, timeout=30)
                    else:
                        await node.recv_into(0, small, step=step, timeout=30)
                        await node.send(0, small, step=step)
                elif me == 0:
                    raw.sendall(raw_ack)
                    _recv_exact(raw, raw_ack)
                else:
                    _recv_exact(raw, raw_ack)
                    raw.sendall(raw_ack)
                rtts[mode].append(time.perf_counter() - t0)
                step += 1
        if me == 0:
            a, r = statistics.median(rtts["aioreduce"]), statistics.median(rtts["raw"])
            _emit({"kind": "latency", "message_bytes": ACK, "rounds": 2 * rtt_rounds,
                   "aioreduce_rtt_us": a * 1e6, "raw_rtt_us": r * 1e6, "ratio": r / a})
        raw.close()


def _emit(obj: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


def run_p2p(sizes: list[int], trials: int, min_bytes: int, rtt_rounds: int,
            timeout: float = 600.0) -> list[dict[str, Any]]:
    """Start the two ranks with aioreduce-launch; return the result objects rank 0 printed."""
    cmd = [sys.executable, "-m", "aioreduce_launch.cli", "-n", "2", "--",
           sys.executable, "-m", "aioreduce.bench.p2p", "--worker",
           ",".join(map(str, sizes)), str(trials), str(min_bytes), str(rtt_rounds)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"benchmark ranks failed (exit code {proc.returncode})")
    tag = "[0] RESULT "
    return [json.loads(line[len(tag):]) for line in proc.stdout.splitlines()
            if line.startswith(tag)]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _sizes, _trials, _min, _rounds = sys.argv[2:6]
    run(_worker([int(s) for s in _sizes.split(",")], int(_trials), int(_min), int(_rounds)))
