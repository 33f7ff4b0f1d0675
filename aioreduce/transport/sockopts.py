"""Socket options for data connections.

TCP_NODELAY: small control frames must not wait for Nagle. Keepalive plus TCP_USER_TIMEOUT: a
host that dies without closing its sockets is noticed in seconds instead of hanging a receive
for the kernel's default of many minutes. Buffer sizes are left to Linux autotuning on purpose:
setting SO_RCVBUF/SO_SNDBUF disables it.
"""

from __future__ import annotations

import contextlib
import fcntl
import resource
import socket
import struct
import termios

KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 3
USER_TIMEOUT_S = 30.0
# A Unix stream has no autotuning: its send buffer stays at net.core.wmem_default (208 KiB).
# Our ring over Unix lanes, 4 ranks on one 2-core host, in place: with 2 MiB, 16 MiB steps
# took 19.5-21.1 ms (2 runs) against 21.3-25.6 without (3 runs); at 1 MiB 3.5-3.6 against
# 3.7-4.0 (TCP: 3.0-3.3; with the mesh on Unix sockets too, 2.7).
UNIX_SNDBUF = 2 << 20


def tune(sock: socket.socket, user_timeout: float = USER_TIMEOUT_S) -> None:
    """Apply aioreduce's TCP options to a connected data socket (best effort per option); a
    Unix stream gets a larger send buffer (see :data:`UNIX_SNDBUF`)."""
    if sock.family == socket.AF_UNIX:
        with contextlib.suppress(OSError):  # the kernel caps it at net.core.wmem_max
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)
        return
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    opts: list[tuple[int, int, int]] = [
        (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    ]
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
                        ("TCP_USER_TIMEOUT", int(user_timeout * 1000))):
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, opt, value in opts:
        with contextlib.suppress(OSError):  # not every kernel knows every option
            sock.setsockopt(level, opt, value)


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to the hard limit (as many servers do at
    start-up), so connections a flood opens cannot starve our own files; return the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def send_queue_bytes(fd: int) -> int:
    """Bytes in a TCP socket's send queue (TIOCOUTQ: not sent yet, or sent and not yet
    acknowledged by the peer's kernel); ``OSError`` if ``fd`` is closed."""
    return _queue_bytes(fd, termios.TIOCOUTQ)


def recv_queue_bytes(fd: int) -> int:
    """Bytes a stream socket (TCP or Unix) holds that nobody has read yet (FIONREAD);
    ``OSError`` if ``fd`` is closed."""
    return _queue_bytes(fd, termios.FIONREAD)


def _queue_bytes(fd: int, request: int) -> int:
    """The byte count a socket queue ioctl (``request``) answers for ``fd``."""
    queued = fcntl.ioctl(fd, request, b"\0\0\0\0")
    nbytes: int = struct.unpack("i", queued)[0]
    return nbytes
