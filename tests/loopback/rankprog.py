"""Rank programs for the loopback tests: ``python rankprog.py SCENARIO [ARGS]``.

Each scenario is what one real rank process does; the tests start several of them with the
launcher's env contract and check their exit codes and output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import sys
import time
import tracemalloc

import numpy as np

import aioreduce as ar
from aioreduce.wire import Header, encode_frame


def _cases() -> list[np.ndarray]:
    """Arrays of several dtypes and shapes, including empty and non-contiguous ones."""
    base = np.arange(200, dtype=np.float32).reshape(10, 20)
    return [
        np.zeros(1000, np.float32),
        np.zeros((3, 5, 7), np.float64),
        np.zeros(0, np.int64),
        np.zeros((2, 0, 3), np.float32),
        np.zeros(1, np.uint8),
        np.zeros((4, 4), np.complex128),
        np.zeros((2, 3), np.float16),
        np.zeros(10, np.bool_),
        base[:, ::2],  # strided view: sent from a contiguous copy
        np.zeros((5, 6), np.int32, order="F").T,  # Fortran order
        np.zeros(1 << 20, np.float32),  # 4 MiB: above the staging limit, held back if early
    ]


def _fill(template: np.ndarray, src: int, dst: int, i: int) -> np.ndarray:
    """Deterministic contents for (src, dst, case), in the template's dtype and memory layout."""
    rng = np.random.default_rng([src, dst, i])
    raw = rng.integers(0, 256, size=template.nbytes, dtype=np.uint8)
    if template.dtype == np.bool_:
        raw &= 1
    values = raw.view(template.dtype).reshape(template.shape)
    if template.flags.c_contiguous:
        return values
    if template.flags.f_contiguous:
        return np.asfortranarray(values)
    holder = np.empty((template.shape[0], 2 * template.shape[1]), template.dtype)
    holder[:, ::2] = values
    return holder[:, ::2]


async def exchange() -> None:
    async with ar.Node.from_env() as node:
        me, world = node.rank, node.world_size
        cases = _cases()

        async def send_all(dst: int) -> None:
            for i, t in enumerate(cases):
                await node.send(dst, _fill(t, me, dst, i), step=i)

        async def recv_all(src: int) -> int:
            for i, t in enumerate(cases):
                out = np.empty(t.shape, t.dtype)
                header = await node.recv_into(src, out, step=i, timeout=30)
                want = np.ascontiguousarray(_fill(t, src, me, i))
                assert header.src == src and header.step == i
                assert out.tobytes() == want.tobytes(), f"case {i} from rank {src} differs"
            return len(cases)

        peers = [r for r in range(world) if r != me]
        counts = await asyncio.gather(*(send_all(p) for p in peers),
                                      *(recv_all(p) for p in peers))
        # Clear refusals of unusable arguments, without touching the network.
        try:
            await node.recv_into(peers[0], np.zeros((4, 4))[:, ::2], step=99)
            raise AssertionError("a non-contiguous receive buffer was accepted")
        except ValueError as exc:
            assert "C-contiguous" in str(exc)
        try:
            await node.send(peers[0], np.array([object()]), step=99)
            raise AssertionError("an object array was sent")
        except TypeError:
            pass
        # A receive whose dtype does not match what was sent fails clearly.
        nxt, prv = (me + 1) % world, (me - 1) % world
        await node.send(nxt, np.ones(4, np.float32), step=100)
        try:
            await node.recv_into(prv, np.zeros(2, np.float64), step=100, timeout=30)
            raise AssertionError("a float32 frame was received into a float64 buffer")
        except ValueError as exc:
            assert "<f4" in str(exc) and f"rank {prv}" in str(exc)
        print(f"OK {sum(c for c in counts if c)} arrays from {len(peers)} peers", flush=True)


async def oversize() -> None:
    """Rank 0 caps frames at 64 KiB; rank 1 overshoots once, then behaves; rank 2 is normal."""
    async with ar.Node.from_env() as node:
        me = node.rank
        if me == 0:
            a = np.empty(1000, np.float64)
            await node.recv_into(2, a, step=0, timeout=30)
            assert (a == 2).all()
            b = np.empty(256, np.float32)
            deadline = time.monotonic() + 20
            while True:  # rank 1's first connection was dropped; wait for its new one
                try:
                    await node.recv_into(1, b, step=1, timeout=20)
                    break
                except ar.PeerLost:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.05)
            assert (b == 1).all()
            await node.send(2, np.full(8, 7.0), step=2)
            print("OK served rank 2 before and after dropping rank 1's oversized frame")
        elif me == 1:
            conn = await node.mesh.connect(0)
            with contextlib.suppress(ar.PeerLost):  # rank 0 may already have hung up
                await node.send(0, np.zeros(1 << 18, np.float32), step=0)  # 1 MiB > 64 KiB
            await asyncio.wait_for(asyncio.shield(conn.closed), 20)
            await node.send(0, np.ones(256, np.float32), step=1)  # on a new connection
            print("OK reconnected after the oversized frame was refused")
        else:
            await node.send(0, np.full(1000, 2.0), step=0)
            c = np.empty(8)
            await node.recv_into(0, c, step=2, timeout=30)
            assert (c == 7).all()
            print("OK")


async def killed() -> None:
    """Rank 1 dies in the middle of a 64 MiB frame; rank 0 must get an error naming it."""
    async with ar.Node.from_env() as node:
        if node.rank == 1:
            conn = await node.mesh.connect(0)
            payload = np.ones(16 << 20, np.float32)
            head, body = encode_frame(Header(step=0, src=1), payload)
            assert conn.transport is not None
            conn.transport.write(head)
            conn.transport.write(memoryview(body)[: len(body) // 2])
            await asyncio.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        out = np.zeros(16 << 20, np.float32)
        t0 = time.monotonic()
        try:
            await node.recv_into(1, out, step=0, timeout=60)
            raise AssertionError("a half frame was delivered")
        except ar.PeerLost as exc:
            elapsed = time.monotonic() - t0
            assert exc.rank == 1 and "rank 1" in str(exc), exc
            print(f"LOST after {elapsed:.2f}s: {exc}", flush=True)
        t1 = time.monotonic()
        try:
            await node.recv_into(1, out, step=1, timeout=60)
        except ar.PeerLost:
            print(f"LOST again at once ({time.monotonic() - t1:.3f}s)", flush=True)


async def memory(mode: str) -> None:
    """Rank 0 sends one 64 MiB frame; rank 1 measures what receiving it allocated."""
    n = 16 << 20  # float32 elements = 64 MiB
    async with ar.Node.from_env() as node:
        if node.rank == 0:
            data = np.arange(n, dtype=np.float32)
            await node.recv_into(1, np.zeros(1, np.uint8), step=0, tag=9, timeout=30)
            await node.send(1, data, step=1)
            return
        out = np.empty(n, np.float32)
        out.fill(-1.0)  # touch every page, so it is resident before we measure
        tracemalloc.start()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if mode == "posted":
            recv = asyncio.ensure_future(node.recv_into(0, out, step=1, timeout=60))
            await asyncio.sleep(0)
            await node.send(0, np.zeros(1, np.uint8), step=0, tag=9)
            await recv
        else:  # the frame arrives before the receive is posted: it must be held back
            await node.send(0, np.zeros(1, np.uint8), step=0, tag=9)
            await asyncio.sleep(1.0)
            await node.recv_into(0, out, step=1, timeout=60)
        peak = tracemalloc.get_traced_memory()[1]
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tracemalloc.stop()
        ok = bool(out[0] == 0 and out[-1] == n - 1 and np.array_equal(out[::4097],
                                                                      np.arange(0, n, 4097)))
        print(json.dumps({"mode": mode, "traced_peak_bytes": peak,
                          "maxrss_growth_bytes": (rss1 - rss0) * 1024, "intact": ok}),
              flush=True)


async def join() -> None:
    """Join the job and report how that went (the missing-rank test leaves one rank out)."""
    try:
        async with ar.Node.from_env() as node:
            print(f"JOINED {node.rank}", flush=True)
    except ar.RendezvousError as exc:
        print(f"RENDEZVOUS {exc} missing={exc.missing}", flush=True)
        sys.exit(4)


def main() -> None:
    scenario, *args = sys.argv[1:]
    coro = {"exchange": exchange, "oversize": oversize, "killed": killed, "join": join
            }.get(scenario)
    ar.run(memory(args[0]) if scenario == "memory" else coro())  # type: ignore[misc]


if __name__ == "__main__":
    main()
