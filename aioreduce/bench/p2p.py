"""``aioreduce-bench p2p``: aioreduce's framed transfer against a raw blocking socket.

Two rank processes on one host; the raw socket is of the kind the mesh uses between them
(an abstract Unix socket, or TCP on 127.0.0.1 with ``AIOREDUCE_LOCAL_UNIX=0``). aioreduce is
measured through both of its drivers: the event loop's (``Node.send`` / ``Node.recv_into``,
what ``node.p2p`` and small scheme frames use) and the blocking one (the comm's bulk links,
read in order by the waiting thread, :meth:`LaneLinks.recv`: what the ring's and large
vectors' messages use), each message with its wire header. For each size, trials rotate the
order of the three (raw first, then second, then third) so that all see the same machine
noise and none always goes first; every trial streams enough messages to move at least
``--min-bytes`` and ends with an 8-byte ack, and the receiver lands every message in one
preallocated array. Reported: medians, GB/s and each driver's ratio to raw; then the
small-message round trip of all three, and of two floors on the event loop, each on a
connection of the same kind: a bare protocol (an 8-byte read and write, no framing, no
matching), the floor of any event-loop driver on this host, and a minimal framed one (our wire
format, :func:`~aioreduce.wire.frame.encode_data`; the receiver parses the prefix and the
msgpack header in one function and completes the future posted for its step: no checks, no
timeout, no back-pressure), the floor of a framed, matched Python driver on the loop. So what
aioreduce's own layers add is seen apart from what waking through the loop and framing cost.
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

import msgpack
import numpy as np

from ..node import Node
from ..schemes.links import LaneLinks
from ..transport.loop import run
from ..wire.frame import PREFIX, PREFIX_SIZE, encode_data

ACK = 8
MODES = ("raw", "aioreduce", "lanes")


class _Bare(asyncio.BufferedProtocol):
    """The event loop's floor: an 8-byte message read into one buffer, a future resolved."""

    def __init__(self) -> None:
        self.buf = bytearray(ACK)
        self.got = 0
        self.arrived: asyncio.Future[None] | None = None

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buf)[self.got:]

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got == ACK and self.arrived is not None:
            self.got = 0
            self.arrived.set_result(None)


class _Framed(asyncio.BufferedProtocol):
    """The floor of a framed driver: whole frames parsed in one call, each payload copied
    into the array posted for its step, that receive's future resolved. Nothing checked."""

    def __init__(self) -> None:
        self.stage = bytearray(1 << 16)
        self.view = memoryview(self.stage)
        self.hi = 0
        self.posted: dict[int, tuple[asyncio.Future[None], memoryview]] = {}

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.hi:]

    def buffer_updated(self, nbytes: int) -> None:
        self.hi += nbytes
        lo = 0
        while self.hi - lo >= PREFIX_SIZE:
            _magic, _version, _flags, hlen, plen = PREFIX.unpack_from(self.stage, lo)
            start = lo + PREFIX_SIZE + hlen
            if start + plen > self.hi:
                break
            header = msgpack.unpackb(self.view[lo + PREFIX_SIZE:start])
            fut, dest = self.posted.pop(header["step"])
            dest[:] = self.view[start:start + plen]
            fut.set_result(None)
            lo = start + plen
        if lo:
            self.stage[:self.hi - lo] = self.stage[lo:self.hi]
            self.hi -= lo

    def post(self, step: int, into: np.ndarray) -> asyncio.Future[None]:
        fut = asyncio.get_running_loop().create_future()
        self.posted[step] = (fut, into.data.cast("B"))
        return fut


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
            floor, _ = await asyncio.get_running_loop().run_in_executor(None, lsock.accept)
            framed, _ = await asyncio.get_running_loop().run_in_executor(None, lsock.accept)
            lsock.close()
        else:
            where = str((await node.recv_into(1, nothing, step=0, tag=1, timeout=30)
                         ).meta["where"])
            if unix:
                raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                raw.connect(where)
                floor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                floor.connect(where)
                framed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                framed.connect(where)
            else:
                raw = socket.create_connection(("127.0.0.1", int(where)))
                floor = socket.create_connection(("127.0.0.1", int(where)))
                framed = socket.create_connection(("127.0.0.1", int(where)))
        if not unix:
            for sock in (raw, floor, framed):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw_ack = memoryview(bytearray(ACK))
        loop = asyncio.get_running_loop()
        for sock in (floor, framed):
            sock.setblocking(False)
        bare_transport, bare = await (loop.create_unix_connection(_Bare, sock=floor) if unix
                                      else loop.create_connection(_Bare, sock=floor))
        framed_transport, framed_proto = await (
            loop.create_unix_connection(_Framed, sock=framed) if unix
            else loop.create_connection(_Framed, sock=framed))

        # The blocking driver: a lane each way over the comm's bulk links, read by the
        # thread that waits (no reader thread), as the ring reads its lanes.
        bulk = node.mesh.bulk_links()
        peer = 1 - me
        outs, ins = await bulk.open_links([peer], [peer], step)
        links = LaneLinks(node.mesh, outs, ins, None, opened_by=bulk, hear_comm=False,
                          readers=False)
        step += 1

        def lane_stream(buf: np.ndarray, first: int, reps: int) -> float:
            # A trial is one step of the links, its messages numbered as a scheme's slices
            # (step ``first``, index i; the ack after them), and it ends as a step does.
            t0 = time.perf_counter()
            if me == 0:
                for i in range(reps):
                    links.send(1, buf, first, i, {}, bare=True)
                links.recv(1, ack, first, reps)
            else:
                for i in range(reps):
                    links.recv(0, buf, first, i)
                links.send(0, ack, first, reps, {}, bare=True)
            took = time.perf_counter() - t0
            links.end_step(first)
            return took

        for size in sizes:
            reps = max(1, min_bytes // size)
            sent = (np.arange(size) % 251).astype(np.uint8)
            buf = sent if me == 0 else np.empty(size, np.uint8)
            view = buf.data
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for trial in range(len(MODES) * trials + 1):  # trial 0 warms the paths up
                # The order rotates, so that no transport always goes first.
                for mode in MODES[trial % len(MODES):] + MODES[:trial % len(MODES)]:
                    if trial == 0 and me == 1:
                        buf.fill(0)  # the warm-up checks what each transport delivered
                    if mode == "lanes":  # (blocking the event loop, as raw does)
                        took = lane_stream(buf, step, reps)
                        if trial and me == 0:
                            times[mode].append(took)
                    elif me == 0:
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
                    if trial == 0 and me == 1 and not np.array_equal(buf, sent):
                        raise RuntimeError(f"{mode}: the {size}-byte message arrived altered")
                    step += reps
            if me == 0:
                r = statistics.median(times["raw"])
                a, lane = statistics.median(times["aioreduce"]), statistics.median(times["lanes"])
                moved = size * reps
                _emit({"kind": "throughput", "size_bytes": size, "reps": reps, "trials": trials,
                       "aioreduce_ms": a * 1e3, "lanes_ms": lane * 1e3, "raw_ms": r * 1e3,
                       "aioreduce_gbps": moved / a / 1e9, "lanes_gbps": moved / lane / 1e9,
                       "raw_gbps": moved / r / 1e9, "ratio": r / a, "lanes_ratio": r / lane})

        small = np.zeros(ACK, np.uint8)
        kinds = (*MODES, "loop", "framed")
        rtts: dict[str, list[float]] = {m: [] for m in kinds}
        # This side's CPU per round trip, each driver's: everything of a round trip here runs
        # on this thread (the event loop's, the lanes' read by the waiting thread, raw), so
        # its CPU clock, kernel time included, is what a message pair costs this rank; the
        # rest of a round trip's time is the peer's and the wake-ups'.
        cpu: dict[str, float] = {m: 0.0 for m in kinds}

        async def round_trip(mode: str) -> None:
            if mode == "framed":
                arrived = framed_proto.post(step, small)
                if me == 1:
                    await arrived
                framed_transport.writelines(encode_data(step, 0, me, small))
                if me == 0:
                    await arrived
            elif mode == "loop":
                bare.arrived = loop.create_future()
                if me == 0:
                    bare_transport.write(raw_ack)
                    await bare.arrived
                else:
                    await bare.arrived
                    bare_transport.write(raw_ack)
            elif mode == "lanes":
                if me == 0:
                    links.send(1, small, step, 0, {}, bare=True)
                    links.recv(1, small, step, 0)
                else:
                    links.recv(0, small, step, 0)
                    links.send(0, small, step, 0, {}, bare=True)
            elif mode == "aioreduce":
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

        # Round by round, the five in turn (the order rotating): a round trip's time on
        # this host swings with where the two processes run, and all five see the same.
        # Each timed round trip follows an untimed one of the same driver: rank 0 starts its
        # clock as soon as its previous receive returns, while rank 1 may still be finishing
        # the previous driver's round (an event-loop send's completion), and without the
        # untimed one that tail was charged to whichever driver came next.
        for i in range(len(kinds) * rtt_rounds):
            for mode in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
                for timed in (False, True):
                    c0 = time.thread_time()
                    t0 = time.perf_counter()
                    await round_trip(mode)
                    if timed:
                        rtts[mode].append(time.perf_counter() - t0)
                        cpu[mode] += time.thread_time() - c0
                    if mode == "lanes":
                        links.end_step(step)  # (as a scheme's step ends, outside the timing)
                    step += 1
        if me == 0:
            r = statistics.median(rtts["raw"])
            a, lane = statistics.median(rtts["aioreduce"]), statistics.median(rtts["lanes"])
            floor_rtt = statistics.median(rtts["loop"])
            _emit({"kind": "latency", "message_bytes": ACK, "rounds": len(rtts["raw"]),
                   "aioreduce_rtt_us": a * 1e6, "lanes_rtt_us": lane * 1e6,
                   "raw_rtt_us": r * 1e6, "loop_floor_rtt_us": floor_rtt * 1e6,
                   "framed_floor_rtt_us": statistics.median(rtts["framed"]) * 1e6,
                   "ratio": r / a, "lanes_ratio": r / lane,
                   "cpu_us": {m: cpu[m] / len(rtts[m]) * 1e6 for m in kinds}})
        await links.close(1.0)
        bare_transport.close()
        framed_transport.close()
        raw.close()


def _emit(obj: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


def run_p2p(sizes: list[int], trials: int, min_bytes: int, rtt_rounds: int,
            timeout: float = 600.0) -> list[dict[str, Any]]:
    """Start the two ranks with aioreduce-launch; return the result objects rank 0 printed."""
    cmd = [sys.executable, "-m", "aioreduce_launch.cli", "-n", "2", "--",
           sys.executable, "-P", "-m", "aioreduce.bench.p2p", "--worker",
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
