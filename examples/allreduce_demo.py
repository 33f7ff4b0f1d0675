"""A first aioreduce program: sum one vector across all ranks, over the authenticated mesh.

Run it on this machine with four ranks:

    aioreduce-launch -n 4 -- python examples/allreduce_demo.py --size 4M --steps 5

Every rank sends its vector to rank 0 (posted receives land straight in preallocated arrays),
rank 0 adds them up and sends the sum back. Each rank checks the result against the exact sum.
This is the plain gather-to-master baseline; the straggler-resilient schemes build on the same
send / post_recv calls.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import aioreduce as ar


def contribution(rank: int, n: int, step: int) -> np.ndarray:
    """Deterministic data, so every rank can compute the exact expected sum."""
    return (np.arange(n, dtype=np.float64) % 97) * (rank + 1) + step


async def main(n: int, steps: int) -> None:
    async with ar.Node.from_env() as node:
        world = node.world_size
        for step in range(steps):
            t0 = time.perf_counter()
            mine = contribution(node.rank, n, step)
            if node.rank == 0:
                parts = [np.empty(n) for _ in range(1, world)]
                futs = [node.post_recv(r, parts[r - 1], step=step) for r in range(1, world)]
                await asyncio.gather(*futs)
                total = mine + sum(parts, np.zeros(n))
                await asyncio.gather(*(node.send(r, total, step=step, tag=1)
                                       for r in range(1, world)))
            else:
                await node.send(0, mine, step=step)
                total = np.empty(n)
                await node.recv_into(0, total, step=step, tag=1, timeout=60)
            expected = sum((contribution(r, n, step) for r in range(world)), np.zeros(n))
            assert np.array_equal(total, expected), "wrong sum"
            print(f"step {step}: summed {n * 8 / 2**20:.1f} MiB over {world} ranks in "
                  f"{(time.perf_counter() - t0) * 1e3:.1f} ms, exact", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1M", help="float64 elements, e.g. 1M (default)")
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    from aioreduce.bench.cli import parse_size

    ar.run(main(parse_size(a.size), a.steps))
