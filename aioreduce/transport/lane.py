"""Lanes: blocking point-to-point byte streams for bulk transfers, driven from a worker thread.

Why. A ring step on 13 ranks sends and receives 24 frames per rank; through the event loop each
costs tens of microseconds of interpreter time (callbacks, futures, task wake-ups), and where
ranks share cores that time is the step's. Measured on one 2-core host, 13 ranks x 8 MiB, per
step summed over ranks: the event-loop ring 138 ms of CPU (62 of them in user space), Gloo 113
(18), and a throwaway ring over blocking sockets with a sender thread 91-96 (25-27): the
kernel copies the same bytes either way, a blocking ``recv_into`` wakes its thread once per
segment and costs no Python beyond the call.

What. A lane is one TCP connection between two ranks of a job, outside the event loop, for one
direction of a scheme's bulk data (the ring's successor and predecessor). Each message on it
is a 32-byte header (step, index, payload bytes, meta bytes), at most :data:`MAX_META` bytes
of meta (the message's wire header, msgpack) and the raw payload; the receiving side's
matcher (:class:`~aioreduce.schemes.links.lanes.LaneLinks`, the one every scheme's lanes go
through) checks it and says where the payload goes, so a lane never allocates for a peer
beyond the meta's bound. Sending runs on a thread of the lane's own, so a
rank can send segment *i* while it receives segment *i - 1*, as the event-loop path does;
a small message (up to :data:`INLINE_BYTES`) on an idle lane goes to the kernel from the
caller's thread instead, without blocking: waking the sender thread cost a small transpose
step more than the copy (4 ranks x 160 KB on 2 cores: 6.6 ms a step, 12 steps cut in 100;
inline, 4.5 ms and none; the ring over lanes 2.9 -> 2.1 ms). A payload may be *lent*
(:meth:`Lane.send`): its array may change once :meth:`Lane.release` has copied what of it
is not in the kernel yet, so a sender need not copy a vector for a peer that may be slow.

Opening one, on the event loop (:func:`open_lanes`): the receiving rank listens on a fresh
port and tells the sender, over the authenticated mesh, the port and a random nonce; the
sender connects and first writes ``HMAC(secret, nonce, ranks)`` (32 bytes); the receiver reads
exactly that many bytes (with a timeout), compares in constant time and answers one byte. A
connection that cannot prove the secret costs 32 bytes and is closed; the port accepts only
for the few seconds the opening takes.

Ranks on one host. The receiver also listens on a Unix socket in the abstract namespace
under a random name (:attr:`LaneListener.unix`), offered beside the port. The sender tries
that name first: abstract names belong to a network namespace, so the connect succeeds only
on the same host (and namespace) and elsewhere fails at once (no such name), and the sender
dials the TCP port instead. The proof is the same either way. Why: a Unix stream skips TCP's
segments, acknowledgements and loopback device, so the kernel spends less per byte (see
``MeshOptions.local_unix`` for what it saved). :meth:`Lane.interrupt` (from any thread) makes a
blocked send or receive fail at once: a failed step elsewhere releases the lane's thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import queue
import select
import selectors
import socket
import struct
import threading
import time
from collections import deque
from typing import cast

from ..errors import LaneClosed, PeerLost
from .sockopts import recv_queue_bytes, send_queue_bytes, tune

HEADER = struct.Struct("<qqqq")  # step, index, payload bytes, meta bytes
MAX_META = 4096  # a message's meta (msgpack) is small control data: bound what a peer sends
PROOF_BYTES = 32
ACCEPT_TIMEOUT_S = 30.0  # the whole opening
PROOF_TIMEOUT_S = 5.0  # one connection's 32 bytes
MAX_PENDING = 64  # connections read at once while a lane opens
# A message this small goes to the kernel from the caller's thread when the lane is idle:
# waking the sender thread for it cost more than the copy (see Lane.send).
INLINE_BYTES = 256 << 10
# Bytes a receive reads at once when it wants a message's head (see Lane._read_ahead): one
# call for a small message instead of three (head, meta, payload).
READ_AHEAD = 8 << 10  # (more: a large message's first bytes are copied once more)
# After a large message, the next head is read with this much more, enough for the usual
# meta (a wire header: dtype, shape, a scheme's few fields): head and meta in one call.
HEAD_ROOM = 512
# The sender thread sends what is queued in one call, up to this many messages (a head and a
# payload each: under the kernel's IOV_MAX of 1024 buffers) or bytes.
SEND_BATCH = 64
SEND_BATCH_BYTES = 8 << 20
# On a lane that lends (Lane.allow_lending), a blocking send gives up after this long without
# room in the socket (and is made again), so a send call to a peer that stopped reading returns
# this soon (see Lane.release). Not on the others, which need no such bound: over TCP the wait
# is counted per call, so on a slow link every call would return after it and be made again.
SEND_TIMEOUT_S = 0.02
# How long an in-order receive polls for its message (reads that do not block) before it
# waits in poll, where each rank has a core of its own (``MeshOptions.lane_spin``; not where
# ranks share cores: a polling rank would take the core a waiting one needs). A rank that
# waits lets its core go idle, and waking an idle core is slow on a VM: a round trip of two
# ranks took four times a raw socket's without this poll and less than one with it
# (docs/architecture.md, "Where one message's time goes"). MPI libraries poll before they
# block for the same reason.
SPIN_S = 100e-6
# A lane's abstract Unix name: this prefix and a random nonce in hex, so that nobody can take
# the name before us, and a peer's offer can be checked for its shape before we connect.
LOCAL_PREFIX = "aioreduce-lane-"
LOCAL_NONCE_BYTES = 16


class _Message:
    """A queued message: what is left to send of its head and payload (the sender thread
    cuts what the kernel took; :meth:`Lane.release` swaps a lent payload for a copy)."""

    __slots__ = ("head", "lent", "payload")

    def __init__(self, head: bytes, payload: memoryview, lent: bool) -> None:
        self.head, self.payload, self.lent = head, payload, lent


def _flat(view: memoryview) -> memoryview:
    """``view`` as one-dimensional bytes (what socket calls slice by byte offsets)."""
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def proof(secret: bytes, nonce: bytes, src: int, dst: int) -> bytes:
    """What the sender ``src`` writes first on a lane to ``dst``: only a holder of the job's
    secret can compute it, and it is good for this nonce and this pair only."""
    return hmac.new(secret, b"aioreduce-lane|%d|%d|" % (src, dst) + nonce,
                    hashlib.sha256).digest()


class Lane:
    """One direction of bulk data to or from ``peer`` over a blocking socket (see the module
    docstring). Sends go to the lane's sender thread (small ones on an idle lane straight to
    the kernel); receives block the caller."""

    def __init__(self, sock: socket.socket, peer: int, latency: float = 0.0) -> None:
        sock.setblocking(True)
        self.sock, self.peer = sock, peer
        self._lends = False  # allow_lending() was called: sends time out (SEND_TIMEOUT_S)
        # Emulated one-way latency (MeshOptions.latency): a message counts as arrived this
        # long after its last byte did, as on the mesh's connections.
        self.latency = latency
        self._closed = False
        self._queue: queue.SimpleQueue[_Message | None] = queue.SimpleQueue()
        # Lent messages (see send) not wholly in the kernel yet, oldest first; the sender
        # thread is in a send call (_in_call) or not, under _idle_lock.
        self._lent: deque[_Message] = deque()
        self._in_call = False
        self._releasing = 0
        self._error: BaseException | None = None
        self._idle_lock = threading.Lock()  # (taken directly on the hot path: cheaper)
        self._idle = threading.Condition(self._idle_lock)
        self._pending = 0
        self._flushers = 0  # threads in flush(): the sender notifies only when some wait
        self._sender: threading.Thread | None = None
        # Read ahead: a message's head is read with whatever follows it, up to READ_AHEAD
        # bytes (a small message's head, meta and payload in one call); reads take from here
        # first. _r0:_r1 is what it holds.
        self._rbuf = bytearray(READ_AHEAD)
        self._rview = memoryview(self._rbuf)
        self._r0 = self._r1 = 0
        # After a message larger than READ_AHEAD, the next head is read alone (with at most
        # HEAD_ROOM bytes more, for its meta): its payload is likely as large, and goes
        # straight to its destination instead of partly through the read-ahead buffer (a
        # copy and its bookkeeping per message).
        self._head_only = False
        self.sent = 0  # messages in the kernel (or failed): they leave in the order queued
        self._unsent = 0  # bytes queued here, not yet handed to the kernel
        self._poll: select.poll | None = None
        self._sink: bytearray | None = None
        # Seconds wait_head reads without blocking before it waits (see SPIN_S; the mesh
        # sets it on the lanes it opens, 0 where this host's ranks share cores).
        self.spin = 0.0
        # wake(): a byte on this pipe ends a wait_readable without touching the socket
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def local(self) -> bool:
        """Whether this lane is a Unix socket (its peer is on this host) rather than TCP."""
        return self.sock.family == socket.AF_UNIX

    # -- sending (any thread; the bytes go out on the lane's own) --------------------------------
    def send(self, step: int, index: int, payload: memoryview, meta: bytes = b"", *,
             lent: bool = False) -> None:
        """Queue one message (``meta``: at most :data:`MAX_META` bytes of msgpack); ``payload``
        must stay unchanged until it is sent (:meth:`flush`, or :attr:`sent` counts it), or,
        ``lent``, until :meth:`release` returns."""
        if self._error is not None:
            self._raise_if_failed()
        if len(meta) > MAX_META:
            raise ValueError(f"lane meta of {len(meta)} bytes, at most {MAX_META}")
        if lent and not self._lends:
            raise ValueError(f"lane to rank {self.peer}: a lent send before allow_lending()")
        head = HEADER.pack(step, index, payload.nbytes, len(meta))
        if meta:
            head += meta
        flat = _flat(payload)
        with self._idle_lock:
            total = len(head) + flat.nbytes
            if not self._pending and total <= INLINE_BYTES and self._error is None:
                # Straight to the kernel from this thread (the sender thread is idle: nothing
                # is queued before it), what it takes at once; the rest goes to the thread.
                try:
                    taken = self.sock.sendmsg([head, flat], [], socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    taken = 0
                except OSError as exc:  # the sender thread's way: the next send raises
                    self._error = exc
                    taken = total
                if taken == total:
                    self.sent += 1
                    return
                cut = min(taken, len(head))
                head, flat = head[cut:], flat[taken - cut:]
            message = _Message(head, flat, lent)
            if lent:
                self._lent.append(message)
            self._pending += 1
            self._unsent += len(head) + flat.nbytes
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                            name=f"aioreduce-lane-to-{self.peer}")
            self._sender.start()
        self._queue.put(message)

    def allow_lending(self) -> None:
        """Let sends be lent from now on (before the first send: a send call in progress
        when this is called would not time out): every send call gives up after
        :data:`SEND_TIMEOUT_S` without room, so :meth:`release` never waits long."""
        if not self._lends:
            self._lends = True
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                 struct.pack("ll", 0, int(SEND_TIMEOUT_S * 1e6)))

    def release(self) -> None:
        """Copy what lent messages (see :meth:`send`) still hold of their payloads, so that
        the arrays they came from may change. Waits for the send call in progress, if any, to
        return: while the peer takes its bytes, that is until they are in (a batch, at most
        :data:`SEND_BATCH_BYTES`); once the peer stops reading, :data:`SEND_TIMEOUT_S` at
        most. Nothing to do once what was lent is in the kernel."""
        with self._idle_lock:  # (the condition's lock: a Condition's with is Python)
            if not self._lent:
                return
            self._releasing += 1
            try:
                while self._in_call:
                    self._idle.wait()
                for message in self._lent:
                    if message.payload.nbytes:
                        message.payload = memoryview(bytes(message.payload))
                    message.lent = False
                self._lent.clear()
            finally:
                self._releasing -= 1
                self._idle.notify_all()  # the sender thread waits for this copy

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every queued message is in the kernel (or raise the send's error);
        False if ``timeout`` seconds passed first."""
        with self._idle:
            self._flushers += 1
            try:
                done = self._idle.wait_for(
                    lambda: not self._pending or self._error is not None, timeout)
            finally:
                self._flushers -= 1
        self._raise_if_failed()
        return done

    def _send_loop(self) -> None:
        take = self._queue.get_nowait
        while (item := self._queue.get()) is not None:
            # What else is queued already goes out in the same call: the thread takes the GIL
            # once for all of them. (Queued while the caller's thread held the GIL, a stream of
            # 64 KiB messages got one message out per switch interval.)
            batch, nbytes, last = [item], len(item.head) + item.payload.nbytes, False
            del item
            while len(batch) < SEND_BATCH and nbytes < SEND_BATCH_BYTES:
                try:
                    more = take()
                except queue.Empty:
                    break
                if more is None:
                    last = True
                    break
                batch.append(more)
                nbytes += len(more.head) + more.payload.nbytes
            more = None  # (a reference to a payload would outlive its sending)
            try:
                if self._error is None:
                    self._send_all(batch)
            except OSError as exc:
                self._error = exc
            count = len(batch)
            with self._idle_lock:
                for message in batch:
                    if message.lent:  # (oldest first: the batch's are at the front)
                        message.lent = False
                        self._lent.remove(message)
                del batch  # no reference left once sent: the payloads' arrays may be reused
                self._pending -= count
                self._unsent -= nbytes
                self.sent += count
                if self._flushers:  # (a Condition's notify is Python: not per message)
                    self._idle.notify_all()
            if last:
                return

    def _send_all(self, batch: list[_Message]) -> None:
        """Send the messages' heads and payloads, blocking: one call for all of them where
        the kernel takes them. A call returns early after :data:`SEND_TIMEOUT_S` without
        room (or when interrupted); what it did not take is sent again, from the messages
        as they are then (:meth:`release` may have copied a payload meanwhile)."""
        first = 0  # the batch's first message not wholly sent
        while first < len(batch):
            with self._idle:
                while self._releasing:  # (it copies the payloads first)
                    self._idle.wait()
                if self._error is not None or self._closed:
                    return
                bufs: list[bytes | memoryview] = []
                for message in batch[first:]:
                    if message.head:
                        bufs.append(message.head)
                    if message.payload.nbytes:
                        bufs.append(message.payload)
                self._in_call = True
            n = 0
            try:
                n = self.sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                pass
            finally:
                with self._idle_lock:  # what the call took, message by message
                    self._in_call = False
                    while first < len(batch):
                        message = batch[first]
                        cut = min(n, len(message.head))
                        message.head, n = message.head[cut:], n - cut
                        cut = min(n, message.payload.nbytes)
                        message.payload, n = message.payload[cut:], n - cut
                        if message.head or message.payload.nbytes:
                            break
                        first += 1
                    if self._releasing:
                        self._idle.notify_all()

    @property
    def unsent(self) -> int:
        """Bytes queued on this lane that are not in the kernel yet."""
        return self._unsent

    def unacked(self) -> int:
        """Bytes queued on this lane that the peer's kernel has not acknowledged yet (what the
        sender thread holds plus the socket's send queue); 0 once the lane is closed."""
        if self._closed or self._error is not None:
            return 0
        try:
            return self._unsent + send_queue_bytes(self.sock.fileno())
        except (OSError, ValueError):  # closed meanwhile: nothing of ours is on its way
            return 0

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise LaneClosed(self.peer, f"lane to rank {self.peer}: {self._error}")

    # -- receiving (the caller's thread) ---------------------------------------------------------
    def read_head(self) -> tuple[int, int, int, int]:
        """The next message's (step, index, payload bytes, meta bytes); a peer announcing more
        meta than :data:`MAX_META` or a negative size is lost (it is not one of ours)."""
        while self._r1 - self._r0 < HEADER.size:
            self._read_ahead(0, self._head_only)
        step, index, nbytes, meta = HEADER.unpack_from(self._rbuf, self._r0)
        self._r0 += HEADER.size
        self._head_only = nbytes > READ_AHEAD
        if nbytes < 0 or not 0 <= meta <= MAX_META:
            raise PeerLost(self.peer, f"lane from rank {self.peer}: malformed header")
        return step, index, nbytes, meta

    def read_meta(self, nbytes: int) -> bytes:
        """The message's meta (after :meth:`read_head`; ``nbytes`` <= MAX_META)."""
        while self._r1 - self._r0 < nbytes:
            self._read_ahead()
        meta = bytes(self._rview[self._r0:self._r0 + nbytes])
        self._r0 += nbytes
        return meta

    def _read_ahead(self, flags: int = 0, head_only: bool = False) -> bool:
        """Read what the socket has (blocking until there is some; with MSG_DONTWAIT, False
        if there is none) into the read-ahead buffer, after what it holds; ``head_only``: no
        more than the rest of a message's head and :data:`HEAD_ROOM` bytes."""
        if self._r0 == self._r1:
            self._r0 = self._r1 = 0
            if len(self._rbuf) > READ_AHEAD:  # grown by read_expected: back to its size
                self._rbuf = bytearray(READ_AHEAD)
                self._rview = memoryview(self._rbuf)
        elif self._r1 > READ_AHEAD - MAX_META - HEADER.size:  # make room for a head and meta
            held = self._r1 - self._r0
            self._rview[:held] = self._rview[self._r0:self._r1]
            self._r0, self._r1 = 0, held
        want = HEADER.size + HEAD_ROOM - (self._r1 - self._r0) if head_only else 0  # 0: all
        try:
            n = self.sock.recv_into(self._rview[self._r1:], want, flags)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise self._ended(exc) from None
        if n == 0:
            raise self._ended()
        self._r1 += n
        return True

    def _ended(self, exc: Exception | None = None) -> LaneClosed:
        """What a read raises that failed with ``exc`` (None: it found the lane's end)."""
        why = f": {exc}" if exc is not None else " closed"
        return LaneClosed(self.peer, f"lane from rank {self.peer}{why}")

    def _take(self, view: memoryview) -> int:
        """Copy what the read-ahead buffer holds, at most ``view.nbytes``, into ``view``."""
        n = min(view.nbytes, self._r1 - self._r0)
        if n:
            _flat(view)[:n] = self._rview[self._r0:self._r0 + n]
            self._r0 += n
        return n

    def wait_readable(self, unit: int = 1) -> bool:
        """Block until the lane has bytes to read (or has ended: the read then says so) and
        return True, or return False once :meth:`wake` was called (since the last wait).
        ``unit``: a read of whole ``unit``-byte elements waits on (see :meth:`recv_now`)
        while the read-ahead buffer holds only part of one."""
        if self._r1 - self._r0 >= unit:
            return True
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(self.sock, select.POLLIN)
            self._poll.register(self._wake_r, select.POLLIN)
        events = self._poll.poll()
        if len(events) > 1 or events[0][0] == self._wake_r:  # (not any(): a generator's cost)
            with contextlib.suppress(OSError):
                while os.read(self._wake_r, 64):
                    pass
            return False
        return True

    def wait_head(self) -> bool:
        """:meth:`wait_readable` before a message's head (the in-order receive's wait): True
        once one can be read, False once :meth:`wake` was called. After a large message the
        next one's head is likely in already (a stream of them: the sender was writing while
        we copied), so a read that does not block comes first and saves the poll; otherwise
        the poll comes first, as a read that finds nothing raises, which costs three times a
        poll that finds bytes waiting (a round trip, a ring waiting on its neighbour), and
        the read after it takes what is there (a small message whole: :meth:`take_bare`).
        With :attr:`spin`, reads that do not block come first for that long (a wake during
        them is seen by the poll after)."""
        if self._r1 > self._r0:
            return True
        if self.spin:  # reads that do not block, this long, before the poll (see SPIN_S)
            until = time.perf_counter() + self.spin
            while True:
                if self._read_now():
                    return True
                if time.perf_counter() > until:
                    break
        elif self._head_only and self._read_now():  # (the spin's first read does this)
            return True
        if not self.wait_readable():
            return False
        self._read_now()  # what is there now, so that take_bare finds a small message whole
        return True

    def _read_now(self) -> bool:
        """Read what the socket holds into the read-ahead buffer without blocking; whether
        bytes are buffered now. An ended lane counts as bytes: the read that follows says so
        (not contextlib.suppress: this runs once a message)."""
        try:
            return self._read_ahead(socket.MSG_DONTWAIT, self._head_only)
        except LaneClosed:
            return True

    def take_bare(self, step: int, index: int, view: memoryview) -> bool:
        """If the read-ahead buffer holds the whole next message and it is (``step``,
        ``index``), without meta, of ``view.nbytes`` (a flat byte view), copy its payload
        into ``view`` and return True; otherwise change nothing and return False (the caller
        reads it the general way: :meth:`read_head`). One call for an in-order receive's
        usual small message, where the general way takes six."""
        r0 = self._r0
        start = r0 + HEADER.size
        end = start + view.nbytes
        if end > self._r1:
            return False
        if HEADER.unpack_from(self._rbuf, r0) != (step, index, view.nbytes, 0):
            return False
        view[:] = self._rview[start:end]
        self._r0 = end
        self._head_only = False  # (a message that fits the read-ahead: read ahead again)
        return True

    @property
    def streaming(self) -> bool:
        """Whether :meth:`read_expected` would try: the last message was large (more are
        likely coming, each read best in one call) and nothing is read ahead."""
        return self._head_only and self._r1 == self._r0

    def read_expected(self, step: int, index: int, view: memoryview) -> bool | None:
        """In a stream of large messages (:attr:`streaming`), read the next one's head and
        what is there of its payload in one call (the payload straight into ``view``, a
        flat byte view), without blocking; if it is (``step``, ``index``), bare, of
        ``view.nbytes``, read the rest of it (blocking, as :meth:`read_into`) and return
        True. False: it was another message; its bytes are read ahead again, for the usual
        reads (``view`` may hold some of them). None: nothing tried, or nothing there yet.
        Where the general way reads a head and then its payload, this saves a call a
        message: at 64 KiB about a sixth of a stream's time on one host."""
        if not self.streaming:
            return None
        self._r0 = self._r1 = 0
        try:
            n = self.sock.recvmsg_into([self._rview[:HEADER.size], view], 0,
                                       socket.MSG_DONTWAIT)[0]
        except BlockingIOError:
            return None
        except OSError as exc:
            raise self._ended(exc) from None
        if n == 0:
            raise self._ended()
        total = view.nbytes
        if n >= HEADER.size and HEADER.unpack_from(self._rbuf) == (step, index, total, 0):
            got = n - HEADER.size
            if got < total:
                self.read_into(view[got:])
            self._head_only = total > READ_AHEAD
            return True
        # Another message (a failed step's, one with meta, another size): what landed in
        # ``view`` goes back behind the head, as if read ahead (the buffer grows for it
        # until it is read; _read_ahead gives it back its size).
        past = max(0, n - HEADER.size)
        if n > len(self._rbuf):
            grown = bytearray(n)  # (n > the buffer, so more than READ_AHEAD)
            grown[:HEADER.size] = self._rview[:HEADER.size]
            self._rbuf, self._rview = grown, memoryview(grown)
        self._rview[HEADER.size:n] = view[:past]
        self._r1 = n
        return False

    def wake(self) -> None:
        """End a :meth:`wait_readable` in progress, or the next one (any thread); unlike
        :meth:`interrupt`, the lane stays usable."""
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed
            os.write(self._wake_w, b"!")

    def recv_now(self, view: memoryview, unit: int = 1) -> int:
        """Read what the lane has, at most ``view.nbytes``, into ``view`` without blocking
        (0 if nothing after all). With :meth:`wait_readable` before it, a caller knows when
        bytes are being written into its buffer and when not, and can take the buffer away
        in between (the transpose's lanes do). ``unit`` > 1: only whole ``unit``-byte
        elements (``view.nbytes`` a multiple of it); the bytes of one not wholly here yet
        wait in the read-ahead buffer. A buffer taken away between two reads then holds
        whole elements of the message and, after them, its own values untouched (the
        transpose's result written over the caller's vector keeps its own contribution
        there for a stand-in)."""
        if unit > 1:
            return self._recv_whole(view, unit)
        if self._r1 > self._r0:
            return self._take(view)
        try:
            n = self.sock.recv_into(view, view.nbytes, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise self._ended(exc) from None
        if n == 0 and view.nbytes:
            raise self._ended()
        return n

    def _recv_whole(self, view: memoryview, unit: int) -> int:
        """:meth:`recv_now` in whole elements: as many as the read-ahead buffer, else the
        socket, holds (asked first, FIONREAD: a read into ``view`` must not stop inside an
        element, whose first bytes would then be written over ours)."""
        if self._r1 - self._r0 < unit and self._r1 > self._r0:
            # Part of an element is read ahead: the rest joins it there, then it is taken.
            self._read_ahead(socket.MSG_DONTWAIT)
        held = self._r1 - self._r0
        if held:
            take = min(held, view.nbytes)
            return self._take(view[:take - take % unit])
        try:
            queued = recv_queue_bytes(self.sock.fileno())
        except (OSError, ValueError) as exc:
            raise self._ended(exc) from None
        want = min(queued, view.nbytes)
        want -= want % unit
        if not want:  # part of an element (or the end: the read says so) goes read ahead
            self._read_ahead(socket.MSG_DONTWAIT)
            return 0
        try:
            n = self.sock.recv_into(view, want, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise self._ended(exc) from None
        try:
            while n % unit:  # (not seen: the kernel gives what it said it holds) its rest
                n += self.sock.recv_into(view[n:], unit - n % unit, socket.MSG_WAITALL)
        except OSError as exc:
            raise self._ended(exc) from None
        return n

    @property
    def buffered(self) -> int:
        """Bytes read ahead and not taken yet (a read of at most this many needs no call)."""
        return self._r1 - self._r0

    def skip(self, nbytes: int) -> None:
        """Read and drop the next ``nbytes`` (a message nobody wants any more)."""
        if self._sink is None:
            self._sink = bytearray(1 << 18)
        sink = memoryview(self._sink)
        while nbytes > 0:
            n = min(nbytes, sink.nbytes)
            self.read_into(sink[:n])
            nbytes -= n

    def read_into(self, view: memoryview) -> None:
        """Read exactly ``view.nbytes`` into ``view``, blocking until they are there (what
        was read ahead first)."""
        flat = _flat(view)
        got, total = self._take(flat), flat.nbytes
        while got < total:
            try:
                n = self.sock.recv_into(flat[got:])
            except OSError as exc:
                raise self._ended(exc) from None
            if n == 0:
                raise self._ended()
            got += n

    # -- teardown --------------------------------------------------------------------------------
    def interrupt(self) -> None:
        """Make blocked sends and receives fail now (any thread); the lane is unusable after."""
        with contextlib.suppress(OSError):  # not connected any more: nothing blocks on it
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.interrupt()
        self._queue.put(None)
        if self._sender is not None and self._sender is not threading.current_thread():
            self._sender.join(timeout=5)
        self.sock.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def dial(host: str, port: int, token: bytes, peer: int, timeout: float,
         unix: str | None = None) -> Lane:
    """Connect to ``peer``'s lane, prove the secret and wait for its acceptance: over the
    abstract Unix socket ``unix`` if there is one of that name here (the peer is on this
    host), else to ``host:port``."""
    sock = _connect_local(unix, timeout) if unix else None
    if sock is None:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise PeerLost(peer, f"cannot open a lane to {host}:{port}: {exc}") from None
    try:
        tune(sock)
        sock.sendall(token)
        if sock.recv(1) != b"\x01":
            raise PeerLost(peer, f"rank {peer} refused our lane")
    except OSError as exc:
        sock.close()
        raise PeerLost(peer, f"opening a lane to rank {peer}: {exc}") from None
    except PeerLost:
        sock.close()
        raise
    sock.settimeout(None)
    return Lane(sock, peer)


def _connect_local(name: str, timeout: float) -> socket.socket | None:
    """A connection to the abstract Unix socket ``name``, or None if there is none here."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(b"\0" + name.encode("ascii"))
    except OSError:  # no such name in this network namespace: the peer is elsewhere
        sock.close()
        return None
    return sock


def local_name(text: object) -> str | None:
    """``text`` if it has the shape of a lane's abstract name (what :class:`LaneListener`
    makes; a peer's offer is checked before anything connects to it), else None."""
    if not isinstance(text, str) or not text.startswith(LOCAL_PREFIX):
        return None
    digits = text[len(LOCAL_PREFIX):]
    if len(digits) == 2 * LOCAL_NONCE_BYTES and all(c in "0123456789abcdef" for c in digits):
        return text
    return None


class LaneListener:
    """A fresh port that accepts one lane from ``peer`` (whoever proves ``token``); with
    ``local``, also an abstract Unix socket named :attr:`unix`, for a sender on this host."""

    def __init__(self, host: str, peer: int, *, local: bool = False) -> None:
        self.peer = peer
        self.sock = socket.create_server((host, 0), backlog=8)
        self.port: int = self.sock.getsockname()[1]
        self.unix: str | None = None
        self._local: socket.socket | None = None
        if local:
            name = LOCAL_PREFIX + os.urandom(LOCAL_NONCE_BYTES).hex()
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                unix.bind(b"\0" + name.encode("ascii"))
                unix.listen(8)
            except OSError:  # no abstract Unix sockets here: TCP alone
                unix.close()
            else:
                self._local, self.unix = unix, name
        self.refused = 0  # connections that did not prove the secret
        # close() from another thread wakes an accept in progress through this pair (an
        # opening abandoned when its step failed elsewhere: the accept's thread would
        # otherwise wait out its timeout, and the process could not exit meanwhile).
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._lock = threading.Lock()
        self._closed = self._accepting = False

    def accept(self, token: bytes, timeout: float = ACCEPT_TIMEOUT_S,
               proof_timeout: float = PROOF_TIMEOUT_S) -> Lane:
        """Block until a connection proves ``token`` (it becomes the lane) or ``timeout``.

        Connections are read side by side, never more than :data:`MAX_PENDING` at once (the
        oldest is dropped), each for at most ``proof_timeout`` and ``PROOF_BYTES``: one that
        stays silent or sends garbage delays nobody."""
        deadline = time.monotonic() + timeout
        pending: dict[socket.socket, tuple[bytearray, float]] = {}
        with self._lock:
            if self._closed:
                raise PeerLost(self.peer, f"the opening of rank {self.peer}'s lane was given up")
            self._accepting = True
        sel = selectors.DefaultSelector()
        listening = [s for s in (self.sock, self._local) if s is not None]
        for sock in listening:
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while (now := time.monotonic()) < deadline:
                for conn, (_buf, until) in list(pending.items()):
                    if until <= now:
                        self._refuse(sel, pending, conn)
                wake = min([deadline, *(until for _b, until in pending.values())])
                for key, _ev in sel.select(max(0.0, wake - now)):
                    conn = cast(socket.socket, key.fileobj)
                    if conn is self._wake_r:
                        raise PeerLost(self.peer, f"the opening of rank {self.peer}'s lane "
                                       "was given up")
                    if conn in listening:
                        self._admit(conn, sel, pending, now + proof_timeout)
                        continue
                    buf = pending[conn][0]
                    try:
                        chunk = conn.recv(PROOF_BYTES - len(buf))
                    except OSError:
                        chunk = b""
                    buf += chunk
                    if not chunk or (len(buf) == PROOF_BYTES
                                     and not hmac.compare_digest(bytes(buf), token)):
                        self._refuse(sel, pending, conn)
                    elif len(buf) == PROOF_BYTES:
                        sel.unregister(conn)
                        del pending[conn]
                        conn.setblocking(True)
                        tune(conn)
                        conn.sendall(b"\x01")
                        return Lane(conn, self.peer)
        finally:
            for conn in pending:
                conn.close()
            sel.close()
            with self._lock:
                self._closed = True
            self._release()
        raise PeerLost(self.peer, f"rank {self.peer} did not open its lane within {timeout:g} s")

    def _admit(self, listening: socket.socket, sel: selectors.BaseSelector,
               pending: dict[socket.socket, tuple[bytearray, float]], until: float) -> None:
        try:
            conn, _addr = listening.accept()
        except OSError:  # gone before we got to it
            return
        conn.setblocking(False)
        if len(pending) >= MAX_PENDING:
            self._refuse(sel, pending, next(iter(pending)))
        pending[conn] = (bytearray(), until)
        sel.register(conn, selectors.EVENT_READ)

    def _refuse(self, sel: selectors.BaseSelector,
                pending: dict[socket.socket, tuple[bytearray, float]],
                conn: socket.socket) -> None:
        sel.unregister(conn)
        del pending[conn]
        conn.close()
        self.refused += 1

    def close(self) -> None:
        """Stop listening (any thread); an accept in progress gives up at once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            accepting = self._accepting
        if accepting:  # its thread closes the sockets once woken (not under its selector)
            with contextlib.suppress(OSError):
                self._wake_w.send(b"!")
        else:
            self._release()

    def _release(self) -> None:
        for sock in (self.sock, self._local, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
