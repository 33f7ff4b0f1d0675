"""Bulk exchange steps (``Peers.exchange(..., bulk=True)``, the owners' sums of 16-bit floats)
between three real meshes on 127.0.0.1: exact in both directions, on lanes to and from every
peer opened at the first such step and kept (no exchange frame crosses the mesh), mixed with
exchanges over the mesh in one step sequence, and a lost peer named by the step instead of a
hang."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from aioreduce.errors import PeerLost
from aioreduce.peers import Peers
from aioreduce.stepper import Stepper
from aioreduce.straggle import StraggleModel
from aioreduce.transport import Mesh, MeshOptions
from aioreduce.wire import tags

pytestmark = pytest.mark.loopback

WORLD = 3


@pytest.fixture(params=[True, False], ids=["unix", "tcp"])
async def peers(request: pytest.FixtureRequest) -> AsyncIterator[list[Peers]]:
    meshes = [Mesh(r, WORLD, b"secret", "job", MeshOptions(local_unix=request.param))
              for r in range(WORLD)]
    addrs = [await m.listen("127.0.0.1") for m in meshes]
    for m in meshes:
        m.addresses = dict(enumerate(addrs))
    out = [Peers(m, Stepper(m.rank, WORLD, StraggleModel(()), None, None)) for m in meshes]
    try:
        yield out
    finally:
        for p in out:
            await p.close_lanes(1.0)
            await p.mesh.close()


def _vectors(step: int, n: int) -> list[dict[int, np.ndarray]]:
    """What rank ``me`` sends rank ``r`` at ``step``: values naming both and the step."""
    return [{r: np.arange(n, dtype=np.float32) + 1000 * me + 100 * r + step
             for r in range(WORLD) if r != me} for me in range(WORLD)]


async def test_bulk_steps_are_exact_on_lanes_and_mix_with_mesh_steps(peers: list[Peers],
                                                                    monkeypatch) -> None:
    over_mesh: list[int] = []  # the steps whose exchange frames went through a mesh
    for p in peers:
        send = p.mesh.send

        async def counted(rank: int, array: np.ndarray, *, step: int, tag: int = 0,
                          meta: object = None, _send=send) -> None:  # type: ignore[no-untyped-def]
            if tag == tags.EXCHANGE:
                over_mesh.append(step)
            await _send(rank, array, step=step, tag=tag, meta=meta)

        monkeypatch.setattr(p.mesh, "send", counted)
    n = 1 << 18  # 1 MiB a message: many chunks through each lane
    for step, bulk in enumerate([True, True, False, True]):
        sends = _vectors(step, n)
        got = [{r: np.empty(n, np.float32) for r in range(WORLD) if r != me}
               for me in range(WORLD)]
        await asyncio.gather(*(p.exchange(sends[me], got[me], bulk=bulk)
                               for me, p in enumerate(peers)))
        for me in range(WORLD):
            for r, array in got[me].items():
                np.testing.assert_array_equal(array, sends[r][me])
        for sent in sends:  # sent: ours to change now
            for array in sent.values():
                array.fill(np.nan)
    assert sorted(set(over_mesh)) == [2]  # only the step that asked for the mesh
    assert all(p._lanes is not None for p in peers)


async def test_a_lost_peer_fails_a_bulk_step_naming_it(peers: list[Peers]) -> None:
    n = 1 << 10
    await asyncio.gather(*(p.exchange(_vectors(0, n)[me],
                                      {r: np.empty(n, np.float32) for r in range(WORLD) if r != me},
                                      bulk=True) for me, p in enumerate(peers)))
    await peers[2].close_lanes(0)
    await peers[2].mesh.close()
    with pytest.raises(PeerLost) as lost:
        await asyncio.wait_for(asyncio.gather(*(
            p.exchange(_vectors(1, n)[me],
                       {r: np.empty(n, np.float32) for r in range(WORLD) if r != me}, bulk=True)
            for me, p in enumerate(peers[:2]))), 30)
    assert lost.value.rank == 2
