"""The mesh between ranks on one host: its connections are abstract Unix sockets whose names
follow from the job, the rank and its port (see aioreduce/transport/mesh.py), TCP when the
option is off, and TCP when someone else holds the name. Frames arrive exact either way, and
a peer without the secret is refused on the Unix socket as on the port."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from aioreduce.errors import AuthError
from aioreduce.transport import Mesh, MeshOptions
from aioreduce.transport.mesh import local_mesh_name

pytestmark = pytest.mark.loopback

SECRET = b"mesh secret"


async def _pair(local: bool) -> list[Mesh]:
    meshes = [Mesh(r, 2, SECRET, "job", MeshOptions(local_unix=local)) for r in range(2)]
    addrs = [await m.listen("127.0.0.1") for m in meshes]
    for m in meshes:
        m.addresses = {0: addrs[0], 1: addrs[1]}
    return meshes


async def _exchange(meshes: list[Mesh]) -> None:
    """Rank 0 sends rank 1 a vector and gets it back negated, step 7: exact both ways."""
    sent = np.arange(100_000, dtype=np.float64)
    got1, got0 = np.empty_like(sent), np.empty_like(sent)
    back = meshes[0].post_recv(1, got0, step=7)
    await meshes[0].send(1, sent, step=7)
    await meshes[1].recv_into(0, got1, step=7, timeout=30)
    await meshes[1].send(0, -got1, step=7)
    await asyncio.wait_for(back, 30)
    assert (got1 == sent).all() and (got0 == -sent).all()


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "unix"])
async def test_ranks_on_one_host_connect_over_unix_unless_told_not_to(local: bool) -> None:
    meshes = await _pair(local)
    try:
        await _exchange(meshes)
        conn = await meshes[0].connect(1)
        assert conn.local is local
        if local:
            assert conn.peername == "local:unix"
        else:
            assert conn.peername.startswith("127.0.0.1:")
    finally:
        for m in meshes:
            await m.close()


async def test_a_name_taken_by_someone_else_means_tcp() -> None:
    """A local process that binds rank 1's name first (it is predictable) gets a connection
    it cannot answer: the dialer's handshake fails there and it dials TCP."""
    loop = asyncio.get_running_loop()
    meshes = [Mesh(r, 2, SECRET, "job") for r in range(2)]
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    accepted: list[socket.socket] = []
    try:
        host, port0 = await meshes[0].listen("127.0.0.1")
        # Rank 1 will listen on a port we pick now, so the squatter can take its name first.
        probe = socket.create_server(("127.0.0.1", 0))
        port1 = probe.getsockname()[1]
        probe.close()
        squatter.bind(local_mesh_name("job", 1, port1))
        squatter.listen(4)
        squatter.setblocking(False)
        await meshes[1].listen("127.0.0.1", port1)
        for m in meshes:
            m.addresses = {0: (host, port0), 1: (host, port1)}

        async def hang_up() -> None:  # accept the dialer and close on it at once
            conn, _addr = await loop.sock_accept(squatter)
            accepted.append(conn)
            conn.close()

        squatting = asyncio.ensure_future(hang_up())
        await _exchange(meshes)
        await asyncio.wait_for(squatting, 30)
        assert accepted, "the dialer never tried the Unix name"
        assert not (await meshes[0].connect(1)).local
    finally:
        squatter.close()
        for m in meshes:
            await m.close()


async def test_the_unix_socket_refuses_a_peer_without_the_secret(
        caplog: pytest.LogCaptureFixture) -> None:
    meshes = await _pair(True)
    intruder = Mesh(1, 2, b"not the secret", "job")
    try:
        intruder.addresses = dict(meshes[0].addresses)
        with pytest.raises(AuthError):
            await intruder.connect(0)
        # It tried the Unix socket first, failed the handshake there, then the port.
        assert "rank 0 (local socket): could not prove the job secret; dialing TCP" in caplog.text
        assert meshes[0].refused >= 1
        await _exchange(meshes)
        assert (await meshes[0].connect(1)).local
    finally:
        await intruder.close()
        for m in meshes:
            await m.close()


async def test_a_rank_that_proves_the_secret_and_refuses_us_is_not_dialed_again(
        caplog: pytest.LogCaptureFixture) -> None:
    """A second process claiming rank 1 is refused by rank 0 after both proved the secret:
    that refusal is meant (the job is misconfigured), so the dialer raises at once instead of
    trying TCP too (which kept a duplicate rank waiting for a job that had stopped)."""
    meshes = await _pair(True)
    twin = Mesh(1, 2, SECRET, "job")
    try:
        assert (await meshes[1].connect(0)).local  # the real rank 1, connected first
        twin.addresses = dict(meshes[0].addresses)
        with pytest.raises(AuthError, match="started twice"):
            await twin.connect(0)
        assert "dialing TCP instead" not in caplog.text
    finally:
        await twin.close()
        for m in meshes:
            await m.close()
