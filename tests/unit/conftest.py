"""Unit tests that run schemes on the in-memory network use wall-clock deadlines in one
process. A full collection of Python's cyclic garbage collector stops that process for as long
as it takes: with torch and a few hundred tests' objects loaded, over 0.2 s on this machine,
enough for every child of a parent to miss its deadline at once (seen in CI as "cannot decode
without ranks [1, 2, 3]"). Unit tests run with the collector paused (each is short); it
collects between them, when its thresholds say so.

A module that sets ``AUTOJUMP = True`` (the transpose's, whose stages wait out their bounds for
lost frames) runs on a clock that jumps to the next timer instead (``clockloop.AutoClockLoop``,
through pytest-asyncio's loop-factory hook)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterator

import pytest

from .clockloop import AutoClockLoop


@pytest.fixture(autouse=True)
def _no_collector_pause_during_a_test() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """A module that sets ``AUTOJUMP = True`` runs its async tests on an
    :class:`~tests.unit.clockloop.AutoClockLoop`; the others on the loop the event loop
    policy makes, as pytest-asyncio does by default."""
    if getattr(getattr(item, "module", None), "AUTOJUMP", False):
        return {"autojump": AutoClockLoop}
    return {"default": _policy_loop}


def _policy_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_event_loop_policy().new_event_loop()
