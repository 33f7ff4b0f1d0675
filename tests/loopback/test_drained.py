"""``Mesh.drained``: a rank knows when its peers' kernels have every byte it sent (real sockets
on 127.0.0.1). The benchmarks wait for it between steps, so traffic a straggler-tolerant step
left on the links is not charged to the step after it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aioreduce.transport import Mesh

pytestmark = pytest.mark.loopback

MIB = 1 << 20


async def test_drained_waits_for_a_peer_that_is_not_reading() -> None:
    a, b = Mesh(0, 2, b"s", "job"), Mesh(1, 2, b"s", "job")
    try:
        addr = await b.listen("127.0.0.1")
        await a.connect(1, addr)
        await b.handshakes_settled(timeout=10)
        (conn,) = b._conns
        assert conn.transport is not None
        conn.transport.pause_reading()  # rank 1 stops reading, like a busy process
        data = np.random.default_rng(0).integers(0, 255, 32 * MIB, np.uint8)
        sending = asyncio.create_task(a.send(1, data, step=0))
        # More than the socket buffers hold: part of it waits in ours and in the kernel's.
        for _ in range(1000):  # until the send task has written (it runs when we yield)
            if a.unacked():
                break
            await asyncio.sleep(0)
        assert not await a.drained(timeout=0.05)  # a bound, not a synchronisation
        assert a.unacked() > 0 and not sending.done()
        out = np.zeros_like(data)
        conn.transport.resume_reading()
        await asyncio.wait_for(b.recv_into(0, out, step=0), 60)
        await asyncio.wait_for(sending, 60)
        assert await a.drained(timeout=60)
        assert a.unacked() == 0 and b.unacked() == 0
        assert (out == data).all()
    finally:
        await a.close()
        await b.close()
