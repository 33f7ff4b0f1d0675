"""What every scheme shares: the Comm interface, the step result, errors and options."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from ..errors import AioreduceError
from ..wire import Header

OnInsufficient = Literal["raise", "approximate"]

# Frame tags of one step. Upward chunks use 0..DOWN-1, the result's chunks DOWN + c.
DOWN = 1 << 24
ERROR_TAG = (1 << 30) + 1
ADOPT_TAG = (1 << 30) + 2  # a grandchild asks its grandparent for a step's result


class Comm(Protocol):
    """The point-to-point interface schemes are written against (:class:`~aioreduce.Node`)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    async def send(self, rank: int, array: np.ndarray, *, step: int = 0, tag: int = 0,
                   meta: dict[str, Any] | None = None) -> None: ...

    def post_recv(self, rank: int, out: np.ndarray, *, step: int = 0,
                  tag: int = 0) -> asyncio.Future[Header]: ...

    def discard_before(self, step: int) -> None: ...

    def abort_peer(self, rank: int, reason: str) -> None: ...

    def is_lost(self, rank: int) -> bool: ...

    def relay_from(self, rank: int, min_tag: int,
                   relay: Callable[[Header, memoryview], None]) -> None: ...

    def claim_forward(self, step: int, tag: int) -> bool: ...

    def on_peer_lost(self, listener: Callable[[int], None]) -> None: ...

    @property
    def scheme_state(self) -> dict[str, Any]: ...

    @property
    def closing(self) -> bool: ...


class StragglerError(AioreduceError):
    """A step could not be decoded exactly in time: too many ranks of one family missing."""

    def __init__(self, step: int, missing: list[int], detail: str = "") -> None:
        self.step = step
        self.missing = sorted(missing)
        msg = f"step {step}: cannot decode without ranks {self.missing}"
        super().__init__(msg + (f" ({detail})" if detail else ""))


@dataclass(frozen=True)
class Result:
    """The outcome of one aggregation step; identical on every rank.

    ``value`` is read-only (it may still be in flight to slower ranks); copy it to modify.
    ``used``: ranks whose contributions went into the value; ``late``: ranks that were
    skipped. ``exact`` is False only for an approximate decode, whose error is at most
    ``error_bound`` times the root-sum-square of the parts' gradient norms.
    """

    value: np.ndarray
    step: int
    used: list[int] = field(default_factory=list)
    late: list[int] = field(default_factory=list)
    exact: bool = True
    error_bound: float = 0.0
    seconds: float = 0.0


@dataclass(frozen=True)
class StepOptions:
    """Knobs shared by the tree and star schemes."""

    deadline: float = 30.0  # seconds a parent waits for a sufficient set of children
    on_insufficient: OnInsufficient = "raise"
    chunk_bytes: int = 1 << 20  # pipelining granularity

    def __post_init__(self) -> None:
        if self.deadline <= 0:
            raise ValueError("deadline must be positive")
        if self.on_insufficient not in ("raise", "approximate"):
            raise ValueError("on_insufficient must be 'raise' or 'approximate'")
        if self.chunk_bytes < 1:
            raise ValueError("chunk_bytes must be positive")


def chunk_bounds(length: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Element ranges of the pipelining chunks of a vector (at least one, even if empty)."""
    step = max(1, chunk_bytes // max(1, itemsize))
    return [(lo, min(lo + step, length)) for lo in range(0, length, step)] or [(0, 0)]
