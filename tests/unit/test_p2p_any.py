"""A receive from any source (``PointToPoint.recv_any``) over a stub comm whose probes the
test resolves: it takes the first peer whose message is here, with that peer's next number;
a lost peer is passed over; with every peer lost it raises; two such receives on one tag
take their messages in turn. (The probe itself, on real connections: the torch calls test.)
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aioreduce.errors import PeerLost
from aioreduce.schemes.p2p import PointToPoint
from aioreduce.wire import P2P_TAG


class _Comm:
    rank, world_size = 0, 4

    def __init__(self) -> None:
        self.probes: dict[tuple[int, int, int], asyncio.Future[None]] = {}
        self.posted: list[tuple[int, int, int]] = []

    def probe(self, rank: int, *, step: int, tag: int) -> asyncio.Future[None]:
        key = (rank, step, tag)
        fut = self.probes.get(key)
        if fut is None or fut.cancelled():
            fut = self.probes[key] = asyncio.get_running_loop().create_future()
        return fut

    def post_recv(self, rank: int, out: np.ndarray, *, step: int, tag: int = 0
                  ) -> asyncio.Future[None]:
        self.posted.append((rank, step, tag))
        fut = asyncio.get_running_loop().create_future()
        out[:] = rank
        fut.set_result(None)
        return fut


async def _turn() -> None:
    for _ in range(5):  # let the receive take its probes
        await asyncio.sleep(0)


def _arrive(comm: _Comm, rank: int, step: int) -> None:
    comm.probes[(rank, step, P2P_TAG + 9)].set_result(None)


async def test_the_first_message_here_is_taken_with_its_peers_number() -> None:
    comm = _Comm()
    p2p = PointToPoint(comm)  # type: ignore[arg-type]
    assert p2p.recv_key(2, 9) == (0, P2P_TAG + 9)  # one from rank 2 was received by name
    out = np.zeros(1)
    got = asyncio.ensure_future(p2p.recv_any(9, out))
    await _turn()
    assert (2, 1, P2P_TAG + 9) in comm.probes  # rank 2's next is its second message
    _arrive(comm, 3, 0)
    assert await got == 3 and out[0] == 3 and comm.posted == [(3, 0, P2P_TAG + 9)]
    assert p2p.recv_key(3, 9) == (1, P2P_TAG + 9)  # rank 3's first is taken


async def test_lost_peers_are_passed_over_and_all_lost_raises() -> None:
    comm = _Comm()
    p2p = PointToPoint(comm)  # type: ignore[arg-type]
    got = asyncio.ensure_future(p2p.recv_any(9, np.zeros(1)))
    await _turn()
    comm.probes[(1, 0, P2P_TAG + 9)].set_exception(PeerLost(1, "gone"))
    await _turn()
    assert not got.done()
    _arrive(comm, 2, 0)
    assert await got == 2
    for rank in (2, 3):
        comm.probes[(rank, 0 if rank == 3 else 1, P2P_TAG + 9)] = fut = (
            asyncio.get_running_loop().create_future())
        fut.set_exception(PeerLost(rank, "gone"))
    comm.probes[(1, 0, P2P_TAG + 9)] = lost = asyncio.get_running_loop().create_future()
    lost.set_exception(PeerLost(1, "gone"))
    with pytest.raises(PeerLost):
        await p2p.recv_any(9, np.zeros(1))


async def test_two_receives_on_one_tag_take_their_messages_in_turn() -> None:
    comm = _Comm()
    p2p = PointToPoint(comm)  # type: ignore[arg-type]
    first = asyncio.ensure_future(p2p.recv_any(9, np.zeros(1)))
    second = asyncio.ensure_future(p2p.recv_any(9, np.zeros(1)))
    await _turn()
    _arrive(comm, 1, 0)
    assert await first == 1
    await _turn()
    assert not second.done()  # rank 1's first is taken; its second is not here yet
    _arrive(comm, 1, 1)
    assert await second == 1
    assert comm.posted == [(1, 0, P2P_TAG + 9), (1, 1, P2P_TAG + 9)]
