"""SO_RCVLOWAT while a payload lands on a TCP connection: the socket asks the kernel to wake the
receiver only once ``recv_lowat`` bytes of the payload (or its rest) are there, and every byte
still arrives (real sockets on 127.0.0.1; the sender runs its own event loop in a thread, so
bytes arrive while the receiver's loop waits, as between processes; delivery of every dtype and
shape between processes is in test_mesh). What it saves is measured by the benchmarks."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np
import pytest

from aioreduce.transport import Mesh
from aioreduce.transport.mesh import MeshOptions
from aioreduce.transport.protocol import _MIN_LOWAT, FrameProtocol
from aioreduce.wire.control import Release

pytestmark = pytest.mark.loopback

MIB = 1 << 20
SIZES = [16 * MIB, 3, MIB + 7, 100, 0, 5 * MIB]


def _data(step: int) -> np.ndarray:
    return np.random.default_rng(step).integers(0, 255, SIZES[step], np.uint8)


def _sender(addr: tuple[str, int], opts: MeshOptions, errors: list[BaseException]) -> None:
    async def main() -> None:
        b = Mesh(1, 2, b"s", "job", opts)
        try:
            await b.connect(0, addr)
            for step in range(len(SIZES)):
                await b.send(0, _data(step), step=step)
            await b.recv_control(0, timeout=60)  # the receiver has everything
        finally:
            await b.close()

    try:
        asyncio.run(main())
    except BaseException as exc:  # reported by the test, not lost in the thread
        errors.append(exc)


async def _receive(lowat: int, monkeypatch: pytest.MonkeyPatch
                   ) -> tuple[list[tuple[int, int]], int]:
    """Receive the frames of SIZES from rank 1 on rank 0, each checked byte for byte.

    Returns, for every read that landed payload bytes, (the payload's rest before it, the
    socket's SO_RCVLOWAT then), and the SO_RCVLOWAT after the last frame."""
    opts = MeshOptions(recv_lowat=lowat, local_unix=False)  # the mark is set on TCP only
    a = Mesh(0, 2, b"s", "job", opts)
    errors: list[BaseException] = []
    reads: list[tuple[int, int]] = []
    conns: list[FrameProtocol] = []
    counted = FrameProtocol.buffer_updated

    def counting(conn: FrameProtocol, nbytes: int) -> None:
        if conn.peer == 1:  # the sender's connection, authenticated
            left = conn.decoder.payload_left
            if left:  # this read landed in a payload
                sock = conn.transport.get_extra_info("socket")  # type: ignore[union-attr]
                reads.append((left, sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)))
            if conn not in conns:
                conns.append(conn)
        counted(conn, nbytes)

    monkeypatch.setattr(FrameProtocol, "buffer_updated", counting)
    try:
        addr = await a.listen("127.0.0.1")
        outs = [np.zeros(n, np.uint8) for n in SIZES]
        futs = [a.post_recv(1, out, step=s) for s, out in enumerate(outs)]
        thread = threading.Thread(target=_sender, args=(addr, opts, errors))
        thread.start()
        await asyncio.wait_for(asyncio.gather(*futs), 60)
        (conn,) = conns
        for step, out in enumerate(outs):
            assert (out == _data(step)).all(), step
        sock = conn.transport.get_extra_info("socket")  # type: ignore[union-attr]
        after = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
        await a.send_control(1, Release())
        await asyncio.to_thread(thread.join, 60)
    finally:
        await a.close()
    assert not errors, errors
    return reads, after


async def test_a_payload_wakes_the_receiver_per_lowat_and_every_byte_arrives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reads, after = await _receive(MIB, monkeypatch)
    # Every read into a payload was waited for with the low-water mark at the payload's rest,
    # at most a MiB (so no byte the frame does not owe us is ever waited for), except a rest
    # too small to be worth two setsockopt calls ...
    assert reads and all(mark == (min(left, MIB) if left >= _MIN_LOWAT else 1)
                         for left, mark in reads), reads
    assert after == 1  # ... and between frames the socket wakes us on every byte again
    plain, after = await _receive(0, monkeypatch)
    assert all(mark == 1 for _left, mark in plain) and after == 1  # recv_lowat=0: untouched
