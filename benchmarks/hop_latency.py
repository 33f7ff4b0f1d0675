"""What one hop costs on the emulated cluster, next to 127.0.0.1: small-message round trips.

``python benchmarks/hop_latency.py [--rounds N] [--link-mbit M]`` (root: it makes two network
namespaces on a bridge, shaped like the sweep's links, and removes them). Prints the median
and p99 round trip of a 64-byte message over a plain TCP socket (TCP_NODELAY, one echo
process per side) between two emulated hosts and on loopback, and the one-way figure (half
the round trip). It is the latency the emulated links already have before any
``--latency`` is injected (see ``aioreduce.transport.inbox``): compare it with the hop of the
network you want to model.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

from aioreduce.bench.cluster import Cluster

ECHO = r"""
import socket, sys
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1); print("ready", flush=True)
conn, _ = srv.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (data := conn.recv(64)):
    conn.sendall(data)
"""

PING = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
msg, out = b"x" * 64, []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter(); s.sendall(msg); got = 0
    while got < 64:
        got += len(s.recv(64 - got))
    out.append(time.perf_counter() - t)
print(" ".join(f"{x:.9f}" for x in out))
"""


def round_trips(server: list[str], client: list[str], addr: str, rounds: int) -> list[float]:
    """Round trips (s) of ``rounds`` 64-byte echoes: echo started with ``server`` argv prefix,
    the pinger with ``client``."""
    port = "29777"
    echo = subprocess.Popen([*server, sys.executable, "-c", ECHO, addr, port],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
        out = subprocess.run([*client, sys.executable, "-c", PING, addr, port, str(rounds)],
                             check=True, capture_output=True, text=True, timeout=120).stdout
        return [float(x) for x in out.split()][rounds // 10:]  # the first tenth warms up
    finally:
        echo.kill()
        echo.wait()


def describe(name: str, rtts: list[float]) -> str:
    ordered = sorted(rtts)
    med, p99 = statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))]
    return (f"{name:<28} round trip median {med * 1e6:7.1f} us, p99 {p99 * 1e6:7.1f} us; "
            f"one way {med / 2 * 1e6:6.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--link-mbit", type=float, default=1000.0)
    opts = ap.parse_args()
    print(describe("127.0.0.1", round_trips([], [], "127.0.0.1", opts.rounds)))
    with Cluster(2, rate_mbit=opts.link_mbit) as cluster:
        rtts = round_trips(cluster.exec_argv(1, []), cluster.exec_argv(0, []), cluster.addr(1),
                           opts.rounds)
    print(describe(f"emulated hop, {opts.link_mbit:g} Mbit/s", rtts))


if __name__ == "__main__":
    main()
