"""A blocking facade for trainers that are not written with asyncio.

    node = aioreduce.connect(scheme=aioreduce.Ring())   # joins the job
    total = node.allreduce(grad).value                   # blocks; a Result, as in asyncio
    node.close()

The node's event loop (uvloop) runs in a background thread, so while the trainer computes in
its own thread the loop keeps receiving: frames of the next step land in their buffers as soon
as their receives are posted, and results are forwarded to slower ranks without waiting for the
trainer. Passing a function instead of an array (``node.aggregate(lambda: grad(...))``) posts
the step's receives first and runs the function in a worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine, Mapping
from types import TracebackType
from typing import Any, Literal, TypeVar

import numpy as np

from .inputs import ReduceOp, Reducible
from .node import Node
from .schemes import Result, Scheme
from .transport.loop import loop_factory

T = TypeVar("T")


class SyncNode:
    """A :class:`~aioreduce.Node` driven from ordinary (non-async) code."""

    def __init__(self, node: Node, timeout: float | None = None) -> None:
        self.node = node
        self.timeout = timeout  # seconds any one call may block (None: no limit)
        self._loop = loop_factory()()
        self._thread = threading.Thread(target=self._loop.run_forever, name="aioreduce-loop",
                                        daemon=True)
        self._thread.start()
        try:
            self._call(node.start())
        except BaseException:
            self._stop_loop()
            raise
        self._closed = False
        self.keepalive: object = None  # what must live as long as the node (a torch store)
        self._turn: asyncio.Lock | None = None  # see submit_in_order

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result(self.timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` (a coroutine of the node's) on the node's loop without waiting."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def submit_in_order(self, make: Callable[[], Coroutine[Any, Any, T]]
                        ) -> concurrent.futures.Future[T]:
        """Like :meth:`submit`, but the coroutines submitted this way run one at a time, in
        the order they were submitted (collectives issued from a trainer's threads: every
        rank issues them in the same order, so they must also run in it)."""
        async def in_turn() -> T:
            if self._turn is None:  # made on the loop, where it is used
                self._turn = asyncio.Lock()
            async with self._turn:  # asyncio.Lock is fair: first come, first served
                return await make()
        return self.submit(in_turn())

    @property
    def rank(self) -> int:
        return self.node.rank

    @property
    def world_size(self) -> int:
        return self.node.world_size

    @property
    def step(self) -> int:
        """The number of the next step (a replacement of a dead rank starts where it healed)."""
        return self.node.step

    def allreduce(self, array: Reducible, *, op: ReduceOp = "sum",
                  any_shape: bool = False, in_place: bool = False) -> Result:
        """The sum (or mean) of every rank's array (uncoded schemes) as a :class:`Result`,
        the same type the async API returns; blocks until it is here (see
        :meth:`Node.allreduce`, also for ``in_place``)."""
        return self._call(self.node.allreduce(array, op=op, any_shape=any_shape,
                                              in_place=in_place))

    def broadcast(self, array: np.ndarray, root: int = 0) -> Result:
        """``root``'s array on every rank (see :meth:`Node.broadcast`)."""
        return self._call(self.node.broadcast(array, root))

    def allgather(self, array: np.ndarray) -> Result:
        """Every rank's array, stacked (see :meth:`Node.allgather`)."""
        return self._call(self.node.allgather(array))

    def use(self, scheme: Scheme, *, keep: bool = False) -> None:
        """Switch schemes between steps, on every rank (see :meth:`Node.use`)."""
        self._call(self.node.use(scheme, keep=keep))

    def aggregate(self, vector: Reducible, *, op: ReduceOp = "sum") -> Result:
        """One coded step (see :meth:`Node.aggregate`); the full :class:`Result`."""
        return self._call(self.node.aggregate(vector, op=op))

    def placement(self, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, weights) this rank computes on under a coded scheme."""
        return self.node.placement(num_samples)

    def replace_lost(self) -> bool:
        """Wait for the replacements of ranks whose death failed steps run with
        ``rerun=False`` (see :meth:`Node.replace_lost`)."""
        return self._call(self.node.replace_lost())

    def barrier(self, timeout: float = 60.0) -> None:
        self._call(self.node.barrier(timeout))

    def close(self, *, wait_for_peers: bool = True) -> None:
        """Leave the job (bounded barrier, then disconnect) and stop the loop thread.
        ``wait_for_peers=False`` skips the barrier (the trainer failed: leave at once)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self.node.close(wait_for_peers=wait_for_peers))
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        if self._loop.is_running():  # end what is still pending there, as asyncio.run does
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancel_pending(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> SyncNode:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # An exception in the trainer surfaces at once: no closing barrier to wait out.
        self.close(wait_for_peers=exc is None)


async def _cancel_pending() -> None:
    """Cancel every other task of the running loop and wait for them: a task left pending
    when the loop closes makes Python print "Task was destroyed but it is pending!" and "Event
    loop is closed" at exit, after the trainer's real error."""
    me = asyncio.current_task()
    rest = [t for t in asyncio.all_tasks() if t is not me]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)


DEFAULT_TIMEOUT = 600.0  # seconds one blocking call may take before TimeoutError


def connect(scheme: Scheme | Literal["auto"] | None = None,
            environ: Mapping[str, str] | None = None,
            timeout: float | None = DEFAULT_TIMEOUT, **kwargs: Any) -> SyncNode:
    """Join the job described by the environment (see :func:`aioreduce.discover`) with a
    blocking interface; ``kwargs`` go to :class:`~aioreduce.Node`. Every call gives up with
    ``TimeoutError`` after ``timeout`` seconds (``None``: wait for ever)."""
    return SyncNode(Node.from_env(environ, scheme=scheme, **kwargs), timeout)
