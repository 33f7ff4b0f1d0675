"""The mesh: authenticated connections between the ranks of one job, opened on demand.

Every node listens on one port. A connection is dialed by whichever side first needs to send
and then serves both directions; receives match on (source rank, step, tag), so it does not
matter which connection a frame comes in on. Each connection starts with the mutual handshake of
:mod:`aioreduce.wire.handshake`; a peer that fails it is logged with its address and dropped,
and the listener keeps serving.

Ranks on one host. Beside its port a node listens on an abstract Unix socket whose name
follows from the job, its rank and its port (:func:`local_mesh_name`), so a peer can derive it
from the address table. A dialer tries that name first: abstract names belong to a network
namespace, so only a rank on the same host (and namespace) finds it, and elsewhere the connect
is refused at once and the dialer uses TCP. The name is predictable, so another local process
could take it first: the handshake still needs the secret, and a dialer whose handshake over
the Unix socket fails before the peer proved the secret falls back to TCP (a rank of the job
that proved it and then refused us means it: this rank was started twice). A peer that closes
during the handshake without a refusal is gone, not refusing: the dialer reports it lost.
Why Unix sockets: the trees and gradient coding send through these connections, and a Unix
stream costs the kernel less per byte than loopback TCP (see ``MeshOptions.local_unix``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import socket
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from ..errors import AuthError, PeerLost, RecvTimeout
from ..wire import Header, Kind, as_payload, byte_view, control, encode_data, encode_frame, tags
from ..wire.handshake import (
    Accepted,
    ConnectorHandshake,
    ListenerHandshake,
    Proved,
    Refused,
    WrongJob,
    refusal,
)
from ..wire.incarnation import JOINING, Incarnations, Newer, Unregistered
from .inbox import NO_FLOOR, Inbox, PeerBudget
from .lane import ACCEPT_TIMEOUT_S, SPIN_S, Lane, LaneListener, dial, local_name, proof
from .protocol import FrameProtocol
from .ratelog import RateLimitedLog
from .sockopts import raise_fd_limit

log = logging.getLogger("aioreduce.transport")

LANE_TAG = tags.LANE_OFFER  # lane offers (see open_lanes)
_NOTHING = np.empty(0, np.uint8)


async def _send_all(conn: FrameProtocol, out: list[Header]) -> None:
    """Send a handshake step's frames, in order."""
    for header in out:
        await conn.send(encode_frame(header))


@dataclass(frozen=True)
class MeshOptions:
    """Limits and timeouts of a mesh. Defaults suit a cloud cluster."""

    max_payload: int = 1 << 32  # bytes; larger frames are a protocol error
    stage_limit: int = 1 << 20  # early frames up to this size are staged, larger held back
    handshake_timeout: float = 10.0
    # Connections that have not proved the secret yet, held at once; past these the oldest is
    # dropped, so a flood costs bounded memory and descriptors and a correct peer still gets in.
    # A job's own ranks may all dial at once (every peer, from one host when they share it), so
    # a mesh raises both to what its job can legitimately open (see ``Mesh.caps``).
    max_unauthenticated: int = 64
    max_unauthenticated_per_host: int = 16
    connect_timeout: float = 30.0
    user_timeout: float = 30.0  # TCP_USER_TIMEOUT: unacknowledged data this long = dead peer
    # What one authenticated peer can make us hold (staged frames, control messages, steps
    # ahead); past it, that connection is closed as a protocol error.
    peer_budget: PeerBudget = field(default_factory=PeerBudget)
    # Emulated one-way latency of every data frame, seconds (0: none): for clusters emulated
    # on one machine, whose links tc can shape but not delay (no netem). See inbox.py.
    latency: float = 0.0
    # While a payload lands, wake up once this many of its bytes are readable (or its rest),
    # not on every TCP segment (SO_RCVLOWAT; see protocol.py). 0 or 1: every segment.
    recv_lowat: int = 1 << 20
    # Ranks on one host talk over Unix sockets instead of TCP, both the mesh's connections
    # (see Mesh.listen) and the lanes (see lane.py): the kernel copies the same bytes at less
    # cost. Our ring over lanes, 4 ranks on one 2-core host, in place, 3 runs each
    # (2026-11-25): 16 MiB 19.5-25.6 ms against TCP's 27.5-27.7, 64 MiB 75-83 against 92-99.
    # At 1 MiB lanes alone on Unix were slower (3.5-4.0 against 3.0-3.3); with the mesh on
    # Unix too, 2.7 against 3.1-3.5 (2026-11-26). A binary tree of 7 ranks at 64 MiB:
    # 171-184 ms against 197-205. False: TCP always (AIOREDUCE_LOCAL_UNIX=0).
    local_unix: bool = True
    # Seconds an in-order lane receive (the ring's, a round trip's) polls for its message
    # before it blocks (``Lane.spin``); None: ``lane.SPIN_S`` where this host has a core for
    # each of its ranks, else 0.
    lane_spin: float | None = None


def spin_for(ranks_here: int, cores: int) -> float:
    """The lanes' poll before a blocking receive for ``ranks_here`` ranks on a host whose
    processes may use ``cores`` cores: ``lane.SPIN_S`` if each rank has one, else 0."""
    return SPIN_S if ranks_here <= cores else 0.0


class Mesh:
    """Connections, handshakes and receive matching for one rank (the Router of its conns)."""

    def __init__(self, rank: int, world_size: int, secret: bytes, job: str,
                 options: MeshOptions | None = None) -> None:
        if not secret:
            raise ValueError("a job secret is required")
        self.rank = rank
        self.world_size = world_size
        self.job = job
        self.options = options or MeshOptions()
        self._secret = secret
        self.addresses: dict[int, tuple[str, int]] = {}
        self.host = "127.0.0.1"  # where we listen (set by listen); lanes listen there too
        # How many hosts the ranks were on when the job started (rank 0's first table says;
        # a replacement learns it from its table, so a move changes no rank's chunking).
        self.hosts = 1
        self._lost_listeners: list[Callable[[int], None]] = []
        self._inbox = {r: Inbox(r, self.options.stage_limit, self._peer_lost,
                                self.options.peer_budget, self.options.latency,
                                self._out_of_band)
                       for r in range(world_size)}
        # Which process of each rank we talk to (see aioreduce.wire.incarnation).
        self.incarnations = Incarnations(rank, world_size)
        # Rank 0, while the job runs: a replacement process of this rank connected and will
        # register (the rendezvous serves it).
        self.on_joining: Callable[[int], None] | None = None
        # Ranks whose process connected claiming no incarnation (JOINING) before this one
        # knew the job runs: at the start, every rank; for a dead rank 0's replacement, the
        # replacements of other ranks that reached it first (their registrations may still
        # be on the way when a live rank says the job runs; the rendezvous serves them).
        self.joined_early: set[int] = set()
        # A rank-0 process with no incarnation yet: a live rank says the job runs (it
        # replaces a dead rank 0; see aioreduce.transport.rendezvous).
        self.on_running: Callable[[int, control.Running], None] | None = None
        # Any other rank, once registered: a rank-0 process with no incarnation yet took our
        # dial (a dead rank 0's replacement: the rendezvous tells it the job runs).
        self.on_rank0_joining: Callable[[], None] | None = None
        self.leaving = False  # the job's last barrier began: nobody is dialed anew for it
        self._replacements: dict[int, list[asyncio.Future[None]]] = {}  # see replaced()
        # A rank that rejoined or fell behind asks for the job's state (see aioreduce.heal).
        self.on_heal: Callable[[int, control.HealAsk], None] | None = None
        # A ring's lowest member re-forms it (see aioreduce.heal).
        self.on_reform: Callable[[int, control.Reform], None] | None = None
        # A rank asks for a group's last step that failed there (see aioreduce.heal).
        self.on_result_ask: Callable[[int, control.ResultAsk], None] | None = None
        self._dial_locks: dict[int, asyncio.Lock] = {}
        # rank -> (the address being dialed, resolved when the rank moves elsewhere): see
        # set_address.
        self._dialing: dict[int, tuple[tuple[str, int], asyncio.Future[None]]] = {}
        self._floor: tuple[int, int] = (NO_FLOOR, 0)  # what discard_before set last
        self._peers = frozenset(range(world_size)) - {rank}  # the ranks _check_rank lets by
        self._server: asyncio.Server | None = None
        self._local_server: asyncio.AbstractServer | None = None  # the Unix socket beside it
        self._conns: set[FrameProtocol] = set()
        # Lanes this mesh opened to its peers (their owners close them), for unacked():
        # weakly, so a closed and dropped lane is forgotten.
        self._lanes: weakref.WeakSet[Lane] = weakref.WeakSet()
        self._tasks: set[asyncio.Task[None]] = set()
        self.refused = 0  # connections that failed the handshake (for tests and logs)
        self._unauthenticated: OrderedDict[FrameProtocol, str] = OrderedDict()  # -> host
        # Handshake frames each of them has sent us: evictions take the least advanced first
        # (the oldest of those), so a flood of idle connections from a peer's own address
        # cannot push out the peer itself, which sends its first frame at once.
        self._progress: dict[FrameProtocol, int] = {}
        self._dialed_by: dict[int, set[FrameProtocol]] = {}  # connections each rank dialed to us
        self._settled = asyncio.Event()  # set while no handshake is in flight
        self._settled.set()
        self.duplicates: dict[int, list[str]] = {}  # rank -> addresses of processes claiming it
        # rank -> the job id it was started for: it proved our secret under another job id
        self.wrong_jobs: dict[int, str] = {}
        self.barriers = 0  # barrier calls so far: each one's number (see rendezvous.barrier)
        self.misconfigured = asyncio.Event()  # a duplicate or wrong job id was seen
        self._refusals = RateLimitedLog(log)
        # (all, per host): every other rank dials us at most once at a time
        self.caps = (max(self.options.max_unauthenticated, 2 * (world_size - 1)),
                     max(self.options.max_unauthenticated_per_host, world_size - 1))

    # -- listening ----------------------------------------------------------------------------
    async def listen(self, host: str, port: int = 0) -> tuple[str, int]:
        """Start accepting connections; return the bound (host, port)."""
        raise_fd_limit()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._incoming, host, port, backlog=1024,
                                                reuse_address=True)
        sockname = self._server.sockets[0].getsockname()
        self.host = sockname[0]
        if self.options.local_unix:
            await self._listen_local(sockname[1])
        return sockname[0], sockname[1]

    async def _listen_local(self, port: int) -> None:
        """Listen on our abstract Unix name too (see the module docstring), if we can."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(local_mesh_name(self.job, self.rank, port))
            sock.listen(1024)
            sock.setblocking(False)
        except OSError as exc:  # taken, or no abstract sockets here: peers dial TCP
            sock.close()
            log.info("rank %d: no local Unix socket (%s); ranks on this host dial TCP",
                     self.rank, exc)
            return
        loop = asyncio.get_running_loop()
        self._local_server = await loop.create_unix_server(self._incoming, sock=sock)

    def stop_listening(self) -> None:
        """Accept no new connections; established ones stay up."""
        for server in (self._server, self._local_server):
            if server is not None:
                server.close()

    def _new_protocol(self) -> FrameProtocol:
        conn = FrameProtocol(self.options.max_payload, self.options.user_timeout,
                             self.options.recv_lowat)
        self._conns.add(conn)
        conn.closed.add_done_callback(lambda _f: self._conns.discard(conn))
        return conn

    def _incoming(self) -> FrameProtocol:
        conn = self._new_protocol()
        # uvloop makes the connection (and learns the peer's address) after this factory
        # returns; a handshake started here would count every burst of peers against an
        # unknown host "?", so the per-host cap evicted correct ranks of jobs over 16 ranks.
        conn.on_made = lambda c: self.spawn(self._accept(c))
        return conn

    def _admit(self, conn: FrameProtocol) -> None:
        """Count a new unauthenticated connection; past the caps, drop the oldest of those
        that made the least progress in their handshake (this one, if every other has)."""
        host = conn.peername.rsplit(":", 1)[0]
        self._unauthenticated[conn] = host
        self._progress[conn] = 0
        self._settled.clear()
        same = [c for c, h in self._unauthenticated.items() if h == host]
        cap_all, cap_host = self.caps
        if len(same) > cap_host:
            self._evict(self._least_advanced(same),
                        f"more than {cap_host} unauthenticated connections from {host}")
        if len(self._unauthenticated) > cap_all:
            self._evict(self._least_advanced(list(self._unauthenticated)),
                        f"more than {cap_all} unauthenticated connections")

    def _least_advanced(self, conns: list[FrameProtocol]) -> FrameProtocol:
        """The oldest of ``conns`` (in arrival order) among those with the fewest handshake
        frames received."""
        return min(conns, key=lambda c: self._progress.get(c, 0))

    def _evict(self, conn: FrameProtocol, reason: str) -> None:
        self._forget_unauthenticated(conn)
        conn.abort(reason)

    def _forget_unauthenticated(self, conn: FrameProtocol) -> None:
        self._unauthenticated.pop(conn, None)
        self._progress.pop(conn, None)
        if not self._unauthenticated:
            self._settled.set()

    async def handshakes_settled(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until no connection is half-way through its handshake:
        rank 0 looks once more for a rank started twice before it sends the address table."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._settled.wait(), timeout)

    async def _accept(self, conn: FrameProtocol) -> None:
        """Listener side of the handshake; never raises (a bad peer must not hurt the node)."""
        hs = ListenerHandshake(self._secret, self.job, self.rank, self.world_size,
                               self.incarnations.mine)
        self._admit(conn)
        joining = False
        try:
            while True:
                frame = await self._next_handshake(conn)
                if conn in self._progress:
                    self._progress[conn] += 1
                out, event = hs.receive(frame)
                if isinstance(event, Refused):
                    await self._tell_refused(conn, out)
                    raise AuthError(event.reason)
                if isinstance(event, WrongJob):
                    await _send_all(conn, out)  # tell it which job this is, then drop it
                    self._wrong_job(event)
                    raise AuthError(f"rank {event.rank} was started for job {event.job!r}")
                if isinstance(event, Accepted):
                    try:
                        self._refuse_stale(event.rank, event.incarnation, conn.peername)
                        self._refuse_duplicate(conn, event.rank)
                        joining = self._judge(event.rank, event.incarnation, conn.peername)
                    except AuthError as exc:  # a rank of the job: tell it why
                        await self._tell_refused(conn, [refusal(self.rank, str(exc))])
                        raise
                    self._attach(conn, event.rank)  # before WELCOME: data may follow it
                    self._note_dialed(event.rank, conn)
                await _send_all(conn, out)
                if event is not None:
                    if joining and self.on_joining is not None:
                        self.on_joining(event.rank)
                    return
        except (AuthError, TimeoutError, PeerLost, ConnectionError) as exc:
            self.refused += 1
            why = exc if str(exc) else type(exc).__name__
            if isinstance(exc, PeerLost | ConnectionError):
                # Not refused: the dialer went away (a process killed or ended mid-handshake,
                # a port scan's connect and close), which a log must not call a refusal.
                self._refusals.warn("connection from %s ended during the handshake (%s)",
                                    conn.peername, "closed by the dialer"
                                    if isinstance(exc, PeerLost) else why)
            else:
                self._refusals.warn("refused connection from %s: %s", conn.peername, why)
            conn.abort("handshake failed")
        except Exception:  # defensive: log, drop the connection, keep serving
            self.refused += 1
            log.exception("handshake with %s failed unexpectedly", conn.peername)
            conn.abort("handshake failed")
        finally:
            self._forget_unauthenticated(conn)

    async def _tell_refused(self, conn: FrameProtocol, out: list[Header]) -> None:
        """Send the refusal before the connection is dropped, so that the dialer can tell a
        refusal from a death (see :mod:`aioreduce.wire.handshake`); a peer already gone
        is no matter."""
        with contextlib.suppress(PeerLost, ConnectionError):
            await _send_all(conn, out)

    async def _next_handshake(self, conn: FrameProtocol) -> Header:
        """The next handshake frame, within the handshake timeout."""
        get = asyncio.ensure_future(conn.handshake.get())
        waits: set[asyncio.Future[Any]] = {get, conn.closed}
        done, _ = await asyncio.wait(waits, timeout=self.options.handshake_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if get not in done:
            get.cancel()
            if conn.closed.done():
                raise PeerLost(-1, f"{conn.peername} closed during the handshake")
            raise TimeoutError(f"no handshake frame within {self.options.handshake_timeout} s")
        return get.result()

    def _refuse_duplicate(self, conn: FrameProtocol, rank: int) -> None:
        """A process dials each peer at most once at a time: a second live connection that
        proves the secret *as the same rank* comes from another process claiming that rank."""
        live = [c for c in self._dialed_by.get(rank, ()) if not c.closed.done()]
        if live:
            where = [live[0].peername, conn.peername]
            self.duplicates.setdefault(rank, []).extend(
                w for w in where if w not in self.duplicates.get(rank, []))
            self.misconfigured.set()
            text = (f"rank {rank} was started twice (from {where[0]} and {where[1]}); the "
                    "second was refused: check the launch, every rank must be started once")
            log.error("rank %d: %s", self.rank, text)
            if len(self.addresses) == self.world_size:  # the job runs: tell every rank
                self.spawn(self._notify_all(text))
            raise AuthError(f"rank {rank} was started twice: it is already connected from "
                            f"{where[0]}")

    def _judge(self, rank: int, claimed: int, where: str, *, dialed: bool = False) -> bool:
        """Apply :class:`Incarnations`' judgement of a handshake in which ``rank`` claims
        incarnation ``claimed``; raise :class:`AuthError` to refuse it. True: a replacement
        process joins the running job (rank 0)."""
        self._refuse_stale(rank, claimed, where)
        verdict = self.incarnations.judge(rank, claimed, dialed=dialed)
        if isinstance(verdict, Unregistered):
            raise AuthError(f"rank {rank} has no incarnation yet (it has not registered with "
                            "rank 0)")
        if isinstance(verdict, Newer):
            log.info("rank %d: rank %d is incarnation %d now (%s)", self.rank, rank,
                     verdict.incarnation, where)
            self._inbox[rank].new_incarnation()
            for fut in self._replacements.pop(rank, []):
                if not fut.done():
                    fut.set_result(None)
        if claimed == JOINING and not self.incarnations.running:
            self.joined_early.add(rank)
        return claimed == JOINING and self.incarnations.running

    def replaced(self, rank: int, incarnation: int) -> asyncio.Future[None]:
        """Resolves once ``rank`` runs a newer process than incarnation ``incarnation``."""
        fut = asyncio.get_running_loop().create_future()
        if self.incarnations.known[rank] > incarnation:
            fut.set_result(None)
        else:
            waiting = self._replacements.setdefault(rank, [])
            waiting[:] = [f for f in waiting if not f.done()]
            waiting.append(fut)
        return fut

    def _refuse_stale(self, rank: int, claimed: int, where: str) -> None:
        """A replaced process of ``rank`` came back: refuse it and name it on every rank."""
        stale = self.incarnations.stale(rank, claimed)
        if stale is None:
            return
        text = stale.text(where)
        log.error("rank %d: %s", self.rank, text)
        if len(self.addresses) == self.world_size:  # the job runs: tell every rank
            self.spawn(self._notify_all(text))
        raise AuthError(f"rank {rank}: stale incarnation {claimed}")

    def _out_of_band(self, rank: int, meta: dict[str, object]) -> None:
        """A control message handled as it arrives (see :data:`control.OUT_OF_BAND`)."""
        try:
            event = control.decode(dict(meta))
        except control.MalformedControl as exc:
            log.warning("rank %d: malformed control message from rank %d: %s", self.rank,
                        rank, exc)
            return
        if isinstance(event, control.Moved) and rank == 0 and event.rank != self.rank:
            if (0 <= event.rank < self.world_size
                    and not self.incarnations.stale(event.rank, event.incarnation)):
                self.set_address(event.rank, (event.host, event.port))
                self._judge(event.rank, event.incarnation, "rank 0's table")
        elif isinstance(event, control.Running) and self.on_running is not None:
            self.on_running(rank, event)
        elif isinstance(event, control.HealAsk) and self.on_heal is not None:
            self.on_heal(rank, event)
        elif isinstance(event, control.Reform) and self.on_reform is not None:
            self.on_reform(rank, event)
        elif isinstance(event, control.ResultAsk) and self.on_result_ask is not None:
            self.on_result_ask(rank, event)

    def _wrong_job(self, event: WrongJob) -> None:
        """A process of ours (it knows the secret) was started with another job id."""
        if event.rank not in self.wrong_jobs:
            log.error("rank %d: rank %d was started for job %r, this job is %r: check "
                      "AIOREDUCE_JOB on every host", self.rank, event.rank, event.job, self.job)
        self.wrong_jobs[event.rank] = event.job
        self.misconfigured.set()

    async def _notify_all(self, text: str) -> None:
        peers = [r for r in range(self.world_size) if r != self.rank]
        await asyncio.gather(*(self.send_control(r, control.Notice(text))
                               for r in peers), return_exceptions=True)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task the mesh owns (cancelled when it closes)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _note_dialed(self, rank: int, conn: FrameProtocol) -> None:
        dialed = self._dialed_by.setdefault(rank, set())
        dialed.add(conn)
        conn.closed.add_done_callback(lambda _f: dialed.discard(conn))

    def _attach(self, conn: FrameProtocol, rank: int) -> None:
        conn.authenticated(rank, self._inbox[rank])  # frames go straight to the peer's inbox
        self._inbox[rank].connection_added(conn)

    # -- dialing ------------------------------------------------------------------------------
    async def connect(self, rank: int, address: tuple[str, int] | None = None) -> FrameProtocol:
        """A live authenticated connection to ``rank``, dialing it if there is none."""
        live = self._live(rank)
        if live is not None:
            return live
        lock = self._dial_locks.setdefault(rank, asyncio.Lock())
        async with lock:
            live = self._live(rank)
            if live is not None:
                return live
            addr = address or self.addresses.get(rank)
            if addr is None:
                raise PeerLost(rank, "address unknown (rendezvous not done?)")
            return await self._dial(rank, addr)

    def set_address(self, rank: int, address: tuple[str, int]) -> None:
        """Where ``rank`` listens from now on (its replacement process). A dial of it in
        progress to another address, where its dead process listened, fails at once with
        :class:`PeerLost`: that old port may be anyone's now, even a listener that never
        answers. Not dialed again at the new address: what the caller meant for the dead
        process (a step it was in) is lost with it, and its step fails as it would have had
        the dial been refused; the next :meth:`connect` dials the new address."""
        self.addresses[rank] = address
        dialing = self._dialing.get(rank)
        if dialing is not None and dialing[0] != address and not dialing[1].done():
            dialing[1].set_result(None)

    def _peer_lost(self, rank: int) -> None:
        for listener in list(self._lost_listeners):
            try:
                listener(rank)
            except Exception:  # a listener's bug must not break the transport
                log.exception("peer-lost listener failed")

    def on_peer_lost(self, listener: Callable[[int], None]) -> Callable[[], None]:
        """Call ``listener(rank)`` whenever a peer's last connection breaks; returns the
        remover."""
        self._lost_listeners.append(listener)

        def remove() -> None:
            if listener in self._lost_listeners:
                self._lost_listeners.remove(listener)

        return remove

    def on_early(self, rank: int, min_tag: int,
                 handler: Callable[[Header, memoryview], None], *,
                 since: int | None = None) -> Callable[[], None]:
        """Hand frames from ``rank`` with tag >= ``min_tag`` to ``handler`` when they arrive
        before their receive is posted, and those of steps >= ``since`` staged already (see
        :meth:`Inbox.on_early`); returns the remover."""
        self._check_rank(rank)
        return self._inbox[rank].on_early(min_tag, handler, since=since)

    def probe(self, rank: int, *, step: int, tag: int) -> asyncio.Future[None]:
        """Resolves once a frame (step, tag) from ``rank`` is here, not yet received (see
        :meth:`Inbox.probe`)."""
        self._check_rank(rank)
        return self._inbox[rank].probe((step, tag))

    def is_lost(self, rank: int) -> bool:
        """True if ``rank`` had a connection that broke and has not come back."""
        inbox = self._inbox[rank]
        return inbox.lost is not None and not inbox.conns

    def connected(self, rank: int) -> bool:
        """Is there a live authenticated connection to ``rank`` (no dial needed)?"""
        return self._live(rank) is not None

    def _live(self, rank: int) -> FrameProtocol | None:
        for conn in self._inbox[rank].conns:
            if not conn.closed.done():
                return conn
        return None

    async def _dial(self, rank: int, addr: tuple[str, int]) -> FrameProtocol:
        if self.options.local_unix:
            conn = await self._open_local(rank, addr[1])
            if conn is not None:
                try:
                    return await self._handshake(conn, rank, f"rank {rank} (local socket)")
                except (_Unproven, PeerLost) as exc:  # someone else holds the name (see
                    # the docstring), silent or refusing
                    self._refusals.warn("rank %d: %s; dialing TCP instead", self.rank, exc)
        # Given up if the rank moves meanwhile (see set_address).
        moved = asyncio.get_running_loop().create_future()
        self._dialing[rank] = (addr, moved)
        dial = asyncio.ensure_future(self._dial_tcp(rank, addr))
        # Its failure is ours, or nobody's if we are cancelled first: heard either way.
        dial.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            await asyncio.wait({dial, moved}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if self._dialing.get(rank, (addr, None))[1] is moved:
                del self._dialing[rank]
            if not dial.done():
                dial.cancel()  # it aborts its connection
        if not dial.done():
            host, port = self.addresses[rank]
            raise PeerLost(rank, f"dialing {addr[0]}:{addr[1]} given up: a new process of the "
                           f"rank listens at {host}:{port}")
        return dial.result()

    async def _dial_tcp(self, rank: int, addr: tuple[str, int]) -> FrameProtocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.options.connect_timeout):
                _t, conn = await loop.create_connection(self._new_protocol, addr[0], addr[1])
        except (OSError, TimeoutError) as exc:
            raise PeerLost(rank, f"cannot connect to {addr[0]}:{addr[1]}: {exc}") from None
        sock = _t.get_extra_info("socket")
        if sock is not None and sock.getsockname() == sock.getpeername():
            # Nothing listened there, and the kernel gave this dial the port it dialed as its
            # own (a port of the ephemeral range on this host): TCP connected the socket to
            # itself. As a refused dial: the caller tries again.
            conn.abort("connected to itself")
            raise PeerLost(rank, f"cannot connect to {addr[0]}:{addr[1]}: nothing listens "
                           "there (the dial connected to itself)")
        try:
            return await self._handshake(conn, rank, f"rank {rank} at {addr[0]}:{addr[1]}")
        except asyncio.CancelledError:
            conn.abort("dial given up")
            raise

    async def _open_local(self, rank: int, port: int) -> FrameProtocol | None:
        """A connection to ``rank``'s abstract Unix socket, or None if it is not on this host."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(self.options.connect_timeout):
                await loop.sock_connect(sock, local_mesh_name(self.job, rank, port))
                _t, conn = await loop.create_unix_connection(self._new_protocol, sock=sock)
        except (OSError, TimeoutError):  # no such name in this namespace: TCP
            sock.close()
            return None
        return conn

    async def _handshake(self, conn: FrameProtocol, rank: int, where: str) -> FrameProtocol:
        """Connector side of the handshake on a fresh connection to ``rank``. Fails with
        :class:`AuthError` when refused; with its subclass ``_Unproven`` if the peer never
        proved the secret (not a rank of this job: a squatter on a Unix name, or a wrong
        secret); with :class:`PeerLost` if it answered nothing in time or closed without a
        refusal (a process that dies during the handshake)."""
        hs = ConnectorHandshake(self._secret, self.job, self.rank, rank, self.incarnations.mine)
        proved, claimed = False, JOINING
        try:
            await conn.send(encode_frame(hs.start()))
            while True:
                frame = await self._next_handshake(conn)
                if conn in self._progress:
                    self._progress[conn] += 1
                out, event = hs.receive(frame)
                if isinstance(event, Refused):
                    raise AuthError(f"{where}: {event.reason}")
                if isinstance(event, Proved):
                    proved, claimed = True, event.incarnation
                    self._judge(rank, event.incarnation, where, dialed=True)
                    conn.arm(rank, self._inbox[rank])  # WELCOME may carry data behind it
                await _send_all(conn, out)
                if isinstance(event, Accepted):
                    break
        except PeerLost:
            # Closed with no refusal said: the process is gone (killed mid-handshake, or its
            # host went away), not a refusal. As an unreachable peer, like a refused connect.
            conn.abort("closed during the handshake")
            raise PeerLost(rank, f"{where} closed the connection during the handshake without "
                           "refusing it (the process is gone)") from None
        except TimeoutError as exc:
            # Silence proves nothing, unlike a refusal: a stopped process, or a listener that
            # is not a rank of this job (a dead rank's old port, taken by anyone since). As
            # an unreachable peer: the caller may retry, heal, or dial where it moved.
            conn.abort("handshake timed out")
            raise PeerLost(rank, f"handshake with {where}: {exc} (the process is stopped, or "
                           "that address is not this job's any more)") from None
        except AuthError as exc:
            failure = str(exc)
        else:
            self._inbox[rank].connection_added(conn)
            if rank == 0 and claimed == JOINING and self.on_rank0_joining is not None:
                self.on_rank0_joining()
            return conn
        conn.abort("handshake failed")
        # A rank of this job that proved the secret and then refused us (this rank was
        # started twice, or for another job id) means it: no second try over TCP.
        raise (AuthError if proved else _Unproven)(failure)

    # -- data ---------------------------------------------------------------------------------
    async def send(self, rank: int, array: np.ndarray, *, step: int, tag: int = 0,
                   meta: dict[str, Any] | None = None) -> None:
        """Send ``array`` (and small ``meta``) to ``rank``; return when it may be modified."""
        if rank not in self._peers:  # (the check inline: every frame sent)
            self._check_rank(rank)
        payload = as_payload(array)
        conn = self._live(rank) or await self.connect(rank)
        await conn.send(encode_data(step, tag, self.rank, payload, meta))

    async def recv_into(self, rank: int, out: np.ndarray, *, step: int, tag: int = 0,
                        timeout: float | None = None) -> Header:
        """Receive the frame (step, tag) from ``rank`` straight into ``out``."""
        key = (step, tag)
        fut = self._post(rank, out, key)
        inbox = self._inbox[rank]
        if fut.done():
            return fut.result()
        # A timer instead of asyncio.timeout + shield, and no done-callback: this path runs
        # once per frame, and those helpers cost more than the rest of a receive together.
        timer = None
        if timeout is not None:
            def expire() -> None:
                if not fut.done():
                    inbox.cancel(key, fut)
                    fut.set_exception(RecvTimeout(rank, step, tag, timeout))

            timer = asyncio.get_running_loop().call_later(timeout, expire)
        try:
            return await fut
        finally:
            if timer is not None:
                timer.cancel()
            if fut.cancelled():  # our caller was cancelled: withdraw the receive
                inbox.cancel(key, fut)

    def post_recv(self, rank: int, out: np.ndarray, *, step: int, tag: int = 0
                  ) -> asyncio.Future[Header]:
        """Post a receive of (step, tag) from ``rank`` into ``out`` and return its future.

        The future resolves with the frame's header once every byte is in ``out``, or fails
        with :class:`PeerLost`. Cancelling it withdraws the receive: ``out`` is not written
        again. Schemes post all the receives of a step at once and wait on the futures with
        their own deadlines, without a task per receive.
        """
        key = (step, tag)
        fut = self._post(rank, out, key)
        inbox = self._inbox[rank]

        def withdrawn(f: asyncio.Future[Header]) -> None:
            if f.cancelled():
                inbox.cancel(key, f)

        fut.add_done_callback(withdrawn)
        return fut

    def _post(self, rank: int, out: np.ndarray, key: tuple[int, int]) -> asyncio.Future[Header]:
        if rank not in self._peers:  # (the check inline: every receive posted)
            self._check_rank(rank)
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("recv_into needs a writable C-contiguous array (receiving into a "
                             "strided view would need a copy)")
        return self._inbox[rank].post(key, byte_view(out), out.dtype.str)

    def discard_before(self, step: int, tag: int = 0) -> None:
        """Unclaimed frames of steps below ``step`` (and of ``step`` with a tag below
        ``tag``) from any peer are stale: drop them, now and later."""
        key = (step, tag)
        if key <= self._floor:  # schemes call this twice a step: once per peer is enough
            return
        self._floor = key
        Inbox.set_floors(self._inbox.values(), step, tag)

    async def open_lanes(self, send_to: int, recv_from: int, step: int,
                         timeout: float = ACCEPT_TIMEOUT_S) -> tuple[Lane, Lane]:
        """A lane to ``send_to`` and one from ``recv_from`` (see :mod:`.lane`), opened with
        both peers at their step ``step``: each rank tells the rank it receives from where to
        connect and which nonce to prove, over this mesh."""
        outs, ins = await self.open_links([send_to], [recv_from], step, timeout)
        return outs[send_to], ins[recv_from]

    async def _offer_of(self, dst: int, fut: asyncio.Future[Header], step: int,
                        timeout: float) -> Header:
        """``dst``'s lane offer for ``step``; a ``TimeoutError`` that names it and us if
        it does not come within ``timeout`` (a peer that is not opening lanes at this step:
        the job's log must say who)."""
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise TimeoutError(f"rank {self.rank}: rank {dst} sent no lane offer for step "
                               f"{step} within {timeout:g} s (it is not opening lanes with "
                               "us at that step)") from None

    def lane_spin(self) -> float:
        """How long this rank's in-order lane receives poll before they block (see
        ``MeshOptions.lane_spin``): the ranks on this host are those whose address has our
        host (as the job's table gives them)."""
        if self.options.lane_spin is not None:
            return self.options.lane_spin
        mine = self.addresses.get(self.rank, (self.host, 0))[0]
        here = sum(1 for host, _port in self.addresses.values() if host == mine)
        return spin_for(max(1, here), len(os.sched_getaffinity(0)))

    def bulk_links(self) -> Mesh:
        """This mesh offers its lanes as the schemes' bulk links (``Comm.bulk_links``)."""
        return self

    @property
    def spans_hosts(self) -> bool:
        """Whether the job started on more than one host (``Mesh.hosts``)."""
        return self.hosts > 1

    def count_moved(self, step: int, sent: int, src: int, received: int, frames: int) -> None:
        """Nothing to count: the mesh keeps no step telemetry (a tracing comm does)."""

    async def open_links(self, send_to: Sequence[int], recv_from: Sequence[int], step: int,
                         timeout: float = ACCEPT_TIMEOUT_S, *, partial: bool = False
                         ) -> tuple[dict[int, Lane], dict[int, Lane]]:
        """Lanes to every rank of ``send_to`` and from every rank of ``recv_from`` at once
        (what :meth:`open_lanes` does for one of each): the schemes' bulk links. Every peer
        must open its side at the same ``step``. All or nothing: if one fails, the others are
        closed and its error raised. ``partial``: a peer that is lost, or whose lane does not
        open, is left out of both mappings (its other lane closed) and the rest are returned
        (a tree whose child died before the first step still opens its other lanes)."""
        for rank in (*send_to, *recv_from):
            self._check_rank(rank)
        listeners: dict[int, LaneListener] = {}
        lost: dict[int, BaseException] = {}
        told: dict[int, asyncio.Future[Header]] = {}
        try:
            for src in recv_from:
                listeners[src] = LaneListener(self.host, src, local=self.options.local_unix)
            nonces = {src: os.urandom(16) for src in recv_from}
            told = {dst: self.post_recv(dst, _NOTHING, step=step, tag=LANE_TAG) for dst in send_to}
            sent = await asyncio.gather(*(
                self.send(src, _NOTHING, step=step, tag=LANE_TAG,
                          meta=control.offer_meta(control.LaneOffer(
                              listeners[src].port, nonces[src].hex(), listeners[src].unix,
                              None if self.host in ("0.0.0.0", "::") else self.host)))
                for src in recv_from), return_exceptions=partial)
            lost.update((src, r) for src, r in zip(recv_from, sent, strict=True)
                        if isinstance(r, BaseException))
            for dst in lost:
                if dst in told:
                    told[dst].cancel()
            got = await asyncio.gather(*(self._offer_of(dst, fut, step, timeout)
                                         for dst, fut in told.items() if dst not in lost),
                                       return_exceptions=partial)
            offers: dict[int, tuple[str, int, str, str | None]] = {}
            for dst, header in zip([d for d in told if d not in lost], got, strict=True):
                try:
                    if isinstance(header, BaseException):
                        raise header
                    offers[dst] = self._offer(dst, header)
                except (PeerLost, TimeoutError) as exc:
                    if not partial:
                        raise
                    lost[dst] = exc
            dialing = [dst for dst in send_to if dst not in lost]
            accepting = [src for src in recv_from if src not in lost]
            # Every dial and accept blocks a thread until its peer does its part: one thread
            # each, not the shared default executor (a few workers, which all ranks' accepts
            # could fill while the dials they wait for queue behind them). Daemon threads,
            # not waited for: cancelled (the step failed elsewhere), waiting would block the
            # event loop until an accept from a dead peer timed out (seen: 20 s in which this
            # rank answered no handshake), and an executor's threads would hold the process's
            # exit as long (seen: 30 s after a ring lost two ranks under --tolerate). They end
            # on their own (an accept at once when its listener closes); a lane one opens
            # after that is closed.
            jobs = [_in_thread(dial, offers[dst][0], offers[dst][1],
                               proof(self._secret, bytes.fromhex(offers[dst][2]), self.rank,
                                     dst), dst, timeout, offers[dst][3]) for dst in dialing]
            jobs += [_in_thread(listeners[src].accept,
                                proof(self._secret, nonces[src], src, self.rank), timeout)
                     for src in accepting]
            try:
                opened = await asyncio.gather(*(asyncio.wrap_future(j) for j in jobs),
                                              return_exceptions=True)
            except BaseException:
                for job in jobs:
                    job.add_done_callback(_close_opened)
                raise
        finally:
            for listener in listeners.values():
                listener.close()
            # An offer not waited for (a send or another offer failed first) is withdrawn:
            # left posted, it would fail when its peer leaves, and nobody would hear it.
            for fut in told.values():
                if not fut.done():
                    fut.cancel()
                elif not fut.cancelled():
                    fut.exception()  # (its failure is the step's, or another's: heard)
        outs = dict(zip(dialing, opened[:len(dialing)], strict=True))
        ins = dict(zip(accepting, opened[len(dialing):], strict=True))
        failed = {r: e for r, e in (*outs.items(), *ins.items()) if isinstance(e, BaseException)}
        if failed and not partial:
            for lane in opened:
                if isinstance(lane, Lane):
                    lane.close()
            raise next(iter(failed.values()))
        lost.update(failed)
        for rank, lane in (*outs.items(), *ins.items()):
            if rank in lost and isinstance(lane, Lane):
                lane.close()
        if lost:
            log.warning("rank %d: no lanes with ranks %s at step %d (%s)", self.rank,
                        sorted(lost), step, next(iter(lost.values())))
        out_lanes = {r: cast(Lane, lane) for r, lane in outs.items() if r not in lost}
        in_lanes = {r: cast(Lane, lane) for r, lane in ins.items() if r not in lost}
        spin = self.lane_spin()
        for lane in in_lanes.values():
            lane.latency = self.options.latency
            lane.spin = spin
        self._lanes.update(out_lanes.values())
        return out_lanes, in_lanes

    def _offer(self, dst: int, header: Header) -> tuple[str, int, str, str | None]:
        """Where and how to dial ``dst``'s lane, from its offer: (host, port, nonce, Unix
        name)."""
        try:
            offer = control.decode_offer(header.meta)
        except control.MalformedControl as exc:
            raise PeerLost(dst, f"rank {dst} sent a malformed lane offer: {exc}") from None
        unix = local_name(offer.unix)
        if offer.unix is not None and unix is None:
            raise PeerLost(dst, f"rank {dst} sent a malformed lane offer")
        # Our own option decides too: local_unix=False never dials a Unix socket.
        host = offer.host or self.addresses.get(dst, (self.host, 0))[0]
        return host, offer.port, offer.nonce, unix if self.options.local_unix else None

    # -- control messages (rendezvous, barriers) ----------------------------------------------
    async def send_control(self, rank: int, event: control.Control) -> None:
        """Send a control event (:mod:`aioreduce.wire.control`) to ``rank``."""
        conn = await self.connect(rank)
        await conn.send(encode_frame(Header(Kind.CONTROL, src=self.rank,
                                            meta=control.encode(event))))

    async def recv_control(self, rank: int, timeout: float | None = None) -> control.Control:
        """The next control event from ``rank``; :class:`~aioreduce.wire.control.
        MalformedControl` if what it sent is none."""
        inbox = self._inbox[rank]
        if inbox.lost is not None and not inbox.conns and inbox.control.empty():
            raise inbox.lost
        if timeout is None:  # (a barrier's case: no timeout context to enter and leave)
            msg = await inbox.control.get()
        else:
            async with asyncio.timeout(timeout):
                msg = await inbox.control.get()
        if msg is None:
            raise inbox.lost or PeerLost(rank, "connection closed")
        return control.decode(msg)

    # -- teardown -----------------------------------------------------------------------------
    def unacked(self) -> int:
        """Bytes this rank has sent that no peer's kernel has acknowledged yet, on its
        connections and on the lanes it opened (see :meth:`FrameProtocol.unacked`)."""
        return (sum(conn.unacked() for conn in self._conns)
                + sum(lane.unacked() for lane in list(self._lanes)))

    async def drained(self, timeout: float) -> bool:
        """Wait until the peers' kernels have every byte this rank sent, or ``timeout``
        seconds; True if they have. For benchmarks: a straggler-tolerant step can end while
        messages it did not need are still crossing the links, and a step of another scheme
        started then would pay for them. No event says "acknowledged", so this polls the
        kernel's counters every millisecond (a few system calls per connection).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.unacked():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.001)
        return True

    async def close(self) -> None:
        """Stop listening and close every connection (pending data is flushed by the kernel)."""
        self.leaving = True
        self.stop_listening()
        for task in list(self._tasks):
            task.cancel()
        # Protocols whose dial failed never got a transport and never close: skip them.
        open_conns = [c for c in self._conns if c.transport is not None and not c.closed.done()]
        for conn in open_conns:
            assert conn.transport is not None
            conn.transport.close()  # flushes what is queued, then closes
        if open_conns:
            await asyncio.wait([c.closed for c in open_conns], timeout=2.0)
        for conn in open_conns:
            if not conn.closed.done():
                conn.abort("closing: peer not reading")
        for server in (self._server, self._local_server):
            if server is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(server.wait_closed(), 2.0)

    def _check_rank(self, rank: int) -> None:
        if rank not in self._peers:
            raise ValueError(f"rank {rank} is not a peer of rank {self.rank} "
                             f"(world size {self.world_size})")


class _Unproven(AuthError):
    """A handshake failed before the peer proved the job secret."""


def local_mesh_name(job: str, rank: int, port: int) -> bytes:
    """The abstract Unix address where ``rank`` of ``job``, listening on TCP ``port``, also
    listens: its rank in it, so a rank of the same job never answers for another one."""
    digest = hashlib.sha256(job.encode()).hexdigest()[:16]
    return f"\0aioreduce-mesh-{digest}-{rank}-{port}".encode("ascii")


def _in_thread(fn: Callable[..., Lane], *args: Any) -> concurrent.futures.Future[Lane]:
    """``fn(*args)`` on a daemon thread of its own (a lane's dial or accept), as a future."""
    job: concurrent.futures.Future[Lane] = concurrent.futures.Future()

    def run() -> None:
        if not job.set_running_or_notify_cancel():
            return
        try:
            job.set_result(fn(*args))
        except BaseException as exc:  # (the future carries it to whoever waits)
            job.set_exception(exc)

    threading.Thread(target=run, name="aioreduce-lane-open", daemon=True).start()
    return job


def _close_opened(job: concurrent.futures.Future[Lane]) -> None:
    """A lane opened for a step that was given up: nobody will use it."""
    if not job.cancelled() and job.exception() is None:
        job.result().close()
