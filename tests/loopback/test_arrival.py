"""A vector that lands piece by piece (a staged GPU tensor, see aioreduce/torch/staging.py)
summed in place by the ring on real sockets, 4 nodes in one process: the lane ring reads a
piece only after ``landed`` said it is in, in the order ``read_order`` promised, and hands
each piece of the result back once, when it is final; the event loop's ring, and a scheme
that does not sum in place, wait for all of it first and hand nothing back (the caller
copies the whole result)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import aioreduce as ar
from aioreduce import Node
from aioreduce.env import NodeEnv
from aioreduce.jobplan import free_port
from aioreduce.schemes.base import ReadsInOrder

pytestmark = pytest.mark.loopback

N, SIZE = 4, 1001  # segments of unequal sizes


class Landing:
    """A vector whose pieces hold NaN until ``landed`` asks for them (then the true values
    "land"): a piece read before that poisons the sum. Records what was asked, and the
    values of each piece of the result when it was handed back."""

    def __init__(self, host: np.ndarray, values: np.ndarray) -> None:
        self.host, self.values = host, values
        self.host[:] = np.nan
        self.landed_calls: list[tuple[int, int]] = []
        self.finals: list[tuple[int, int, np.ndarray]] = []
        self._lock = threading.Lock()

    def landed(self, lo: int, hi: int) -> None:
        with self._lock:
            self.landed_calls.append((lo, hi))
            fresh = np.isnan(self.host[lo:hi])  # only what never landed: the ring may have
            self.host[lo:hi][fresh] = self.values[lo:hi][fresh]  # written the rest

    def final(self, lo: int, hi: int) -> None:
        with self._lock:
            self.finals.append((lo, hi, self.host[lo:hi].copy()))


async def _run(lanes: bool, steps: int = 3, scheme: ar.Scheme | None = None
               ) -> list[list[tuple[Landing, np.ndarray, bool]]]:
    port = free_port()

    async def rank(r: int) -> list[tuple[Landing, np.ndarray, bool]]:
        env = NodeEnv(r, N, "127.0.0.1", port, b"k" * 32)
        out = []
        async with Node(env, scheme=scheme or ar.Ring(lanes=lanes)) as node:
            for step in range(steps):
                host = np.empty(SIZE, np.float32)
                landing = Landing(host, np.arange(SIZE, dtype=np.float32) * (r + 1) + step)
                order = (node.session.read_order(SIZE)
                         if isinstance(node.session, ReadsInOrder) else ())
                await node.allreduce(host, op="mean", in_place=True, arrival=landing)
                out.append((landing, host, tuple(order) == tuple(landing.landed_calls)))
        return out

    return list(await asyncio.wait_for(asyncio.gather(*[rank(r) for r in range(N)]), 60))


def _want(step: int) -> np.ndarray:
    return (np.arange(SIZE, dtype=np.float32) * sum(range(1, N + 1)) + N * step) / N


def test_lane_ring_reads_pieces_as_they_land_and_hands_back_each_once_final() -> None:
    for r, steps in enumerate(asyncio.run(_run(lanes=True))):
        for step, (landing, host, in_order) in enumerate(steps):
            np.testing.assert_array_equal(host, _want(step))  # no NaN read: every piece landed
            assert in_order, (r, landing.landed_calls)  # first reads in the promised order
            assert len(landing.landed_calls) == N  # one wait per segment, not one for all
            covered = np.zeros(SIZE, int)
            for lo, hi, values in landing.finals:
                covered[lo:hi] += 1
                np.testing.assert_array_equal(values, _want(step)[lo:hi])  # final when handed
            assert (covered == 1).all()


def test_event_loop_ring_waits_for_the_whole_vector_and_hands_back_nothing() -> None:
    for steps in asyncio.run(_run(lanes=False, steps=2)):
        for step, (landing, host, _in_order) in enumerate(steps):
            np.testing.assert_array_equal(host, _want(step))
            assert landing.landed_calls == [(0, SIZE)]
            assert landing.finals == []


def test_a_scheme_that_does_not_sum_in_place_gets_the_whole_vector_first() -> None:
    """The tree copies its result in: the node waits for the whole vector before the step
    reads it, and nothing is handed back piece by piece (the caller copies all of it)."""
    for steps in asyncio.run(_run(lanes=False, steps=2, scheme=ar.Tree())):
        for step, (landing, host, _in_order) in enumerate(steps):
            np.testing.assert_allclose(host, _want(step), rtol=1e-6)
            assert landing.landed_calls == [(0, SIZE)] and landing.finals == []
