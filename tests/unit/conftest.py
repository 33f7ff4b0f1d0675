"""Unit tests that run schemes on the in-memory network use wall-clock deadlines in one
process. A full collection of Python's cyclic garbage collector stops that process for as long
as it takes: with torch and a few hundred tests' objects loaded, over 0.2 s on this machine,
enough for every child of a parent to miss its deadline at once (seen in CI as "cannot decode
without ranks [1, 2, 3]"). Unit tests run with the collector paused (each is short); it
collects between them, when its thresholds say so."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _no_collector_pause_during_a_test() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
