"""Unit tests that run schemes on the in-memory network use wall-clock deadlines in one
process. A full collection of Python's cyclic garbage collector stops that process for as long
as it takes: with torch and a few hundred tests' objects loaded, over 0.2 s on this machine,
enough for every child of a parent to miss its deadline at once (seen in CI as "cannot decode
without ranks [1, 2, 3]"). Unit tests run with the collector paused (each is short); it
collects between them, when its thresholds say so.

A module that sets ``AUTOJUMP = True`` (the transpose's, whose stages wait out their bounds for
lost frames) runs on a clock that jumps to the next timer instead (``clockloop.AutoClockLoop``,
through pytest-asyncio's loop-factory hook), and ``time.perf_counter`` reads that clock."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Iterator

import pytest

from .clockloop import AutoClockLoop, loop_perf_counter


@pytest.fixture(autouse=True)
def _no_collector_pause_during_a_test() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _autojump(item: pytest.Item) -> bool:
    return bool(getattr(getattr(item, "module", None), "AUTOJUMP", False))


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """A module that sets ``AUTOJUMP = True`` runs its async tests on an
    :class:`~tests.unit.clockloop.AutoClockLoop`; the others on the loop the event loop
    policy makes, as pytest-asyncio does by default."""
    if _autojump(item):
        return {"autojump": AutoClockLoop}
    return {"default": _policy_loop}


@pytest.fixture(autouse=True)
def _perf_counter_reads_the_jumping_clock(request: pytest.FixtureRequest,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """In such a module, the code under test times itself on the same clock."""
    if _autojump(request.node):
        monkeypatch.setattr(time, "perf_counter", loop_perf_counter)


def _policy_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_event_loop_policy().new_event_loop()
