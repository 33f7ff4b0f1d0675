"""Hostile networks: anyone who can reach a port costs a node almost nothing before proving the
secret. Live jobs on 127.0.0.1 only; every process started here is killed at the end."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from aioreduce.transport import PeerBudget

from .harness import SCHEMEPROG, Ranks
from .hostile import insider_flood, ring_under_flood

pytestmark = pytest.mark.loopback


def test_hostile_flood_against_a_live_ring_changes_nothing() -> None:
    # 1000 steps: the flood of 1500 connections ends after about 300 here (3 s), and the ring
    # runs on past it for the rest.
    rep = ring_under_flood(1500, steps=1000)
    assert rep["steps_when_flood_ended"] < 1000, rep  # the flood hit a running job
    assert set(rep["codes"].values()) == {0}, rep
    assert rep["wrong"] == 0 and rep["tracebacks"] == 0, rep
    assert rep["rss_growth_mib"] <= 50, rep
    assert rep["log_lines_rank0"] <= 100, rep  # refusals are logged, not a log flood


def test_idle_connections_and_1024_fds_a_correct_peer_still_joins() -> None:
    held_n = 1100
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < held_n + 200:
        pytest.skip(f"this test needs {held_n + 200} descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, held_n + 200), hard))
    job = Ranks(2)
    port = int(job.specs[0].env["AIOREDUCE_MASTER_PORT"])

    def limit() -> None:  # rank 0 as under `ulimit -n 1024`
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    args = [sys.executable, SCHEMEPROG, "ring", "--steps", "20"]
    procs = {0: subprocess.Popen(args, env=job.env(0), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True,
                                 preexec_fn=limit)}
    job.procs = procs  # type: ignore[assignment]
    held: list[socket.socket] = []
    try:
        end = time.monotonic() + 30
        while True:
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                break
            except ConnectionRefusedError:
                assert time.monotonic() < end, "rank 0 never listened"
                time.sleep(0.05)  # waiting for rank 0 to start listening
        rss0 = psutil.Process(procs[0].pid).memory_info().rss
        for _ in range(held_n - 1):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        rss1 = psutil.Process(procs[0].pid).memory_info().rss
        procs[1] = job.start(1, "ring", "--steps", "20", prog=SCHEMEPROG)
        outs = {r: p.communicate(timeout=120) for r, p in procs.items()}
    finally:
        for s in held:
            s.close()
        job.kill()
    for rank, (out, err) in outs.items():
        assert procs[rank].returncode == 0, (rank, err[-3000:])
        got = [json.loads(x[5:]) for x in out.splitlines() if x.startswith("STEP ")]
        assert len(got) == 20 and all(s["rel_err"] < 1e-9 for s in got), (rank, got[-1:])
    assert (rss1 - rss0) / 2**20 <= 100, (rss0, rss1)
    assert "Too many open files" not in outs[0][1]


def _closed(sock: socket.socket, wait: float) -> bool:
    """Whether the node closed ``sock`` (seen within ``wait`` seconds)."""
    sock.settimeout(wait)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@contextlib.contextmanager
def _listener(bind: str) -> Iterator[tuple[int, list[socket.socket]]]:
    """A node's listener alone (a per-host cap of 4) in a process of its own: its port, and a
    list for the test's sockets; both the sockets and the process go when the test ends."""
    script = (
        "import asyncio, sys, aioreduce as ar\n"
        "from aioreduce.transport import Mesh, MeshOptions\n"
        "async def main():\n"
        "    m = Mesh(0, 2, b's', 'j', MeshOptions(max_unauthenticated_per_host=4))\n"
        "    host, port = await m.listen(sys.argv[1], 0)\n"
        "    print(port, flush=True)\n"
        "    await asyncio.sleep(30)\n"
        "ar.run(main())\n")
    proc = subprocess.Popen([sys.executable, "-c", script, bind], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline()), socks
    finally:
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()
        proc.kill()
        proc.wait(5)


def test_dropped_idle_connections_are_the_oldest() -> None:
    # Unit-level check of the cap through a real listener: hold more than the per-host cap and
    # see the oldest ones closed by the node while the newest stay open.
    with _listener("127.0.0.1") as (port, socks):
        for _ in range(10):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            time.sleep(0.05)  # a distinct arrival order for each connection
        closed = [_closed(s, 2 if i == 0 else 0.2) for i, s in enumerate(socks)]
        assert closed == [True] * 6 + [False] * 4, closed


def test_the_per_host_cap_counts_each_connection_against_its_own_host() -> None:
    # One connection from 127.0.0.2, then more than the per-host cap from 127.0.0.1: only
    # 127.0.0.1's oldest are dropped. (The cap once counted connections before their address
    # was known, all against one host "?", and evicted correct ranks of 40-rank jobs.)
    with _listener("0.0.0.0") as (port, socks):
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=5,
                                              source_address=("127.0.0.2", 0)))
        for _ in range(6):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        closed = [_closed(s, 0.5) for s in socks]
        assert closed == [False] + [True] * 2 + [False] * 4, closed


BUDGET_MIB = PeerBudget().staged_bytes / 2**20
STEPS = 100  # the flood comes at step 30; the tree goes on without the flooder after it


@pytest.mark.parametrize("kind, reason, peak_mib", [
    ("ahead", "more than 65536 steps ahead", 50),
    ("early", "more early data than its budget", BUDGET_MIB + 64),
    ("tiny", "frames nobody has asked for", 100),
    ("control", "control messages nobody has read", 50),
])
def test_an_authenticated_flood_costs_at_most_the_peer_budget(kind: str, reason: str,
                                                               peak_mib: float) -> None:
    # Leaf 5 of a 13-rank coded tree (it has the secret) floods its parent, rank 1: the
    # parent closes that one connection naming rank 5 and why, its memory stays within the
    # peer budget, and every other rank's results stay exact (the tree does without 5).
    rep = insider_flood(kind, steps=STEPS)
    flood = rep["flood"]
    assert flood is not None, rep
    assert flood["sent"] < flood["of"] or kind == "ahead", rep  # cut off (16 small ones fit)
    assert rep["closed"] and reason in rep["closed"][0], rep
    assert rep["wrong"] == 0 and rep["other_closed"] == [], rep
    assert all(n == STEPS for n in rep["steps"].values()), rep
    assert rep["peak_growth_mib"] <= peak_mib, rep


def test_a_correct_peer_joins_through_idle_connections_from_its_own_address() -> None:
    # 5000 idle connections from 127.0.0.1, the address rank 1 dials from too, arrive at rank
    # 0 while rank 1 joins: the per-host cap evicts the least advanced handshakes first, so
    # the flood pushes out only itself, never the rank that has sent its first frame.
    import threading
    from collections import deque

    job = Ranks(2)
    port = int(job.specs[0].env["AIOREDUCE_MASTER_PORT"])
    args = ("ring", "--steps", "20")
    job.start(0, *args, prog=SCHEMEPROG)
    opened = [0]
    stop = threading.Event()
    listening = threading.Event()

    def flood() -> None:
        window: deque[socket.socket] = deque()
        while opened[0] < 5000 and not stop.is_set():
            try:
                window.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                if not listening.is_set():
                    time.sleep(0.05)  # rank 0 is not listening yet
                continue
            listening.set()
            opened[0] += 1
            if len(window) > 200:  # our own descriptors stay bounded
                window.popleft().close()
        for s in window:
            s.close()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        assert listening.wait(30), "rank 0 never listened"
        while opened[0] < 500:  # the flood is well under way before rank 1 dials
            time.sleep(0.01)
        job.start(1, *args, prog=SCHEMEPROG)
        done = job.wait(120)
        joined_during = opened[0] < 5000
    finally:
        stop.set()
        flooder.join(30)
        job.kill()
    assert joined_during, "the flood was over before the job was"
    for rank, d in done.items():
        assert d.returncode == 0, (rank, d.err[-3000:])
        got = [json.loads(x[5:]) for x in d.out.splitlines() if x.startswith("STEP ")]
        assert len(got) == 20 and all(s["rel_err"] < 1e-9 for s in got), (rank, got[-1:])


def test_a_connection_that_sent_its_hello_outlives_idle_ones() -> None:
    # The mechanism behind the test above, through a real listener with a per-host cap of 4:
    # the oldest connection has sent a valid HELLO (and got its CHALLENGE) and then waits;
    # six idle connections from the same address come after it. Evictions take the idle
    # ones, oldest first; the one in its handshake stays (it was the first evicted before).
    from aioreduce.wire import encode_frame
    from aioreduce.wire.handshake import ConnectorHandshake

    with _listener("127.0.0.1") as (port, socks):
        hello = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(hello)
        hello.sendall(b"".join(bytes(b) for b in
                               encode_frame(ConnectorHandshake(b"s", "j", 1, 0).start())))
        hello.settimeout(5)
        assert hello.recv(1)  # its CHALLENGE: the listener has read the HELLO
        for _ in range(6):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            time.sleep(0.05)  # a distinct arrival order for each connection
        closed = [_closed(s, 0.5) for s in socks]
        assert closed == [False] + [True] * 3 + [False] * 3, closed
