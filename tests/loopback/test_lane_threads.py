"""``benchmarks/lane_threads.py`` runs each of its ways on real processes and moves every
byte where it belongs (its figures are the benchmark's business, not checked here)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from ..unit.scripts import load


@pytest.mark.parametrize("way", ["threads", "one", "ring"])
def test_each_way_sums_exactly(way: str) -> None:
    bench = load("lane_threads")
    wall, cpu = bench.run(way, 3, 64 << 10, 3)
    assert wall > 0 and cpu > 0


def test_a_wrong_sum_is_named() -> None:
    """The check itself: a way whose bytes go astray is an error, not a figure."""
    bench = load("lane_threads")
    with pytest.raises(RuntimeError, match="wrong sum"):
        bench.run("threads", 3, 64 << 10, 0)  # no step: the vector was never summed


def test_a_rank_that_dies_is_named_at_once() -> None:
    """A rank that dies without reporting fails the launch with its exit code at once,
    instead of a wait for the launch's whole limit (stop 87 saw one launch end in
    `queue.Empty` after 600 s)."""
    bench = load("lane_threads")
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    quiet = ctx.Process(target=os._exit, args=(3,))
    quiet.start()
    quiet.join()
    try:
        with pytest.raises(RuntimeError, match=r"\[\(0, 3\)\] died without a report"):
            bench._collect(results, [quiet], "threads", timeout=600)
    finally:
        results.close()
