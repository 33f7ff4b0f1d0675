"""The shortcuts a step's hot path takes, each against the long way it replaces.

A step's Python calls are what its CPU time follows on one host (``aioreduce-bench allreduce``
prints them per rank under ``AIOREDUCE_BENCH_PROFILE``). These pieces keep the behaviour of
what they replace: every inbox's floor moved in one call, a wrapper's unchanged calls bound to
the inner comm, and one msgpack packer per thread.
"""

from __future__ import annotations

import threading

import msgpack
import numpy as np
import pytest

from aioreduce.schemes.base import CommWrapper
from aioreduce.schemes.dormant import GatedComm
from aioreduce.transport.inbox import Inbox
from aioreduce.transport.memory import MemoryNetwork
from aioreduce.wire import Header, Kind
from aioreduce.wire.decoder import Frame
from aioreduce.wire.frame import PREFIX, PREFIX_SIZE, encode_data

CONN = object()  # the inbox only keys state by connection here


def _data(step: int, tag: int, nbytes: int) -> Header:
    return Header(Kind.DATA, step, tag, 1, "|u1", (nbytes,))


def _stage(inbox: Inbox, step: int, tag: int, nbytes: int = 8) -> None:
    buf = inbox.choose(CONN, _data(step, tag, nbytes))
    assert isinstance(buf, memoryview)
    inbox.delivered(CONN, Frame(_data(step, tag, nbytes), buf))


def test_set_floors_is_set_floor_on_each_inbox() -> None:
    quiet, busy, ahead = (Inbox(1, stage_limit=1 << 20) for _ in range(3))
    _stage(busy, 3, 0)
    _stage(busy, 5, 0)
    ahead.set_floor(9)
    Inbox.set_floors([quiet, busy, ahead], 4)
    assert quiet.floor == 4 and busy.floor == 4
    assert ahead.floor == 9  # a floor never moves back
    assert busy.staged_bytes == 8  # step 3's frame dropped, step 5's kept
    # The quiet inbox only had its key moved: a frame of a step below it is stale there too.
    assert quiet.choose(CONN, _data(3, 0, 8)) is None
    # A step's stages by tag, as the transpose drops them.
    _stage(busy, 5, 1)
    Inbox.set_floors([quiet, busy], 5, 1)
    assert busy.staged_bytes == 8 and quiet.floor_key == (5, 1)


class _Counting(CommWrapper):
    """Overrides send only: its own send must still run."""

    sent = 0

    async def send(self, rank: int, array: np.ndarray, *, step: int, tag: int = 0,
                   meta: dict[str, object] | None = None) -> None:
        self.sent += 1
        await super().send(rank, array, step=step, tag=tag, meta=meta)


async def test_a_wrapper_binds_the_calls_it_leaves_to_the_inner_comm() -> None:
    net = MemoryNetwork(2)
    a, b = net.comms
    gate = GatedComm(a)
    # The path taken: the inner comm's own bound methods, no method of the wrapper between.
    assert gate.post_recv == a.post_recv and gate.send == a.send
    counting = _Counting(GatedComm(a))
    assert counting.post_recv == a.post_recv
    assert counting.send != a.send  # overridden: not bypassed
    out = np.empty(4, np.float32)
    fut = b.post_recv(0, out, step=0)
    await counting.send(1, np.arange(4, dtype=np.float32), step=0)
    await fut
    assert counting.sent == 1 and out.tolist() == [0, 1, 2, 3]


def _header_of(step: int, meta: dict[str, object]) -> Header:
    head = bytes(encode_data(step, 2, 0, np.zeros(3, np.float32), meta)[0])
    hlen = PREFIX.unpack_from(head)[3]
    return Header.from_bytes(head[PREFIX_SIZE:PREFIX_SIZE + hlen])


def test_one_packer_per_thread_packs_every_header_whole() -> None:
    seen: dict[int, list[Header]] = {}

    def pack(n: int) -> None:
        seen[n] = [_header_of(i, {"n": n, "i": i}) for i in range(500)]

    threads = [threading.Thread(target=pack, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n, headers in seen.items():
        assert [(h.step, h.meta) for h in headers] == [(i, {"n": n, "i": i}) for i in range(500)]
    # A header that cannot be packed leaves the packer clean for the next one.
    with pytest.raises(TypeError):
        _header_of(1, {"bad": object()})
    assert _header_of(7, {"ok": 1}).meta == {"ok": 1}
    assert msgpack.unpackb(msgpack.packb({"x": 1})) == {"x": 1}
