"""A tree's leaf paces its chunks by the result only where a network link lies between it and
its parent: over TCP lanes it does, over Unix-socket lanes (one host) it sends every chunk at
once. 7 nodes in one process on real sockets; the sums stay exact either way. (What pacing
orders is unit-tested on the in-memory network: tests/unit/test_reduce_sessions.py.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aioreduce as ar
from aioreduce import Node
from aioreduce.env import NodeEnv
from aioreduce.jobplan import free_port
from aioreduce.schemes.reduce.session import ReduceSession
from aioreduce.transport import MeshOptions

pytestmark = pytest.mark.loopback

N, DIM, STEPS = 7, 4096, 3  # a binary tree of depth 2; 32 KiB of float64 in 1 KiB chunks


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "unix"])
async def test_a_leaf_paces_over_tcp_lanes_and_not_over_unix_ones(
        local: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    paced: set[int] = set()
    real = ReduceSession._send_paced

    async def spy(self: ReduceSession, *args: object, **kwargs: object) -> None:
        paced.add(self.comm.rank)
        await real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ReduceSession, "_send_paced", spy)
    port = free_port()

    async def rank(r: int) -> list[np.ndarray]:
        env = NodeEnv(r, N, "127.0.0.1", port, b"k" * 32)
        scheme = ar.Tree(2, lanes=True, chunk_bytes=1024)
        out = []
        async with Node(env, scheme=scheme, options=MeshOptions(local_unix=local)) as node:
            for step in range(STEPS):
                res = await node.allreduce(np.full(DIM, r + 10.0 * step))
                assert node.session.lanes_open  # type: ignore[attr-defined]
                out.append(np.array(res.value))
        return out

    results = await asyncio.wait_for(asyncio.gather(*[rank(r) for r in range(N)]), 60)
    for got in results:
        for step, value in enumerate(got):
            np.testing.assert_array_equal(value, np.full(DIM, sum(range(N)) + 70.0 * step))
    leaves = {3, 4, 5, 6}
    assert paced == (set() if local else leaves)
