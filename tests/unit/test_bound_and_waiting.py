"""Each scheme's own bound (aioreduce.bench.bound) and the first-done wait."""

from __future__ import annotations

import asyncio

import pytest

from aioreduce.bench.bound import bound
from aioreduce.codes import frc
from aioreduce.schemes import CodedTree, GradientCoding, Ring, Star, Tree
from aioreduce.schemes.waiting import first_done

V = 1 << 20
RATE = 125e6


def test_ring_and_gloo_move_2v_n_minus_1_over_n_through_every_link() -> None:
    for name in ("ring", "gloo"):
        b = bound(name, Ring() if name == "ring" else None, 4, V, rate=RATE, latency=1e-4)
        assert b is not None
        assert b.busiest_bytes == 2 * V * 3 / 4 and b.depth == 6
        assert b.seconds == pytest.approx(2 * V * 3 / 4 / RATE + 6e-4)


def test_a_coded_tree_parent_with_a_parent_moves_fanout_plus_one_vectors() -> None:
    # 13 ranks, fan-out 3, 2 levels: rank 1 has three children and a parent.
    b = bound("coded-tree", CodedTree(3, 2, 1), 13, V, rate=RATE, latency=2e-4)
    assert b is not None and b.busiest_bytes == 4 * V and b.depth == 4


def test_a_binary_tree_of_seven_has_two_levels() -> None:
    b = bound("tree", Tree(fanout=2), 7, V, rate=RATE)
    assert b is not None and b.busiest_bytes == 3 * V and b.depth == 4


def test_a_star_master_sends_the_result_to_every_worker() -> None:
    for name, scheme in (("star", Star()), ("gc", GradientCoding(code=frc(6, 1)))):
        b = bound(name, scheme, 7, V, rate=RATE)
        assert b is not None and b.busiest_bytes == 6 * V and b.depth == 2


def test_no_bound_for_a_scheme_without_a_model() -> None:
    assert bound("tree", None, 4, V, rate=RATE) is None


def test_first_done_returns_at_the_first_and_leaves_no_callback_behind() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        a, b = loop.create_future(), loop.create_future()
        waiting = asyncio.ensure_future(first_done([a, b]))
        await asyncio.sleep(0)
        assert not waiting.done()
        b.set_result(1)
        await waiting
        assert not a.done()
        assert not a._callbacks  # type: ignore[attr-defined]  # (None or [] when empty)
        # Already done: returns at once; cancelled while waiting: the futures stay pending.
        await first_done([a, b])
        c = loop.create_future()
        waiting = asyncio.ensure_future(first_done([c]))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not c.done()

    asyncio.run(main())
