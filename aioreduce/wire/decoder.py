"""The receive side: a sans-IO state machine that lets payloads land where the caller wants.

The caller (an ``asyncio.BufferedProtocol``, or a test feeding bytes) drives it with two calls:

* :meth:`FrameDecoder.get_buffer` returns the memoryview the next bytes should be written into;
* :meth:`FrameDecoder.buffer_updated` says how many bytes landed there, and returns the frames
  that are now complete.

Prefixes and headers are read into a small staging buffer. When a header is complete the decoder
asks its ``choose`` callback where the payload goes:

* a writable memoryview of exactly the payload size: the rest of the payload is received straight
  into it (only bytes already sitting in the staging buffer are copied);
* ``None``: the payload is unwanted (a late frame); it is received into a reusable scratch buffer
  and discarded, never allocated per frame;
* :data:`DEFER`: the caller has nowhere to put it yet. The decoder stops (``get_buffer`` returns
  an empty view) until :meth:`FrameDecoder.resume` supplies a destination; the IO layer pauses
  reading meanwhile, so nothing is buffered behind the caller's back.

Bounds: a new decoder is *pre-authentication*: headers of at most
:data:`~aioreduce.wire.frame.PRE_AUTH_MAX_HEADER` bytes with the handshake's fields only, no
payload, and a staging buffer of a few KiB. :meth:`FrameDecoder.authenticate` lifts that to
:data:`~aioreduce.wire.frame.MAX_HEADER`, full headers and payloads up to ``max_payload``, and a
larger staging buffer (fewer reads for small frames).

Large frames come in runs (segments of a vector), and a staging read that asks the kernel for
everything it has pulls the start of the next frame's payload into the staging buffer, to be
copied again: up to the whole buffer per frame, an eighth of a 1 MiB payload. So after a frame
whose payload was larger than the staging buffer, the next prefix and header are read exactly:
the prefix with as many bytes as the last header had (one read when the header is as long,
as in a run of segments), and its payload goes straight to its destination.

Wrong magic, version, lengths or an undecodable header raise :class:`ProtocolError`; the
decoder is then dead.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from .frame import (
    MAGIC,
    MAX_HEADER,
    PRE_AUTH_MAX_HEADER,
    PREFIX,
    PREFIX_SIZE,
    VERSION,
    Buffer,
    Header,
    ProtocolError,
)


class _Defer(enum.Enum):
    DEFER = "defer"


DEFER = _Defer.DEFER
"""Returned by a ``choose`` callback: no destination yet, stop until :meth:`resume`."""

Destination = memoryview | None | _Defer

NO_FRAMES: tuple[()] = ()
"""What :meth:`FrameDecoder.buffer_updated` returns when nothing completed (identity-checkable)."""
Chooser = Callable[[Header], Destination]

_STAGING = 1 << 17  # after authentication: a full prefix + the largest header, and then some
_PRE_AUTH_STAGING = 2048  # before: a prefix + the largest handshake header
_SCRATCH = 1 << 20


class Frame(NamedTuple):
    """One complete frame. ``payload`` is the memoryview it landed in (None if discarded).
    A named tuple: one is made per frame received (see :class:`~.frame.Header`)."""

    header: Header
    payload: memoryview | None


class _State(enum.Enum):
    PREFIX = 1
    HEADER = 2
    WAIT = 3  # header done, waiting for the caller to supply a destination
    PAYLOAD = 4
    DISCARD = 5
    DEAD = 6


class FrameDecoder:
    """Incremental frame parser; see the module docstring for the protocol."""

    def __init__(self, choose: Chooser, max_payload: int, *, authenticated: bool = True
                 ) -> None:
        self._choose = choose
        self.max_payload = max_payload
        self.max_header = MAX_HEADER if authenticated else PRE_AUTH_MAX_HEADER
        self.restricted = not authenticated
        self._stage = bytearray(_STAGING if authenticated else _PRE_AUTH_STAGING)
        self._lo = 0  # staged bytes not yet consumed: self._stage[_lo:_hi]
        self._hi = 0
        self._scratch: bytearray | None = None
        self._state = _State.PREFIX
        self._header_len = 0
        self._payload_len = 0
        self._header: Header | None = None
        self._dest: memoryview = memoryview(b"")
        self._got = 0  # payload bytes received so far
        # The last payload was larger than the staging buffer: read the next prefix and header
        # exactly, so none of its payload is staged and copied twice.
        self._exact = False

    def authenticate(self, max_payload: int) -> None:
        """The peer proved the secret: full headers, payloads up to ``max_payload``."""
        self.max_payload = max_payload
        self.max_header = MAX_HEADER
        self.restricted = False
        if len(self._stage) < _STAGING:
            grown = bytearray(_STAGING)
            n = self._hi - self._lo
            grown[:n] = self._stage[self._lo:self._hi]
            self._stage, self._lo, self._hi = grown, 0, n

    @property
    def staging_bytes(self) -> int:
        """Bytes this decoder holds for prefixes and headers (small until authenticated)."""
        return len(self._stage)

    # -- introspection -------------------------------------------------------------------------
    @property
    def waiting(self) -> bool:
        """True while a header waits for :meth:`resume` to give its payload a destination."""
        return self._state is _State.WAIT

    @property
    def pending_header(self) -> Header | None:
        """The header of the frame in progress (waiting or receiving), if any."""
        return self._header

    @property
    def payload_left(self) -> int:
        """Bytes of the payload being received into its destination still to come (0 when
        no payload is being received into a destination: a header, a held or discarded
        frame)."""
        return self._payload_len - self._got if self._state is _State.PAYLOAD else 0

    @property
    def mid_frame(self) -> bool:
        """True if a frame has started but not finished (a close now loses data)."""
        return self._state is not _State.PREFIX or self._hi > self._lo

    # -- driving ------------------------------------------------------------------------------
    def get_buffer(self) -> memoryview:
        """Where the next received bytes go. Empty while waiting for a destination."""
        st = self._state
        if st is _State.PAYLOAD:
            return self._dest[self._got:]
        if st is _State.DISCARD:
            assert self._scratch is not None
            return memoryview(self._scratch)[: min(len(self._scratch),
                                                   self._payload_len - self._got)]
        if st is _State.WAIT or st is _State.DEAD:
            return memoryview(self._stage)[:0]
        if self._lo == self._hi:
            self._lo = self._hi = 0
        if self._exact:  # just the rest of this prefix and header
            # A prefix is read with as many header bytes as the last frame's header had:
            # one read instead of two when the next header is as long (a run of segments),
            # a few payload bytes staged when it is shorter, a second read when longer.
            need = (PREFIX_SIZE + self._header_len if st is _State.PREFIX
                    else self._header_len) - (self._hi - self._lo)
            if need > 0 and self._hi + need <= len(self._stage):
                return memoryview(self._stage)[self._hi:self._hi + need]
        if self._hi == len(self._stage) and self._lo < self._hi:
            # Only a partial prefix/header remains (frames are consumed eagerly); move it down.
            n = self._hi - self._lo
            self._stage[:n] = self._stage[self._lo:self._hi]
            self._lo, self._hi = 0, n
        return memoryview(self._stage)[self._hi:]

    def buffer_updated(self, nbytes: int) -> Iterable[Frame]:
        """``nbytes`` landed in the last :meth:`get_buffer` view; yield completed frames.

        Frames are parsed lazily, one per iteration, so the caller can act on a frame (for
        example raise ``max_payload`` after a handshake) before the next one is looked at.
        The caller must exhaust the iterator before asking for the next buffer.
        """
        st = self._state
        if st is _State.PAYLOAD or st is _State.DISCARD:
            self._got += nbytes
            if self._got < self._payload_len:
                return NO_FRAMES  # the hot path of a large payload: one read of many
            return self._frames(self._finish())
        if st is _State.PREFIX or st is _State.HEADER:
            self._hi += nbytes
            return self._parse()  # (no first frame: one generator, not two)
        raise RuntimeError(f"bytes delivered in state {st.name}")

    def resume(self, dest: memoryview | None) -> Iterable[Frame]:
        """Give the waiting frame its destination (or None to discard); yield what completes."""
        if self._state is not _State.WAIT:
            raise RuntimeError("resume() without a waiting frame")
        return self._frames(self._start_payload(dest))

    def redirect_to_scratch(self) -> None:
        """Send the rest of the payload in progress to scratch (its receiver gave up on it).

        The caller's buffer is never written again; bytes already in it are left as they are.
        """
        if self._state is _State.PAYLOAD:
            if self._scratch is None:
                self._scratch = bytearray(_SCRATCH)
            self._state = _State.DISCARD
            self._dest = memoryview(b"")

    def receive_data(self, data: Buffer) -> list[Frame]:
        """Feed bytes by copying them in (tests, fuzzing). Not for hot paths."""
        out: list[Frame] = []
        view = memoryview(data).cast("B")
        while view:
            buf = self.get_buffer()
            if not buf:
                raise RuntimeError("decoder is waiting for a destination; call resume() first")
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            view = view[n:]
            out.extend(self.buffer_updated(n))
        return out

    # -- internals ----------------------------------------------------------------------------
    def _fail(self, msg: str) -> ProtocolError:
        self._state = _State.DEAD
        return ProtocolError(msg)

    def _frames(self, first: Frame | None) -> Iterator[Frame]:
        if first is not None:
            yield first
        yield from self._parse()

    def _parse(self) -> Iterator[Frame]:
        """Consume staged bytes into as many frames as they complete."""
        while True:
            avail = self._hi - self._lo
            if self._state is _State.PREFIX:
                if avail < PREFIX_SIZE:
                    return
                magic, version, _flags, hlen, plen = PREFIX.unpack_from(self._stage, self._lo)
                if magic != MAGIC:
                    raise self._fail(f"bad magic {magic!r}")
                if version != VERSION:
                    raise self._fail(f"unsupported protocol version {version}")
                if hlen == 0 or hlen > self.max_header:
                    raise self._fail(f"header length {hlen} out of range (at most "
                                     f"{self.max_header})")
                if plen > self.max_payload:
                    raise self._fail(f"payload of {plen} bytes exceeds the limit "
                                     f"{self.max_payload}")
                self._lo += PREFIX_SIZE
                self._header_len, self._payload_len = hlen, plen
                self._state = _State.HEADER
            elif self._state is _State.HEADER:
                if avail < self._header_len:
                    return
                raw = self._stage[self._lo:self._lo + self._header_len]
                self._lo += self._header_len
                try:
                    header = Header.from_bytes(raw, restricted=self.restricted)
                    want = header.payload_nbytes()
                except ProtocolError:
                    self._state = _State.DEAD
                    raise
                if want != self._payload_len:
                    raise self._fail(f"payload length {self._payload_len} does not match "
                                     f"dtype/shape ({want} bytes)")
                self._header = header
                if self._payload_len == 0:
                    yield self._finish(memoryview(b""))
                    continue
                dest = self._choose(header)
                if dest is DEFER:
                    self._state = _State.WAIT
                    return
                frame = self._start_payload(dest)
                if frame is None:
                    return
                yield frame
            else:
                return

    def _start_payload(self, dest: memoryview | None) -> Frame | None:
        """Enter the payload state and copy already-staged bytes; the frame if it completed."""
        staged = min(self._hi - self._lo, self._payload_len)
        if dest is None:
            if self._scratch is None:
                self._scratch = bytearray(_SCRATCH)
            self._state = _State.DISCARD
        else:
            if dest.nbytes != self._payload_len or dest.readonly:
                raise ValueError(f"destination must be a writable view of {self._payload_len} "
                                 f"bytes, got {dest.nbytes}")
            self._dest = dest.cast("B")
            self._dest[:staged] = self._stage[self._lo:self._lo + staged]
            self._state = _State.PAYLOAD
        self._lo += staged
        self._got = staged
        if self._got < self._payload_len:
            return None
        return self._finish()

    def _finish(self, payload: memoryview | None = None) -> Frame:
        header = self._header
        assert header is not None
        if payload is None and self._state is _State.PAYLOAD:
            payload = self._dest
        frame = Frame(header, payload)
        self._exact = self._payload_len > len(self._stage)
        self._header = None
        self._dest = memoryview(b"")
        self._state = _State.PREFIX
        return frame
