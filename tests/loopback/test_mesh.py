"""Real processes on 127.0.0.1: exact delivery, authentication, bad input, dead peers, memory."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from aioreduce.wire import FrameDecoder, Header, Kind, encode_frame
from aioreduce.wire.frame import MAGIC, PREFIX, VERSION

from .harness import SCHEMEPROG, Ranks

pytestmark = pytest.mark.loopback


def test_four_ranks_exchange_every_dtype_and_shape_intact(ranks) -> None:
    job: Ranks = ranks(4)
    job.start_all("exchange")
    done = job.wait(120)
    for d in done.values():
        assert d.returncode == 0, d.err
        assert "OK 33 arrays from 3 peers" in d.out  # 11 cases from each of 3 peers


def _connect_with_retry(port: int, deadline: float) -> socket.socket:
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _frame(header: Header) -> bytes:
    return b"".join(bytes(b) for b in encode_frame(header))


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


INTRUDER = """
import asyncio, sys
import aioreduce as ar
from aioreduce.transport import Mesh

async def main():
    mesh = Mesh(1, 3, b"not-the-secret", sys.argv[2])
    try:
        for _ in range(200):
            try:
                await mesh.connect(0, ("127.0.0.1", int(sys.argv[1])))
                print("ACCEPTED"); return
            except ar.PeerLost:
                await asyncio.sleep(0.05)
    except ar.AuthError as exc:
        print("REFUSED", exc)
    finally:
        await mesh.close()
ar.run(main())
"""


def test_wrong_secret_is_refused_while_the_job_proceeds(ranks) -> None:
    job: Ranks = ranks(3)
    job.start(0, "exchange")
    intruder = subprocess.run([sys.executable, "-c", INTRUDER, str(job.job.rendezvous_port),
                               job.job.job], capture_output=True, text=True, timeout=60)
    # Authentication is mutual: the intruder's side sees that rank 0 does not share its secret.
    assert intruder.stdout.startswith("REFUSED"), intruder.stdout + intruder.stderr
    assert "could not prove the job secret" in intruder.stdout
    # An intruder that ignores that and answers the challenge with a forged proof.
    with _connect_with_retry(job.job.rendezvous_port, time.monotonic() + 30) as s:
        s.sendall(_frame(Header(Kind.HELLO, src=1, meta={"job": job.job.job, "rank": 1,
                                                         "nonce": b"n" * 32})))
        dec = FrameDecoder(lambda h: None, 0)
        frames = []
        while not frames:
            frames = dec.receive_data(s.recv(4096))
        assert frames[0].header.kind is Kind.CHALLENGE
        s.sendall(_frame(Header(Kind.AUTH, src=1, meta={"proof": b"x" * 32})))
        rest = b""
        try:
            while chunk := s.recv(4096):
                rest += chunk
        except ConnectionResetError:
            pass
        told = dec.receive_data(rest)  # closed without a WELCOME, saying why
        assert [f.header.meta for f in told] == [{"op": "refused",
                                                  "reason": "wrong proof of the job secret"}]
    job.start(1, "exchange")
    job.start(2, "exchange")
    done = job.wait(120)
    assert all(d.returncode == 0 and "OK" in d.out for d in done.values()), done
    assert "refused connection from 127.0.0.1" in done[0].err
    assert "wrong proof of the job secret" in done[0].err


def test_garbage_and_oversized_frames_close_only_that_connection(ranks) -> None:
    job: Ranks = ranks(3)
    job.start(0, "oversize", AIOREDUCE_MAX_FRAME=str(64 << 10))
    deadline = time.monotonic() + 30
    port = job.job.rendezvous_port
    # 1. Not our protocol at all.
    with _connect_with_retry(port, deadline) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _closed_by_peer(s)
    # 2. A valid prefix announcing a payload before authenticating.
    with _connect_with_retry(port, deadline) as s:
        head = Header().to_bytes()
        s.sendall(PREFIX.pack(MAGIC, VERSION, 0, len(head), 1 << 40) + head)
        assert _closed_by_peer(s)
    # 3. An authenticated rank that sends more than rank 0 accepts (rankprog: oversize).
    job.start(1, "oversize")
    job.start(2, "oversize")
    done = job.wait(120)
    assert all(d.returncode == 0 and "OK" in d.out for d in done.values()), done
    err0 = done[0].err
    assert "bad magic" in err0 and "unauthenticated peer" in err0
    assert "protocol error from rank 1" in err0 and "exceeds the limit 65536" in err0


def test_peer_killed_mid_frame_names_the_rank(ranks) -> None:
    job: Ranks = ranks(2)
    job.start_all("killed")
    done = job.wait(90)
    assert done[1].returncode == -9
    assert done[0].returncode == 0, done[0].err
    lost = [line for line in done[0].out.splitlines() if line.startswith("LOST after")]
    assert lost and "rank 1" in lost[0]
    assert float(lost[0].split()[2].rstrip("s:")) < 10.0  # noticed promptly, not a hang
    assert "LOST again at once" in done[0].out


@pytest.mark.parametrize("mode", ["posted", "early"])
def test_receiving_64mib_allocates_no_second_buffer(ranks, mode: str) -> None:
    job: Ranks = ranks(2)
    job.start_all("memory", mode)
    done = job.wait(90)
    assert all(d.returncode == 0 for d in done.values()), done
    report = json.loads(done[1].out.strip().splitlines()[-1])
    assert report["intact"]
    # A second 64 MiB buffer would show in both measures; staging and scratch are <= 1 MiB.
    assert report["traced_peak_bytes"] < 8 << 20, report
    assert report["maxrss_growth_bytes"] < 16 << 20, report


def test_a_rank_that_never_shows_up_is_named(ranks) -> None:
    job: Ranks = ranks(4)
    for r in (0, 1, 3):  # rank 2 never starts
        job.start(r, "join", AIOREDUCE_TIMEOUT="2")
    done = job.wait(15)  # every rank fails within the 2 s timeout, not a hang
    assert done[0].returncode == 4 and "missing=[2]" in done[0].out, done[0]
    assert "ranks [2] did not reach register" in done[0].out
    for r in (1, 3):  # the others fail too instead of hanging, and name the missing rank
        assert done[r].returncode == 4 and "ranks [2] never joined" in done[r].out, done[r]


def _run_job(extra: dict[int, dict[str, str]] | None = None, duplicate: int | None = None,
             timeout: float = 30) -> tuple[dict[int, tuple[int, str]], tuple[int, str] | None]:
    """A 4-rank ring of 100 paced steps; ``extra`` env per rank; ``duplicate``: start that
    rank twice; every process must have ended within ``timeout`` seconds (no hang).
    Returns {rank: (exit code, stderr)} and the duplicate's (exit code, stderr)."""
    end = time.monotonic() + timeout
    job = Ranks(4)
    dup = None
    # Long enough (about 1 s) that a second process always finds the job still running.
    args = ("ring", "--steps", "100", "--pace", "0.01")
    try:
        for r in range(4):
            job.start(r, *args, prog=SCHEMEPROG, **(extra or {}).get(r, {}))
        if duplicate is not None:
            dup = subprocess.Popen([sys.executable, SCHEMEPROG, *args],
                                   env=job.env(duplicate, AIOREDUCE_TIMEOUT="10"),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        outs = {r: p.communicate(timeout=max(0.1, end - time.monotonic()))
                for r, p in job.procs.items()}
        dup_out = (dup.communicate(timeout=max(0.1, end - time.monotonic()))
                   if dup is not None else None)
    finally:
        job.kill()
        if dup is not None:
            dup.kill()
            dup.wait(5)
    got = {r: (job.procs[r].returncode, e) for r, (_o, e) in outs.items()}
    return got, (None if dup is None or dup_out is None else (dup.returncode, dup_out[1]))


def test_a_rank_started_twice_is_named_on_every_rank_every_time() -> None:
    # Caught while the job assembles, every rank stops naming it; caught later (the second
    # process started after the job had assembled), it is refused and every rank logs it.
    outcomes = set()
    for run in range(10):
        got, dup = _run_job(duplicate=2, timeout=20)  # no hang
        assert dup is not None
        # The two processes claiming rank 2 are alike: whichever came second is refused.
        pair = [got.pop(2), dup]
        refused = [p for p in pair if p[0] != 0 and "started twice" in p[1]]
        assert refused, (run, pair)
        kept = [p for p in pair if p not in refused[:1]]
        for rank, (_code, err) in got.items():
            assert "rank 2 was started twice" in err, (run, rank, err[-1500:])
        codes = {code for code, _err in [*got.values(), *kept]}
        assert len(codes) == 1, (run, got, kept)  # the same outcome on every other rank
        outcomes.add("stopped" if codes != {0} else "refused")
    print("outcomes:", outcomes)


def test_a_world_size_mismatch_is_named_on_every_rank() -> None:
    wrong = {"WORLD_SIZE": "5", "AIOREDUCE_WORLD_SIZE": "5"}
    got, _ = _run_job(extra={3: wrong})
    for rank, (code, err) in got.items():
        assert code != 0, rank
        assert "rank 3 believes the world size is 5, rank 0 believes 4" in err, (rank, err[-1500:])


def test_a_job_id_mismatch_is_named_on_every_rank() -> None:
    # Rank 3 has the job's secret but another job id (a stale AIOREDUCE_JOB on one host): it
    # is told which job this is at once, and rank 0 stops the job naming it on every rank.
    got, _ = _run_job(extra={3: {"AIOREDUCE_JOB": "yesterdays-job"}}, timeout=15)
    for rank, (code, err) in got.items():
        assert code != 0, rank
        assert "'yesterdays-job'" in err and "check AIOREDUCE_JOB" in err, (rank, err[-1500:])
    assert "rank 3 was started for job 'yesterdays-job'" in got[0][1]
    assert "serves job" in got[3][1]  # rank 3 learns the job id it should have had


def test_a_dial_that_tcp_connects_to_itself_counts_as_refused() -> None:
    """Nothing listens at a port of this host's ephemeral range, and the kernel gives the dial
    that very port as its own: TCP connects the socket to itself (simultaneous open), and the
    dialer would read its own hello. Forced here by dialing from the port it dials. The dial
    fails as a refused one (``PeerLost``, which the rendezvous retries), not as a handshake
    that a rank refused (``AuthError``, which ends it)."""
    import asyncio

    import aioreduce as ar
    from aioreduce.jobplan import free_port
    from aioreduce.transport import Mesh, MeshOptions

    port = free_port()

    async def main() -> str:
        loop = asyncio.get_running_loop()
        dial = loop.create_connection

        def from_the_same_port(factory, host, p, **kw):  # type: ignore[no-untyped-def]
            return dial(factory, host, p, local_addr=(host, p), **kw)

        loop.create_connection = from_the_same_port  # type: ignore[method-assign]
        mesh = Mesh(1, 2, b"k" * 32, "job", MeshOptions(local_unix=False, connect_timeout=5))
        try:
            await mesh.connect(0, ("127.0.0.1", port))
        except ar.PeerLost as exc:
            return str(exc)
        finally:
            await mesh.close()
        return "connected"

    assert "the dial connected to itself" in ar.run(main())


def _silent_listener() -> tuple[socket.socket, tuple[str, int]]:
    """A TCP port that accepts and never speaks: what a dead rank's old port may be now."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock, sock.getsockname()


async def _read_to_the_end(sock: socket.socket) -> bytes:
    """What the dialer sent before it hung up (each read bounded: never waits forever)."""
    loop, got = asyncio.get_running_loop(), b""
    sock.setblocking(False)
    while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 30):
        got += chunk
    return got


async def test_a_dial_answered_by_silence_is_a_lost_peer_not_a_refusal() -> None:
    """The port a dead rank listened on is taken by a listener that accepts and never
    answers (in CI: another process's listener). The dial fails as an unreachable
    peer (``PeerLost``: retried, healed), not as a refused handshake (``AuthError``: the job
    ends)."""
    import aioreduce as ar
    from aioreduce.transport import Mesh, MeshOptions

    silent, addr = _silent_listener()
    mesh = Mesh(1, 2, b"k" * 32, "job", MeshOptions(local_unix=False, handshake_timeout=0.2))
    try:
        with pytest.raises(ar.PeerLost, match="no handshake frame") as caught:
            await mesh.connect(0, addr)
        assert not isinstance(caught.value, ar.AuthError)
        accepted, _ = silent.accept()  # the dial reached it, said hello, and hung up
        assert await _read_to_the_end(accepted)
        accepted.close()
    finally:
        silent.close()
        await mesh.close()


async def test_a_dial_to_the_address_a_rank_left_fails_when_it_moves() -> None:
    """Rank 1 dials rank 0 where its dead process listened; a listener there never answers.
    Rank 0's replacement is announced meanwhile (``set_address``, as a Moved does): the dial
    fails at once as a lost peer, not after the handshake timeout (what it was for, the dead
    process's step, is lost with it), and hangs up; the next dial reaches the new process."""
    import aioreduce as ar
    from aioreduce.transport import Mesh, MeshOptions

    loop = asyncio.get_running_loop()
    silent, old = _silent_listener()
    opts = MeshOptions(local_unix=False, handshake_timeout=3600)  # only the move ends it
    zero, one = Mesh(0, 2, b"k" * 32, "job", opts), Mesh(1, 2, b"k" * 32, "job", opts)
    try:
        new = await zero.listen("127.0.0.1")
        one.addresses[0] = old
        dialing = asyncio.create_task(one.connect(0))
        accepted, _ = await asyncio.wait_for(loop.sock_accept(silent), 30)  # it is in there
        assert not dialing.done()
        one.set_address(0, new)
        with pytest.raises(ar.PeerLost, match=f"a new process of the rank listens at "
                                              f"127.0.0.1:{new[1]}"):
            await asyncio.wait_for(dialing, 30)
        assert await _read_to_the_end(accepted)  # a hello, then it hung up
        accepted.close()
        conn = await asyncio.wait_for(one.connect(0), 30)
        assert conn.transport is not None
        assert conn.transport.get_extra_info("peername")[1] == new[1]
        data = np.arange(1000, dtype=np.float64)
        await one.send(0, data, step=0)
        out = np.zeros_like(data)
        await asyncio.wait_for(zero.recv_into(1, out, step=0), 30)
        assert (out == data).all()
    finally:
        silent.close()
        await one.close()
        await zero.close()
