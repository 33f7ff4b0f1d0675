"""One connection (TCP, or Unix between ranks on one host) as an ``asyncio.BufferedProtocol``
speaking aioreduce frames.

Receiving: ``get_buffer`` hands out whatever view the :class:`FrameDecoder` asks for, which for a
payload is a slice of the destination numpy array: the kernel copies straight into it.

While a payload lands, the socket's ``SO_RCVLOWAT`` is the payload's rest (at most
``recv_lowat``), so the event loop is woken once that many bytes are there instead of for
every burst the kernel delivers: under strace, 22 steps of a 16 MiB ring on 4 ranks of one
2-core host made 2169 epoll waits instead of 3132, and the ring's step took 0.85-0.90x Gloo's
time instead of 0.94-0.95x (0.71-0.75x against 0.93x at 64 MiB). The kernel caps it at half
the receive buffer, and a closing peer wakes us whatever it is. It only ever asks for bytes
the frame in progress still has to deliver, so no data is left waiting; between frames it
is 1.

Sending: :meth:`FrameProtocol.send` writes a frame's buffers and returns once the transport has
handed every byte to the kernel, so the caller may modify the array afterwards. The write-buffer
high-water mark is 0, which turns ``pause_writing``/``resume_writing`` into an exact "drained"
signal (polling the buffer size instead costs a quarter of the throughput on small machines).
uvloop's ``writelines`` sends memoryviews without copying; stock asyncio (3.11) joins them, so
there payloads are written in bounded slices.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, cast

from ..errors import PeerLost
from ..wire import Frame, FrameDecoder, Header, Kind, ProtocolError
from ..wire.decoder import NO_FRAMES, Destination
from ..wire.frame import Buffer
from .loop import is_uvloop
from .ratelog import RateLimitedLog
from .sockopts import send_queue_bytes, tune

log = logging.getLogger("aioreduce.transport")

# Stock asyncio copies what the kernel does not take at once; bound that copy.
_STOCK_WRITE_SLICE = 1 << 20
_MIN_LOWAT = 64 << 10  # payload rests below this wake us on every burst (see _set_lowat)
_HANDSHAKE = (Kind.HELLO, Kind.CHALLENGE, Kind.AUTH, Kind.WELCOME)
_UNAUTHENTICATED = RateLimitedLog(log)


class Router(Protocol):
    """Where an authenticated connection delivers what it receives (its peer's inbox)."""

    def choose(self, conn: FrameProtocol, header: Header) -> Destination: ...

    def delivered(self, conn: FrameProtocol, frame: Frame) -> None: ...

    def closed(self, conn: FrameProtocol, reason: str) -> None: ...


class FrameProtocol(asyncio.BufferedProtocol):
    """A framed, flow-controlled connection; before authentication frames go to ``handshake``."""

    def __init__(self, max_payload: int, user_timeout: float, recv_lowat: int = 0) -> None:
        self._max_payload = max_payload
        self._user_timeout = user_timeout
        self._recv_lowat = recv_lowat  # 0: the kernel's default (wake on every byte)
        self._lowat = 1  # what the socket has now
        self._sock: socket.socket | None = None
        self._fd = -1  # a TCP socket's descriptor, for its send queue (see unacked)
        # Before authentication: small restricted headers, no payloads, a small buffer.
        self.decoder = FrameDecoder(self._choose, max_payload=0, authenticated=False)
        self.transport: asyncio.Transport | None = None
        self.peer: int | None = None  # rank, once authenticated
        self.router: Router | None = None
        self.peername = "?"
        self.local = False  # a Unix socket (to a rank on this host) rather than TCP
        # Called once the connection is made (its peer address known): a listener starts
        # the handshake then, so it counts the connection against the right host.
        self.on_made: Callable[[FrameProtocol], None] | None = None
        self.handshake: asyncio.Queue[Header] = asyncio.Queue()
        self.closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._drained = asyncio.Event()
        self._drained.set()
        # Whether the transport asked us to stop writing: ``_drained``'s state as a plain
        # attribute, read by every send (``Event.is_set`` is a Python call).
        self._paused = False
        self._send_lock = asyncio.Lock()
        self._zero_copy = is_uvloop(asyncio.get_running_loop())
        self._held = False  # reading paused while the decoder waits for a destination
        self._armed: tuple[int, Router] | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport but implement its interface.
        self.transport = cast(asyncio.Transport, transport)
        transport = self.transport
        transport.set_write_buffer_limits(high=0)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune(sock, self._user_timeout)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                self._fd = sock.fileno()
                if self._recv_lowat > 1:
                    self._sock = sock
        peer = transport.get_extra_info("peername")
        if sock is not None and sock.family == socket.AF_UNIX:
            self.local = True
            self.peername = "local:unix"  # a process on this host; Unix peers have no address
        else:
            self.peername = f"{peer[0]}:{peer[1]}" if peer else "?"
        if self.on_made is not None:
            self.on_made(self)

    def authenticated(self, rank: int, router: Router) -> None:
        """Handshake done: accept payloads and route frames to ``router``."""
        self.peer = rank
        self.router = router
        self.decoder.authenticate(self._max_payload)

    def connection_lost(self, exc: Exception | None) -> None:
        reason = "connection closed"
        if exc is not None:
            reason = f"connection lost: {exc}"
        if self.decoder.mid_frame:
            reason += " in the middle of a frame"
        if not self.closed.done():
            self.closed.set_result(reason)
        self._paused = False
        self._drained.set()  # wake senders; they see `closed`
        if self.router is not None:
            self.router.closed(self, reason)

    def eof_received(self) -> bool:
        return False  # close our side too

    def abort(self, reason: str) -> None:
        """Drop the connection at once (protocol error, failed handshake)."""
        if not self.closed.done():
            self.closed.set_result(reason)
        if self.transport is not None:
            self.transport.abort()

    # -- receiving ----------------------------------------------------------------------------
    def _choose(self, header: Header) -> Destination:
        if self.router is None:
            return None
        return self.router.choose(self, header)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        frames = self.decoder.buffer_updated(nbytes)
        if frames is not NO_FRAMES:  # mid-payload reads skip the dispatch machinery
            self._dispatch(frames)
        if self._sock is not None:
            self._set_lowat()

    def _set_lowat(self) -> None:
        """Be woken when the payload's rest, or ``recv_lowat`` of it, is readable; between
        payloads on every byte (see the module docstring)."""
        left = self.decoder.payload_left
        # A small rest arrives in a burst or two anyway: not worth two setsockopt calls.
        nbytes = min(left, self._recv_lowat) if left >= _MIN_LOWAT else 1
        if nbytes != self._lowat and self._sock is not None:
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
                self._lowat = nbytes
            except OSError:  # a kernel without it, or a socket closing: wake on every byte
                self._sock = None

    def withdraw_payload(self) -> None:
        """The receive this connection is filling was withdrawn: land the rest in scratch."""
        self.decoder.redirect_to_scratch()

    def resume_with(self, dest: memoryview | None) -> None:
        """Give a held-back frame its destination and start reading again."""
        self._dispatch(self.decoder.resume(dest))
        if self._sock is not None:
            self._set_lowat()
        if self._held and not self.decoder.waiting and self.transport is not None:
            self._held = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    def arm(self, rank: int, router: Router) -> None:
        """Connector side: authenticate the moment WELCOME is parsed.

        The listener may send data right behind its WELCOME, in the same read; switching in the
        handshake task would be too late, because the decoder would already have refused that
        frame's payload.
        """
        self._armed = (rank, router)

    def _dispatch(self, frames: Iterable[Frame]) -> None:
        try:
            for frame in frames:
                kind = frame.header.kind
                if self.router is not None:
                    self.router.delivered(self, frame)
                elif kind in _HANDSHAKE:
                    if kind is Kind.WELCOME and self._armed is not None:
                        self.authenticated(*self._armed)
                    self.handshake.put_nowait(frame.header)
                elif kind is Kind.CONTROL:
                    # A refusal, or the answer instead of WELCOME of a listener that proved the
                    # secret ("you were started for another job"): for the handshake, which
                    # knows whether to believe it (anything else there fails it).
                    self.handshake.put_nowait(frame.header)
                else:
                    raise ProtocolError(f"{kind.name} frame before authentication")
        except ProtocolError as exc:
            self._protocol_error(exc)
            return
        if self.decoder.waiting and not self._held and self.transport is not None:
            # Hold the bytes back in the kernel until someone posts a receive for this frame.
            self._held = True
            self.transport.pause_reading()

    def _protocol_error(self, exc: ProtocolError) -> None:
        if self.peer is not None:
            log.warning("protocol error from rank %d at %s: %s; closing that connection",
                        self.peer, self.peername, exc)
        else:  # anyone can send these: bounded logging
            _UNAUTHENTICATED.warn("protocol error from unauthenticated peer at %s: %s; closing "
                                  "that connection", self.peername, exc)
        self.abort(f"protocol error: {exc}")

    # -- sending ------------------------------------------------------------------------------
    def pause_writing(self) -> None:
        self._paused = True
        self._drained.clear()

    def resume_writing(self) -> None:
        self._paused = False
        self._drained.set()

    def _check_open(self) -> asyncio.Transport:
        if self.closed.done() or self.transport is None or self.transport.is_closing():
            reason = self.closed.result() if self.closed.done() else "connection closing"
            raise PeerLost(self.peer if self.peer is not None else -1, reason)
        return self.transport

    async def send(self, buffers: Sequence[Buffer]) -> None:
        """Write one frame; return when the kernel has every byte (buffers reusable)."""
        if self._zero_copy:
            # One writelines call queues the whole frame, so concurrent sends cannot interleave
            # and need no lock; "drained" then covers every frame queued so far.
            transport = self.transport
            if transport is None or self.closed.done() or transport.is_closing():
                transport = self._check_open()  # (raises; checked inline: a call less a frame)
            transport.writelines(buffers)
            if self._paused:  # checked here: a call less for most frames
                await self._wait_drained()
            return
        async with self._send_lock:
            for buf in buffers:
                view = memoryview(buf).cast("B")
                for start in range(0, len(view), _STOCK_WRITE_SLICE):
                    self._check_open().write(view[start:start + _STOCK_WRITE_SLICE])
                    await self._wait_drained()

    def unacked(self) -> int:
        """Bytes written here that the peer's kernel has not acknowledged yet: what the
        transport still buffers plus the socket's send queue (TIOCOUTQ: unsent and unacked).
        0 once the connection is closing; the send queue counts only on a TCP socket."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return 0
        nbytes = transport.get_write_buffer_size()
        if self._fd >= 0:
            try:
                nbytes += send_queue_bytes(self._fd)
            except OSError:  # closed meanwhile: nothing of ours is on its way any more
                self._fd = -1
        return nbytes

    async def _wait_drained(self) -> None:
        if self._drained.is_set():
            return  # everything is in the kernel already, even if the peer closes now
        await self._drained.wait()
        self._check_open()
