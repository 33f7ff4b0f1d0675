"""A tree's chunking follows the job's hosts, alike on every rank: 7 nodes in one process on
real sockets, advertising one or two loopback addresses (two "hosts"); every rank learns the
host count from rank 0's table and cuts its vectors at the same bounds, and the sums are exact.
(Which chunking each case takes is unit-tested: tests/unit/test_sim.py.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aioreduce as ar
from aioreduce import Node
from aioreduce.env import NodeEnv
from aioreduce.jobplan import free_port
from aioreduce.schemes.base import StepOptions
from aioreduce.schemes.reduce import paths

pytestmark = pytest.mark.loopback

N, DIM, STEPS = 7, 1 << 20, 2  # 4 MiB of float32: 4 chunks on one host, 16 across hosts


@pytest.mark.parametrize("hosts", [1, 2])
async def test_every_rank_cuts_at_the_bounds_its_hosts_choose(
        hosts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    cuts: dict[int, set[int]] = {}
    real = paths.Layout.of.__func__  # type: ignore[attr-defined]

    def spy(cls: type[paths.Layout], like: np.ndarray, family: object, *args: int
            ) -> paths.Layout:
        lay: paths.Layout = real(cls, like, family, *args)
        cuts.setdefault(len(lay.bounds), set()).add(id(family))
        return lay

    monkeypatch.setattr(paths.Layout, "of", classmethod(spy))
    port = free_port()

    async def rank(r: int) -> tuple[int, bool, list[np.ndarray]]:
        addr = "127.0.0.1" if r < 4 or hosts == 1 else "127.0.0.2"
        env = NodeEnv(r, N, "127.0.0.1", port, b"k" * 32, advertise_addr=addr, bind_addr=addr)
        out = []
        async with Node(env, scheme=ar.Tree(2, lanes=True)) as node:
            for step in range(STEPS):
                res = await node.allreduce(np.full(DIM, r + 10.0 * step, np.float32))
                out.append(np.array(res.value))
            return node.mesh.hosts, node.mesh.spans_hosts, out

    results = await asyncio.wait_for(asyncio.gather(*[rank(r) for r in range(N)]), 120)
    chunk, most = StepOptions().chunking(hosts > 1)
    want = -(-DIM // max(chunk // 4, -(-DIM // most)))
    assert want == (16 if hosts > 1 else 4)
    assert set(cuts) == {want} and len(cuts[want]) == N  # every rank, the same bounds
    for seen, spans, got in results:
        assert (seen, spans) == (hosts, hosts > 1)
        for step, value in enumerate(got):
            np.testing.assert_array_equal(value, np.full(DIM, sum(range(N)) + 70.0 * step))


@pytest.mark.parametrize("hosts", [1, 2])
async def test_the_transpose_slices_by_its_hosts_alike_on_every_rank(hosts: int) -> None:
    port = free_port()
    n, dim = 4, 1 << 18  # 1 MiB of float32: one slice per shard either way

    async def rank(r: int) -> tuple[int, np.ndarray]:
        addr = "127.0.0.1" if r < 2 or hosts == 1 else "127.0.0.2"
        env = NodeEnv(r, n, "127.0.0.1", port, b"k" * 32, advertise_addr=addr, bind_addr=addr)
        async with Node(env, scheme=ar.Transpose(deadline=30.0)) as node:
            res = await node.allreduce(np.full(dim, r + 1.0, np.float32))
            assert res.exact
            return node.session._slice_bytes, np.array(res.value)  # type: ignore[attr-defined]

    results = await asyncio.wait_for(asyncio.gather(*[rank(r) for r in range(n)]), 120)
    want = ar.Transpose().slices(hosts > 1)
    assert want == (1 << 20 if hosts > 1 else 4 << 20)
    for got, value in results:
        assert got == want
        np.testing.assert_array_equal(value, np.full(dim, 10.0, np.float32))
