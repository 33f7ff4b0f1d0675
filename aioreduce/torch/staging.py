"""Device tensors staged through reused host buffers, ordered by stream events.

The transport moves host memory. A tensor on a GPU is copied to a host buffer before it is
sent and the result is copied back, as Gloo does for CUDA tensors:

1. At issue, on the caller's thread: the side stream waits for the caller's current stream (an
   event, never a device-wide synchronize), then copies the tensor device-to-host into a pinned
   buffer, non-blocking, and records ``ready``. The caller goes on at once; while bucket k
   copies, bucket k-1 is on the wire.
2. The collective waits for ``ready`` (off the caller's thread), then runs on the host bytes.
3. The result is copied back on the side stream, non-blocking; the future that completes the
   ``Work`` is made with the device (``torch.futures.Future(devices=...)``) and completed with
   the side stream current, so ``work.wait()`` orders the caller's current stream after the
   copy back, as NCCL and Gloo do. The buffer returns to the pool with an event of that copy:
   nobody gets it again before the copy has read it.

:class:`HostPool` is the pure part (which buffer to hand out, when to wait, how much to hold):
its allocator and events are injected, so it is unit-tested without a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ..tensors import wire_dtype, wire_view

ALIGN = 1 << 16  # buffers are rounded up to this, so buckets of nearby sizes share them


class Event(Protocol):
    """What the pool needs of a CUDA event (``torch.cuda.Event``)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(eq=False)
class Block:
    """One host buffer of the pool (``data``: uint8, ``capacity`` bytes)."""

    data: torch.Tensor
    capacity: int
    busy: bool = False
    until: Event | None = None  # returned, but a copy may still read it until this completes

    def free(self) -> bool:
        return not self.busy and (self.until is None or self.until.query())


@dataclass
class PoolStats:
    """What the pool did: buffers allocated and handed out again, bytes held, waits."""

    allocated: int = 0
    reused: int = 0
    held_bytes: int = 0
    waits: int = 0
    dropped: int = 0


class HostPool:
    """Reused host buffers, bounded in bytes (``limit``, raised to the largest request seen,
    so one bucket never waits for itself). ``take`` hands out the smallest free buffer that
    fits; with none, it allocates while the bound allows, else drops free buffers too small
    to make room, else waits until one comes back (its copy done). Thread-safe."""

    def __init__(self, alloc: Callable[[int], torch.Tensor], limit: int = 256 << 20) -> None:
        self._alloc = alloc
        self.limit = limit
        self.blocks: list[Block] = []
        self.stats = PoolStats()
        self._cv = threading.Condition()

    def take(self, nbytes: int) -> Block:
        """A buffer of at least ``nbytes`` bytes, marked busy until :meth:`give`."""
        want = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._cv:
            self.limit = max(self.limit, want)
            while True:
                fits = [b for b in self.blocks if b.capacity >= want and b.free()]
                if fits:
                    block = min(fits, key=lambda b: b.capacity)
                    block.busy, block.until = True, None
                    self.stats.reused += 1
                    return block
                if self.stats.held_bytes + want > self.limit:
                    self._drop_small(want)
                if self.stats.held_bytes + want <= self.limit:
                    block = Block(self._alloc(want), want, busy=True)
                    self.blocks.append(block)
                    self.stats.allocated += 1
                    self.stats.held_bytes += want
                    return block
                self._wait_for_one()

    def give(self, block: Block, until: Event | None = None) -> None:
        """Return ``block``; it is handed out again once ``until`` (a copy reading or
        writing it) has completed."""
        with self._cv:
            block.busy, block.until = False, until
            self._cv.notify_all()

    def _drop_small(self, want: int) -> None:
        """Free buffers smaller than ``want`` go, largest first, until ``want`` fits."""
        for block in sorted(self.blocks, key=lambda b: -b.capacity):
            if self.stats.held_bytes + want <= self.limit:
                return
            if block.capacity < want and block.free():
                self.blocks.remove(block)
                self.stats.held_bytes -= block.capacity
                self.stats.dropped += 1

    def _wait_for_one(self) -> None:
        """Block until a buffer may have become free: a returned one's copy completes, or
        one is given back."""
        self.stats.waits += 1
        pending = [b for b in self.blocks if not b.busy and b.until is not None]
        if pending:
            until = pending[0].until
            assert until is not None
            self._cv.release()
            try:
                until.synchronize()  # a copy in flight: bounded by the copy itself
            finally:
                self._cv.acquire()
        else:
            self._cv.wait()


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@dataclass(frozen=True)
class Piece:
    """Elements ``[lo, hi)`` of a staged tensor, on the host once ``landed`` completes."""

    lo: int
    hi: int
    landed: Event


@dataclass(eq=False)
class Staged:
    """One tensor as host bytes for the transport; also its
    :class:`~aioreduce.schemes.base.Arrival` (the pieces of the copy, and the copy back of
    each piece of the result as soon as the collective says it is final).

    ``host`` is the numpy array the collective reads and writes (the tensor's wire dtype,
    flat). For a contiguous CPU tensor it is the tensor's own memory; otherwise a host copy
    that :meth:`write_back` puts into the tensor."""

    tensor: torch.Tensor
    host: np.ndarray
    ready: Event | None = None  # the device-to-host copy has landed (all of it)
    stream: Any = None  # the side stream (CUDA), else None
    block: Block | None = None
    pool: HostPool | None = None
    staged_copy: torch.Tensor | None = field(default=None, repr=False)  # a CPU strided case
    pieces: tuple[Piece, ...] = ()  # the device-to-host copy, in the order it was issued
    written: int = 0  # elements already copied back by final()

    def wait_ready(self) -> None:
        """Block until ``host`` holds the tensor's values (the copy is done)."""
        if self.ready is not None and not self.ready.query():
            self.ready.synchronize()

    def landed(self, lo: int, hi: int) -> None:
        """Block until elements ``[lo, hi)`` are on the host (their pieces' copies are done)."""
        if not self.pieces:
            self.wait_ready()
        for p in self.pieces:
            if p.lo < hi and lo < p.hi and not p.landed.query():
                p.landed.synchronize()

    def final(self, lo: int, hi: int) -> None:
        """Copy elements ``[lo, hi)`` of the result back now (on the side stream, without
        waiting): the copy back overlaps the rest of the collective."""
        if self.block is None or hi <= lo:
            return
        size = self.tensor.element_size()
        src = self.block.data[lo * size:hi * size].view(self.tensor.dtype)
        with torch.no_grad(), torch.cuda.stream(self.stream):
            self.tensor.view(-1)[lo:hi].copy_(src, non_blocking=True)
        self.written += hi - lo

    def write_back(self) -> None:
        """Copy ``host`` into the tensor where it is not the tensor's own memory (on the side
        stream for a device tensor; the caller runs this with that stream current), unless
        :meth:`final` already copied all of it."""
        if self.block is not None:
            if self.written >= self.host.size:
                return
            src = self.block.data[:self.host.nbytes].view(self.tensor.dtype)
            with torch.no_grad():
                self.tensor.copy_(src.view(self.tensor.shape), non_blocking=True)
        elif self.staged_copy is not None:
            with torch.no_grad():
                self.tensor.copy_(self.staged_copy.view(self.tensor.shape))

    def release(self) -> None:
        """Return the host buffer once every copy queued on it so far has run."""
        if self.block is not None and self.pool is not None:
            until = self.stream.record_event() if self.stream is not None else None
            self.pool.give(self.block, until)
            self.block = None


class Stager:
    """Stages tensors for one process group: a pinned pool and one side stream per device."""

    def __init__(self, limit: int = 256 << 20) -> None:
        self.pool = HostPool(_pinned, limit)
        self._streams: dict[torch.device, Any] = {}

    def stream(self, device: torch.device) -> Any:
        """The side stream of ``device`` (made once)."""
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return side

    def stage(self, t: torch.Tensor, *, read: bool = True,
              order: Sequence[tuple[int, int]] = ()) -> Staged:
        """``t`` as host bytes; ``read=False`` for an output whose old values nobody needs
        (no copy to the host). ``order``: pieces of ``t`` (element ranges), copied one after
        the other in that order, each with an event of its own, so a collective that reads
        them in that order starts once the first is in (see :meth:`Staged.landed`)."""
        if t.device.type == "cpu":
            if t.is_contiguous():
                return Staged(t, wire_view(t).reshape(-1))
            copy = t.detach().contiguous() if read else torch.empty(t.shape, dtype=t.dtype)
            return Staged(t, wire_view(copy).reshape(-1), staged_copy=copy)
        if t.device.type != "cuda":
            raise TypeError(f"tensors on {t.device} are not supported (cpu and cuda are)")
        side = self.stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))  # after the producer's work
        nbytes = t.numel() * t.element_size()
        block = self.pool.take(nbytes)
        host = block.data[:nbytes].numpy().view(wire_dtype(t.dtype))
        ready: Event | None = None
        pieces: tuple[Piece, ...] = ()
        if read and nbytes:
            with torch.cuda.stream(side):
                if len(order) > 1 and t.is_contiguous():
                    pieces = tuple(self._piece(t, block, lo, hi, side) for lo, hi in order)
                    ready = pieces[-1].landed  # one stream: the last is in after the others
                else:
                    block.data[:nbytes].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
                    ready = side.record_event()
        # The caching allocator must not hand t's memory out again while the side stream
        # may still read or write it.
        t.record_stream(side)
        return Staged(t, host, ready, side, block, self.pool, pieces=pieces)

    @staticmethod
    def _piece(t: torch.Tensor, block: Block, lo: int, hi: int, side: Any) -> Piece:
        """Copy elements ``[lo, hi)`` of ``t`` into ``block`` on ``side`` (current)."""
        size = t.element_size()
        block.data[lo * size:hi * size].view(t.dtype).copy_(t.view(-1)[lo:hi],
                                                            non_blocking=True)
        return Piece(lo, hi, side.record_event())
