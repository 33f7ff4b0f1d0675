"""An in-memory network of :class:`~aioreduce.schemes.Comm` endpoints, for unit tests.

Every scheme and the failover machine can run in one process, deterministically, in
milliseconds: ``MemoryNetwork(n).comms[r]`` is rank ``r``'s comm. The test controls delivery:

* :meth:`MemoryNetwork.hold` / :meth:`~MemoryNetwork.release` a link (frames queue in order);
* :meth:`~MemoryNetwork.delay` a link by some seconds;
* :meth:`~MemoryNetwork.freeze` / :meth:`~MemoryNetwork.thaw` a rank: nothing reaches it or
  leaves it, and senders to it block as on a full socket buffer (its own code still runs: a
  test does not step a frozen rank, or expects its timers to fire);
* :meth:`~MemoryNetwork.kill` a rank: its connections break, peers get :class:`PeerLost`;
* :meth:`~MemoryNetwork.lose` frames of one tag on a link (the sender believes it sent them),
  as an unreliable network would: for bounded-time schemes.

Matching follows the real inbox: a posted receive wins, else a frame below the floor is
dropped (a payload-less one is still handed to early handlers), else it is staged and handed
to early handlers (and to those registered later with ``since``). This proves scheme logic
only; network claims need real sockets.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import PeerLost, VectorMismatch
from ..wire import Header, Kind, as_payload, byte_view, is_p2p

EarlyHandler = Callable[[Header, memoryview], None]
Key = tuple[int, int]


@dataclass
class _Posted:
    view: memoryview
    dtype: str
    future: asyncio.Future[Header]


@dataclass
class _FromPeer:
    """What one rank holds for frames from one peer."""

    posted: dict[Key, _Posted] = field(default_factory=dict)
    staged: dict[Key, tuple[Header, bytes]] = field(default_factory=dict)
    early: list[tuple[int, EarlyHandler]] = field(default_factory=list)


class MemoryNetwork:
    """``world_size`` in-memory comms and the controls over the links between them."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.comms = [MemoryComm(self, r) for r in range(world_size)]
        self.sent: list[tuple[int, int, int, int]] = []  # (src, dst, step, tag), in order
        # Data frames that arrived before their receive was posted: (src, dst, step, tag).
        self.staged: list[tuple[int, int, int, int]] = []
        self._on_sent = asyncio.Condition()
        self._held: set[tuple[int, int]] = set()
        self._queues: dict[tuple[int, int], deque[tuple[Header, bytes]]] = {}
        self._delay: dict[tuple[int, int], float] = {}
        self._frozen: set[int] = set()
        self._thawed: dict[int, asyncio.Event] = {}
        self.dead: set[int] = set()
        self._lost_tags: set[tuple[int, int, int]] = set()

    # -- controls -----------------------------------------------------------------------------
    def hold(self, src: int, dst: int) -> None:
        self._held.add((src, dst))

    def release(self, src: int, dst: int) -> None:
        self._held.discard((src, dst))
        self._flush(src, dst)

    def delay(self, src: int, dst: int, seconds: float) -> None:
        self._delay[(src, dst)] = seconds

    def freeze(self, rank: int) -> None:
        self._frozen.add(rank)
        self._thawed[rank] = asyncio.Event()

    def thaw(self, rank: int) -> None:
        self._frozen.discard(rank)
        self._thawed.pop(rank, asyncio.Event()).set()
        for a, b in list(self._queues):
            if rank in (a, b):
                self._flush(a, b)

    def lose(self, src: int, dst: int, tag: int) -> None:
        """Frames from ``src`` to ``dst`` with ``tag`` vanish from now on."""
        self._lost_tags.add((src, dst, tag))

    async def until_sent(self, src: int, dst: int, step: int, tag: int) -> None:
        """Return once ``src`` has sent (step, tag) to ``dst`` (held links included)."""
        async with self._on_sent:
            await self._on_sent.wait_for(lambda: (src, dst, step, tag) in self.sent)

    def kill(self, rank: int) -> None:
        self.dead.add(rank)
        for other in self.comms:
            if other.rank != rank:
                other._lost(rank)
        for peer in range(self.world_size):
            if peer != rank:
                self.comms[rank]._lost(peer)

    # -- delivery -------------------------------------------------------------------------------
    def _blocked(self, src: int, dst: int) -> bool:
        return (src, dst) in self._held or src in self._frozen or dst in self._frozen

    async def _send(self, src: int, dst: int, header: Header, payload: bytes) -> None:
        while dst in self._frozen:  # a full socket buffer: the sender waits
            await self._thawed[dst].wait()
        if src in self.dead or dst in self.dead:
            raise PeerLost(dst, "connection closed")
        self.sent.append((src, dst, header.step, header.tag))
        async with self._on_sent:
            self._on_sent.notify_all()
        if (src, dst, header.tag) in self._lost_tags:
            await asyncio.sleep(0)
            return
        self._queues.setdefault((src, dst), deque()).append((header, payload))
        delay = self._delay.get((src, dst), 0.0)
        if delay:
            asyncio.get_running_loop().call_later(delay, self._flush, src, dst)
        else:
            self._flush(src, dst)
        await asyncio.sleep(0)

    def _flush(self, src: int, dst: int) -> None:
        queue = self._queues.get((src, dst))
        while queue and not self._blocked(src, dst) and dst not in self.dead:
            header, payload = queue.popleft()
            self.comms[dst]._arrive(src, header, payload)


class MemoryComm:
    """One rank's endpoint of a :class:`MemoryNetwork` (implements the scheme Comm)."""

    def __init__(self, net: MemoryNetwork, rank: int) -> None:
        self.net = net
        self.rank = rank
        self.world_size = net.world_size
        self.floor: Key = (-(1 << 62), 0)  # (step, tag) below this is stale
        self._peers = {r: _FromPeer() for r in range(net.world_size) if r != rank}
        self._lost_listeners: list[Callable[[int], None]] = []
        self._lost_peers: set[int] = set()

    # -- the Comm interface -------------------------------------------------------------------
    def bulk_links(self) -> None:
        """No blocking links in one process: schemes take the event loop's way."""
        return None

    async def send(self, rank: int, array: np.ndarray, *, step: int, tag: int = 0,
                   meta: dict[str, Any] | None = None) -> None:
        self._check(rank)
        data = as_payload(array)
        header = Header(Kind.DATA, step, tag, self.rank, data.dtype.str, data.shape,
                        meta or {})
        await self.net._send(self.rank, rank, header, bytes(byte_view(data)))

    def post_recv(self, rank: int, out: np.ndarray, *, step: int,
                  tag: int = 0) -> asyncio.Future[Header]:
        self._check(rank)
        fut: asyncio.Future[Header] = asyncio.get_running_loop().create_future()
        peer, key = self._peers[rank], (step, tag)
        staged = peer.staged.pop(key, None)
        if staged is not None:
            _fill(fut, byte_view(out), out.dtype.str, *staged)
        elif rank in self._lost_peers:
            fut.set_exception(PeerLost(rank, "connection closed"))
        else:
            posted = _Posted(byte_view(out), out.dtype.str, fut)
            peer.posted[key] = posted
            fut.add_done_callback(
                lambda f: peer.posted.pop(key, None) if f.cancelled() else None)
        return fut

    def discard_before(self, step: int, tag: int = 0) -> None:
        self.floor = max(self.floor, (step, tag))
        for peer in self._peers.values():
            for key in [k for k in peer.staged if k < self.floor and not is_p2p(k[1])]:
                del peer.staged[key]

    def is_lost(self, rank: int) -> bool:
        return rank in self._lost_peers

    def on_peer_lost(self, listener: Callable[[int], None]) -> Callable[[], None]:
        self._lost_listeners.append(listener)
        return lambda: self._lost_listeners.remove(listener) \
            if listener in self._lost_listeners else None

    def on_early(self, rank: int, min_tag: int, handler: EarlyHandler, *,
                 since: int | None = None) -> Callable[[], None]:
        self._check(rank)
        entry = (min_tag, handler)
        peer = self._peers[rank]
        peer.early.append(entry)
        if since is not None:  # as the inbox: staged frames, handed over soon, once each
            backlog = [k for k in peer.staged if k[0] >= since and k[1] >= min_tag]
            if backlog:
                asyncio.get_running_loop().call_soon(self._replay, peer, entry, backlog)
        return lambda: peer.early.remove(entry) if entry in peer.early else None

    @staticmethod
    def _replay(peer: _FromPeer, entry: tuple[int, EarlyHandler], keys: list[Key]) -> None:
        for key in keys:
            staged = peer.staged.get(key)
            if staged is not None and entry in peer.early:
                entry[1](staged[0], memoryview(staged[1]))

    # -- for tests ----------------------------------------------------------------------------
    def installed(self) -> int:
        """Handlers and listeners currently installed (0 once every session closed)."""
        return len(self._lost_listeners) + sum(len(p.early) for p in self._peers.values())

    # -- the network's side ---------------------------------------------------------------------
    def _arrive(self, src: int, header: Header, payload: bytes) -> None:
        peer, key = self._peers[src], (header.step, header.tag)
        posted = peer.posted.pop(key, None)
        if posted is not None:
            _fill(posted.future, posted.view, posted.dtype, header, payload)
            return
        p2p = is_p2p(header.tag)  # as the inbox: no floor, no early handler
        handled = [] if p2p else [h for lo, h in peer.early if header.tag >= lo]
        if key < self.floor and not p2p:
            if not payload:
                for h in handled:
                    h(header, memoryview(b""))
            return
        peer.staged[key] = (header, payload)
        self.net.staged.append((src, self.rank, header.step, header.tag))
        for h in handled:
            h(header, memoryview(payload))

    def _lost(self, rank: int) -> None:
        self._lost_peers.add(rank)
        peer = self._peers[rank]
        for posted in peer.posted.values():
            if not posted.future.done():
                posted.future.set_exception(PeerLost(rank, "connection closed"))
        peer.posted.clear()
        for listener in list(self._lost_listeners):
            listener(rank)

    def _check(self, rank: int) -> None:
        if rank not in self._peers:
            raise ValueError(f"rank {rank} is not a peer of rank {self.rank}")


def _fill(fut: asyncio.Future[Header], view: memoryview, dtype: str, header: Header,
          payload: bytes) -> None:
    if fut.done():
        return
    if len(payload) != view.nbytes or (payload and header.dtype != dtype):
        fut.set_exception(VectorMismatch(
            f"rank {header.src} sent {len(payload)} bytes {header.dtype} for step "
            f"{header.step} tag {header.tag}, but the receive buffer is {dtype} of "
            f"{view.nbytes} bytes", [header.src]))
        return
    view[:] = payload
    fut.set_result(header)
