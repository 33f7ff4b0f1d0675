"""A rank that dies during the handshake is a lost peer, not a refusal.

CI saw it (ring, ``--tolerate 2``, two ranks killed at step 5): a rank was dialing a peer as
that peer was SIGKILLed; the connection closed before any WELCOME, the dialer took the close
for a refusal ("wrong secret or job id, or is rank 4 started twice?"), exited 1, and the job
stopped although it tolerated those deaths. A refusing side now says so before it closes (see
aioreduce/wire/handshake.py), so a bare close means the peer is gone.

Here the listener is a real process that runs the listener's handshake on its port (and on
its rank's abstract Unix name, which the dialer tries first) and SIGKILLs itself at a chosen
point of it; the dialer is a real :class:`Mesh`. Each case also checks the death landed where
it meant to (the listener reports how far it got), and that a refusal, unlike a death, is
still named as one.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from aioreduce.errors import AuthError, PeerLost
from aioreduce.transport import Mesh, MeshOptions

pytestmark = pytest.mark.loopback

SECRET = b"handshake secret"
JOB = "death-job"

# Rank 0 of a 2-rank job: serves one handshake on whichever socket the dialer uses first
# (after a death on the Unix name the dialer's TCP try finds nobody). ``point``: "hello" dies
# on reading HELLO, before proving anything; "auth" dies on reading AUTH, after proving the
# secret; "refuse" proves the secret and then refuses (as a rank that sees rank 1 twice).
LISTENER = r"""
import os, select, signal, socket, sys
from aioreduce.transport.mesh import local_mesh_name
from aioreduce.wire import encode_frame
from aioreduce.wire.decoder import FrameDecoder
from aioreduce.wire.handshake import ListenerHandshake, refusal

secret, job, point, unix = sys.argv[1].encode(), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
tcp = socket.create_server(("127.0.0.1", 0))
port = tcp.getsockname()[1]
listening = [tcp]
if unix:
    local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    local.bind(local_mesh_name(job, 0, port))
    local.listen()
    listening.append(local)
print(port, flush=True)
ready, _, _ = select.select(listening, [], [], 60)
conn, _ = ready[0].accept()
hs = ListenerHandshake(secret, job, 0, 2)
frames = []
dec = FrameDecoder(lambda h: None, 0)
while True:
    while not frames:
        data = conn.recv(65536)
        if not data:
            sys.exit("the dialer closed first")
        frames = dec.receive_data(data)
    header = frames.pop(0).header
    print("got", header.kind.name, "on", "unix" if ready[0] is not tcp else "tcp", flush=True)
    if header.kind.name == point.upper():
        os.kill(os.getpid(), signal.SIGKILL)
    out, event = hs.receive(header)
    if header.kind.name == "AUTH" and point == "refuse":
        out = [refusal(0, "rank 1 was started twice: it is already connected from elsewhere")]
    for h in out:
        conn.sendall(b"".join(bytes(b) for b in encode_frame(h)))
    if event is not None:
        conn.close()
        sys.exit(0)
"""


def _listener(point: str, unix: bool) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", LISTENER, SECRET.decode(), JOB, point,
                             "1" if unix else "0"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


async def _dial(port: int, unix: bool) -> BaseException:
    mesh = Mesh(1, 2, SECRET, JOB, MeshOptions(local_unix=unix, connect_timeout=10))
    await mesh.listen("127.0.0.1")
    mesh.addresses[0] = ("127.0.0.1", port)
    try:
        await mesh.connect(0)
    except (AuthError, PeerLost) as exc:
        return exc
    finally:
        await mesh.close()
    raise AssertionError("the handshake succeeded with a listener that never welcomes")


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
@pytest.mark.parametrize("point", ["hello", "auth"])
async def test_a_peer_killed_during_the_handshake_is_lost_not_refusing(point: str,
                                                                      unix: bool) -> None:
    proc, port = _listener(point, unix)
    try:
        exc = await _dial(port, unix)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -9, out  # it died by the kill, where it meant to
    assert out.split("\n")[-2] == f"got {point.upper()} on {'unix' if unix else 'tcp'}", out
    assert isinstance(exc, PeerLost) and not isinstance(exc, AuthError), repr(exc)
    assert exc.rank == 0, repr(exc)
    assert "refused" not in str(exc) and "started twice" not in str(exc), str(exc)


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
async def test_a_refusal_after_the_proof_is_still_named_as_one(unix: bool) -> None:
    proc, port = _listener("refuse", unix)
    try:
        exc = await _dial(port, unix)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.split("\n")[-2].startswith("got AUTH"), out
    assert isinstance(exc, AuthError), repr(exc)  # fatal: no second try over TCP
    assert "rank 1 was started twice" in str(exc), str(exc)


# A dialer of the job that SIGKILLs itself once it has the listener's CHALLENGE (it sent
# HELLO; it will never send AUTH): the listener's side of a rank killed mid-handshake.
DIALER = r"""
import os, signal, socket, sys
from aioreduce.wire import encode_frame
from aioreduce.wire.decoder import FrameDecoder
from aioreduce.wire.handshake import ConnectorHandshake

secret, job, port = sys.argv[1].encode(), sys.argv[2], int(sys.argv[3])
conn = socket.create_connection(("127.0.0.1", port))
hs = ConnectorHandshake(secret, job, 1, 0)
conn.sendall(b"".join(bytes(b) for b in encode_frame(hs.start())))
dec = FrameDecoder(lambda h: None, 0)
frames = []
while not frames:
    data = conn.recv(65536)
    if not data:
        sys.exit("the listener closed first")
    frames = dec.receive_data(data)
print("got", frames[0].header.kind.name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


async def test_a_dialer_killed_during_the_handshake_is_not_logged_as_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    mesh = Mesh(0, 2, SECRET, JOB, MeshOptions(local_unix=False))
    _host, port = await mesh.listen("127.0.0.1")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", DIALER, SECRET.decode(), JOB, str(port),
            stdout=subprocess.PIPE)
        out, _ = await proc.communicate()
        assert proc.returncode == -9 and out.decode() == "got CHALLENGE\n", (proc.returncode, out)
        # It answered HELLO, so the connection is half-way through its handshake until the
        # listener's loop sees the close: wait for that, not for a time.
        await mesh.handshakes_settled(30)
        assert mesh.refused == 1
    finally:
        await mesh.close()
    assert "ended during the handshake" in caplog.text, caplog.text
    assert "refused connection" not in caplog.text, caplog.text
