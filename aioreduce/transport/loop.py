"""Event-loop selection: uvloop by default, stock asyncio as a fallback.

``AIOREDUCE_LOOP=asyncio`` forces the stock loop (for debugging and for comparison).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """The factory for the loop aioreduce runs on (uvloop unless disabled or missing)."""
    if os.environ.get("AIOREDUCE_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop

            factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
            return factory
        except ImportError:
            pass
    return asyncio.new_event_loop


def is_uvloop(loop: asyncio.AbstractEventLoop) -> bool:
    """True if ``loop`` is a uvloop loop (zero-copy ``writelines``)."""
    return type(loop).__module__.startswith("uvloop")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on aioreduce's preferred loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
