"""Point-to-point messages outside the collective steps (torch's ``send``/``recv``).

A collective takes a step number on every rank; a message between two ranks cannot, since the
other ranks never see it. So each ordered pair (sender, receiver) and user tag counts its own
messages, and the n-th message on it travels as frame (n, ``P2P_TAG + tag``): the sender and the
receiver count the same calls in the same order (torch's contract: matched per peer and tag, in
order), so the n-th ``send`` meets the n-th ``recv`` whatever else runs between them. The
transport keeps such frames until they are received (no step floor applies to them).

The numbers are taken when a call is *issued* (:meth:`PointToPoint.send_key`,
:meth:`PointToPoint.recv_key`), on the caller's thread, so the order is the caller's even
when the transfers then run concurrently.

A receive from any source (:meth:`PointToPoint.recv_any`) cannot take a number when issued:
it waits until the next message with its tag from some peer is here (the transport's
``probe``, which does not receive it), takes that peer's number then, and receives it. Two
receives from any source with one tag take their messages one after the other, in the order
issued. Mixing them with receives from a named source on the same tag is unordered between
the two kinds (as it is in torch's Gloo backend).
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from typing import Protocol

import numpy as np

from ..wire import P2P_TAG, Header
from .base import Comm

MAX_USER_TAG = (1 << 32) - 1

Key = tuple[int, int]  # (step, tag) on the wire


class ProbingComm(Comm, Protocol):
    """A comm that can say a frame is here before anyone receives it (the mesh)."""

    def probe(self, rank: int, *, step: int, tag: int) -> asyncio.Future[None]:
        """Resolves once frame (step, tag) from ``rank`` waits for its receive."""


class PointToPoint:
    """Sequence numbers per (peer, tag) and direction, and the transfers over a comm."""

    def __init__(self, comm: ProbingComm) -> None:
        self.comm = comm
        self._lock = threading.Lock()  # keys may be taken on several trainer threads
        self._any: dict[int, asyncio.Lock] = {}  # tag -> receives from any source, in turn
        self._sent: defaultdict[tuple[int, int], int] = defaultdict(int)
        self._received: defaultdict[tuple[int, int], int] = defaultdict(int)

    def _check(self, peer: int, tag: int) -> None:
        me, n = self.comm.rank, self.comm.world_size
        if not 0 <= peer < n or peer == me:
            raise ValueError(f"rank {me}: point-to-point peer {peer} is not another rank "
                             f"(world size {n})")
        self._check_tag(tag)

    def _check_tag(self, tag: int) -> None:
        if not 0 <= tag <= MAX_USER_TAG:
            raise ValueError(f"rank {self.comm.rank}: point-to-point tag {tag} is outside "
                             f"0..{MAX_USER_TAG}")

    def send_key(self, dst: int, tag: int = 0) -> Key:
        """The key of the next message to ``dst`` with ``tag`` (taken now)."""
        return self._next(self._sent, dst, tag)

    def recv_key(self, src: int, tag: int = 0) -> Key:
        """The key of the next message from ``src`` with ``tag`` (taken now)."""
        return self._next(self._received, src, tag)

    def _next(self, counts: defaultdict[tuple[int, int], int], peer: int, tag: int) -> Key:
        self._check(peer, tag)
        with self._lock:
            seq = counts[peer, tag]
            counts[peer, tag] = seq + 1
        return seq, P2P_TAG + tag

    async def send(self, dst: int, key: Key, array: np.ndarray) -> None:
        """Send ``array`` as message ``key`` (from :meth:`send_key`); returns when it may be
        changed."""
        await self.comm.send(dst, np.ascontiguousarray(array), step=key[0], tag=key[1])

    def recv(self, src: int, key: Key, out: np.ndarray) -> asyncio.Future[Header]:
        """Post the receive of message ``key`` (from :meth:`recv_key`) into ``out``."""
        return self.comm.post_recv(src, out, step=key[0], tag=key[1])

    async def recv_any(self, tag: int, out: np.ndarray) -> int:
        """Receive the next message with ``tag`` from whichever peer's comes first into
        ``out``; returns that peer's rank (see the module docstring). A lost peer is passed
        over; with every peer lost, its ``PeerLost`` is raised."""
        me, n = self.comm.rank, self.comm.world_size
        self._check_tag(tag)
        turn = self._any.setdefault(tag, asyncio.Lock())
        lost: dict[int, BaseException] = {}
        async with turn:
            while True:
                with self._lock:
                    probes = {self.comm.probe(p, step=self._received[p, tag], tag=P2P_TAG + tag): p
                              for p in range(n) if p != me and p not in lost}
                if not probes:  # every peer is lost
                    raise lost[min(lost)]
                try:
                    done, _ = await asyncio.wait(probes, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for probe in probes:
                        probe.cancel()
                here = []
                for f in done:
                    failed = f.exception()
                    if failed is None:
                        here.append(probes[f])
                    else:
                        lost[probes[f]] = failed  # passed over from now on
                if here:
                    src = min(here)
                    await self.recv(src, self.recv_key(src, tag), out)
                    return src
