"""What a tree step's messages cost in the least Python, next to ours, in one run.

``python benchmarks/tree_floor.py [--nodes 13] [--size 40K] [--iters 2000]`` runs, on this
host, a minimal program with a tree step's traffic (fan-out 3: each rank sums its children's
vectors into its own and sends the sum up; the root's sum comes down the same tree; uvloop
``BufferedProtocol`` on Unix sockets, an 8-byte head per message, one future per receive: no
deadlines, checks, codes, reports or telemetry), then ``aioreduce-bench allreduce`` with the
uncoded and the coded tree over the same ranks and size. It prints each one's CPU per rank
per step (``getrusage`` over the timed steps, every thread) for the root, the interior ranks
and the leaves, and ours over the floor. The floor is what any Python event-loop driver pays
for these messages on this machine (system calls, wake-ups, the loop); the rest of ours is
the runtime's own Python (issue 34's "CPU per rank per step", docs/architecture.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

from aioreduce.bench.sizes import parse_size

FANOUT = 3
WARMUP = 200
HEAD = struct.Struct("<II")  # step, payload bytes


class _Link(asyncio.BufferedProtocol):
    """One connection's receiving side: a head, then the payload into a fresh array."""

    def __init__(self, node: _Node, peer: int | None) -> None:
        self.node, self.peer = node, peer
        self.head = bytearray(HEAD.size)
        self.hello = bytearray(4)  # a child's rank, first thing on its connection
        self.view = memoryview(self.head)
        self.got, self.step, self.buf = 0, 0, np.empty(0, np.float32)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.peer is None:
            self.view = memoryview(self.hello)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.got:]

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got < len(self.view):
            return
        self.got = 0
        if self.peer is None:  # the hello: who this child is
            self.peer = struct.unpack("<I", self.hello)[0]
            self.node.accepted(self.peer, self)
            self.view = memoryview(self.head)
        elif self.view.obj is self.head:
            self.step, nbytes = HEAD.unpack(self.head)
            self.buf = np.empty(nbytes // 4, np.float32)
            self.view = self.buf.data.cast("B")
        else:
            self.node.arrived(self.peer, self.step, self.buf)
            self.view = memoryview(self.head)

    def send(self, step: int, array: np.ndarray) -> None:
        assert self.transport is not None
        self.transport.writelines([HEAD.pack(step, array.nbytes), array.data.cast("B")])


class _Node:
    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.parent = (rank - 1) // FANOUT if rank else None
        self.children = [c for c in range(FANOUT * rank + 1, FANOUT * rank + FANOUT + 1)
                         if c < world]
        self.links: dict[int, _Link] = {}
        self.waiting: dict[tuple[int, int], asyncio.Future[np.ndarray]] = {}
        self.early: dict[tuple[int, int], np.ndarray] = {}
        self.all_in: asyncio.Future[None] | None = None

    def accepted(self, peer: int, link: _Link) -> None:
        self.links[peer] = link
        if self.all_in is not None and all(c in self.links for c in self.children):
            self.all_in.set_result(None)

    def arrived(self, peer: int, step: int, buf: np.ndarray) -> None:
        fut = self.waiting.pop((peer, step), None)
        if fut is None:
            self.early[(peer, step)] = buf
        else:
            fut.set_result(buf)

    def recv(self, peer: int, step: int) -> asyncio.Future[np.ndarray]:
        fut = asyncio.get_running_loop().create_future()
        buf = self.early.pop((peer, step), None)
        if buf is not None:
            fut.set_result(buf)
        else:
            self.waiting[(peer, step)] = fut
        return fut

    async def step(self, step: int, own: np.ndarray) -> np.ndarray:
        total = own
        if self.children:
            got = await asyncio.gather(*(self.recv(c, step) for c in self.children))
            total = own.copy()
            for g in got:
                total += g
        if self.parent is not None:
            self.links[self.parent].send(step, total)
            total = await self.recv(self.parent, step)
        for c in self.children:
            self.links[c].send(step, total)
        return total


async def _rank(rank: int, world: int, size: int, iters: int, where: str) -> None:
    loop = asyncio.get_running_loop()
    node = _Node(rank, world)
    path = os.path.join(where, f"r{rank}")
    if node.children:
        node.all_in = loop.create_future()
        server = await loop.create_unix_server(lambda: _Link(node, None), path)
    if node.parent is not None:
        parent_path = os.path.join(where, f"r{node.parent}")
        while True:  # the parent may not listen yet
            try:
                transport, link = await loop.create_unix_connection(
                    lambda: _Link(node, node.parent), parent_path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(0.02)
        transport.write(struct.pack("<I", rank))
        node.links[node.parent] = link
    if node.all_in is not None:
        await node.all_in
    own = np.full(size // 4, rank + 1, np.float32)
    for s in range(WARMUP):
        await node.step(s, own)
    use0 = resource.getrusage(resource.RUSAGE_SELF)
    for s in range(WARMUP, WARMUP + iters):
        out = await node.step(s, own)
    use1 = resource.getrusage(resource.RUSAGE_SELF)
    assert out[0] == world * (world + 1) / 2, "not the exact sum"
    cpu = (use1.ru_utime - use0.ru_utime + use1.ru_stime - use0.ru_stime) / iters
    print(json.dumps({"rank": rank, "cpu_s": cpu}), flush=True)
    await asyncio.sleep(0.2)  # let the children read the last result before closing
    if node.children:
        server.close()


def floor(nodes: int, size: int, iters: int) -> list[float]:
    """The minimal program's CPU per step, by rank."""
    with tempfile.TemporaryDirectory(prefix="tree-floor-") as where:
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--nodes",
                                   str(nodes), "--size", str(size), "--iters", str(iters),
                                   "--where", where], stdout=subprocess.PIPE, text=True)
                 for r in range(nodes)]
        out = {}
        for p in procs:
            stdout, _ = p.communicate(timeout=600)
            if p.returncode:
                raise SystemExit(f"a floor rank failed ({p.returncode})")
            row = json.loads(stdout.strip().splitlines()[-1])
            out[row["rank"]] = row["cpu_s"]
    return [out[r] for r in range(nodes)]


def ours(nodes: int, size: int, iters: int) -> dict[str, list[float]]:
    """``aioreduce-bench allreduce``'s CPU per step, by rank, for the tree and coded tree."""
    cmd = [sys.executable, "-m", "aioreduce.bench.cli", "allreduce", "--scheme",
           "tree,coded-tree", "--nodes", str(nodes), "--size", str(size),
           "--iters", str(iters), "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if run.returncode:
        raise SystemExit(f"aioreduce-bench failed ({run.returncode}):\n{run.stderr[-2000:]}")
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {row["scheme"]: row["cpu_per_rank_s"] for row in rows if "cpu_per_rank_s" in row}


def _roles(cpu: list[float]) -> tuple[float, float, float, float]:
    """(root, interior mean, leaf mean, mean over ranks) in milliseconds."""
    nodes = len(cpu)
    interior = [r for r in range(1, nodes) if FANOUT * r + 1 < nodes]
    leaves = [r for r in range(1, nodes) if r not in interior]
    ms = [c * 1e3 for c in cpu]
    return (ms[0], statistics.mean(ms[r] for r in interior) if interior else 0.0,
            statistics.mean(ms[r] for r in leaves), statistics.mean(ms))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=13)
    ap.add_argument("--size", type=parse_size, default=parse_size("40K"), help="bytes (40K, 1M)")
    ap.add_argument("--iters", type=int, default=2000, help="timed steps of the floor")
    ap.add_argument("--bench-iters", type=int, default=300, help="timed steps of ours")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # one floor rank
    ap.add_argument("--where", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.rank is not None:
        import uvloop
        uvloop.run(_rank(opts.rank, opts.nodes, opts.size, opts.iters, opts.where))
        return
    t = time.monotonic()
    base = _roles(floor(opts.nodes, opts.size, opts.iters))
    rows = {"floor": base} | {k: _roles(v) for k, v in
                              ours(opts.nodes, opts.size, opts.bench_iters).items()}
    print(f"{opts.nodes} ranks, fan-out {FANOUT}, {opts.size} bytes: CPU per rank per step, ms "
          f"({time.monotonic() - t:.0f} s)")
    print(f"{'':>12} {'root':>7} {'interior':>9} {'leaf':>7} {'mean':>7} {'mean/floor':>11}")
    for name, (root, inner, leaf, mean) in rows.items():
        print(f"{name:>12} {root:7.3f} {inner:9.3f} {leaf:7.3f} {mean:7.3f} "
              f"{mean / base[3]:11.2f}")


if __name__ == "__main__":
    main()
