"""The owners' allreduce (``schemes/owners.py``) on the in-memory network: the reduction of
every rank's vector on every rank, for any length against any world size and chunk size; each
chunk reduced in rank order whatever order its copies arrive in; with an arrival (a staged
GPU tensor), no part sent before it landed and every element handed back exactly once."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from aioreduce.schemes.links import CommLinks
from aioreduce.schemes.owners import bounds, chunks, owners_allreduce, read_order
from aioreduce.transport.memory import MemoryNetwork


def _sum(parts: Sequence[np.ndarray], out: np.ndarray) -> None:
    acc = np.array(parts[0], copy=True)
    for p in parts[1:]:
        acc += p
    out[...] = acc


async def _run(world: int, vectors: list[np.ndarray], reduce=_sum, chunk_bytes: int = 24,
               arrivals: list[object] | None = None,
               links_of=lambda comm: CommLinks(comm, backlog_steps=8)) -> None:
    net = MemoryNetwork(world)
    links = [links_of(net.comms[r]) for r in range(world)]
    try:
        await asyncio.gather(*(owners_allreduce(
            links[r], 1, r, world, vectors[r], reduce, chunk_bytes=chunk_bytes,
            arrival=None if arrivals is None else arrivals[r]) for r in range(world)))
    finally:
        for lk in links:
            await lk.close(1.0)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("length", [0, 1, 4, 37, 1000])
async def test_every_rank_gets_the_exact_sum(world: int, length: int) -> None:
    vectors = [np.arange(length, dtype=np.int64) * (r + 1) + r for r in range(world)]
    want = sum(v.copy() for v in vectors)
    await _run(world, vectors)
    for v in vectors:
        np.testing.assert_array_equal(v, want)


async def test_each_chunk_is_reduced_in_rank_order() -> None:
    world, seen = 4, []

    def record(parts: Sequence[np.ndarray], out: np.ndarray) -> None:
        seen.append([int(p[0]) // 1000 for p in parts])
        _sum(parts, out)

    vectors = [np.full(64, 1000 * r, np.int64) + np.arange(64) for r in range(world)]
    await _run(world, vectors, reduce=record)
    assert seen and all(order == list(range(world)) for order in seen)


class _Arrival:
    """A staged vector: records what landed and what was handed back."""

    def __init__(self) -> None:
        self.landed_parts: list[tuple[int, int]] = []
        self.finals: list[tuple[int, int]] = []

    def landed(self, lo: int, hi: int) -> None:
        self.landed_parts.append((lo, hi))

    def final(self, lo: int, hi: int) -> None:
        self.finals.append((lo, hi))


class _Checked(CommLinks):
    """Links whose sends check that the part they read has landed."""

    arrival: _Arrival

    def send(self, peer: int, array: np.ndarray, step: int, tag: int, meta: dict) -> None:
        if tag < 1 << 24:  # a copy for its owner, read from the staged vector
            lo, hi = bounds(self.length, self.comm.world_size)[peer:peer + 2]
            assert (lo, hi) in self.arrival.landed_parts, (peer, tag)
        super().send(peer, array, step, tag, meta)


async def test_parts_are_sent_once_landed_and_every_element_handed_back_once() -> None:
    world, length = 3, 50
    arrivals = [_Arrival() for _ in range(world)]
    made: list[_Checked] = []

    def links_of(comm):  # type: ignore[no-untyped-def]
        lk = _Checked(comm, backlog_steps=8)
        lk.arrival, lk.length = arrivals[comm.rank], length  # type: ignore[attr-defined]
        made.append(lk)
        return lk

    vectors = [np.full(length, r + 1, np.float32) for r in range(world)]
    await _run(world, vectors, arrivals=arrivals, links_of=links_of, chunk_bytes=16)
    for r, arrival in enumerate(arrivals):
        np.testing.assert_array_equal(vectors[r], np.full(length, 6, np.float32))
        assert sorted(arrival.landed_parts) == sorted(read_order(length, r, world))
        covered = np.zeros(length, np.int64)
        for lo, hi in arrival.finals:
            covered[lo:hi] += 1
        assert (covered == 1).all()


def test_chunks_cover_a_range_once_and_an_empty_one_as_one_piece() -> None:
    assert chunks(3, 10, 3) == [(3, 6), (6, 9), (9, 10)]
    assert chunks(4, 4, 8) == [(4, 4)]
    # Rank 1 of 4 reads the parts of owners 2, 3, 0 and its own last.
    assert read_order(10, 1, 4) == [(6, 8), (8, 10), (0, 3), (3, 6)]
