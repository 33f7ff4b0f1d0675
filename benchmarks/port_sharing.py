"""What a host's link delivers when several TCP streams share it, on the emulated cluster.

``python benchmarks/port_sharing.py [--mib N] [--link-mbit M]`` (root: it makes four network
namespaces on a bridge, shaped like the sweep's links, and removes them). Plain blocking
sockets, no aioreduce, so the figures belong to the emulated network alone. Host 0 receives
``N`` MiB from each of ``k`` peers; in the "both ways" rows it sends ``N`` MiB to each of them
at the same time, as a tree's parent or a gradient-coding master does. Each row prints the
throughput of host 0's ingress and egress as a fraction of the link rate.

This is the measurement behind the simulator's ``shared_port`` (:mod:`aioreduce.costmodel.engine`):
a lone stream each way gets nearly the whole link, and streams into one host only also do,
but several streams each way at once get a fifth to a third less, because every stream's
ACKs wait in the same shaped queues as the other direction's data. The simulator's fitted
value (``docs/sweep/sim.md``) is compared with this one in ``docs/sweep/README.md``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from aioreduce.bench.cluster import Cluster

PORT = "29778"

RECEIVE = r"""
import selectors, socket, sys, time
peers, nbytes = int(sys.argv[1]), int(sys.argv[2])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[3]))); srv.listen(64); print("ready", flush=True)
conns = [srv.accept()[0] for _ in range(peers)]
sel, buf = selectors.DefaultSelector(), bytearray(1 << 20)
for c in conns:
    sel.register(c, selectors.EVENT_READ)
left, start = {c: nbytes for c in conns}, None
while left:
    for key, _ in sel.select():
        n = key.fileobj.recv_into(buf)
        start = time.monotonic() if start is None else start
        left[key.fileobj] -= n
        if left[key.fileobj] <= 0:
            sel.unregister(key.fileobj); del left[key.fileobj]
print(start, time.monotonic(), flush=True)  # CLOCK_MONOTONIC: one clock for every namespace
"""

SEND = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[3])))
left, chunk = int(sys.argv[2]), bytes(1 << 20)
while left > 0:
    left -= s.send(chunk[:min(left, len(chunk))])
s.shutdown(socket.SHUT_WR); s.recv(1)
"""


def run_case(cluster: Cluster, peers: int, both_ways: bool, nbytes: int) -> tuple[float, float]:
    """Bytes/s into host 0 and out of it (0 when it sends nothing), each from the first byte
    received to the last."""
    py = sys.executable
    receivers = [(0, peers)] + ([(i, 1) for i in range(1, peers + 1)] if both_ways else [])
    procs = {h: subprocess.Popen(cluster.exec_argv(h, [py, "-c", RECEIVE, str(k), str(nbytes),
                                                       PORT]), stdout=subprocess.PIPE, text=True)
             for h, k in receivers}
    senders: list[subprocess.Popen[bytes]] = []
    try:
        for p in procs.values():
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        flows = [(i, 0) for i in range(1, peers + 1)]
        flows += [(0, i) for i in range(1, peers + 1)] if both_ways else []
        senders = [subprocess.Popen(cluster.exec_argv(src, [py, "-c", SEND, cluster.addr(dst),
                                                            str(nbytes), PORT]))
                   for src, dst in flows]
        spans = {}
        for h, p in procs.items():
            out, _ = p.communicate(timeout=300)
            start, end = (float(x) for x in out.split())
            spans[h] = (start, end)
        into = peers * nbytes / (spans[0][1] - spans[0][0])
        others = [spans[h] for h in spans if h != 0]
        out_rate = (peers * nbytes / (max(e for _, e in others) - min(s for s, _ in others))
                    if others else 0.0)
        return into, out_rate
    finally:
        for r in procs.values():
            r.kill()
            r.wait()
        for w in senders:
            w.kill()
            w.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB per stream")
    ap.add_argument("--link-mbit", type=float, default=1000.0)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each case")
    opts = ap.parse_args()
    rate = opts.link_mbit * 1e6 / 8
    print("| streams into host 0 | and out of it | ingress / link | egress / link |\n"
          "|---|---|---|---|")
    with Cluster(hosts=4, rate_mbit=opts.link_mbit) as cluster:
        for peers, both in ((1, False), (3, False), (1, True), (3, True)):
            runs = [run_case(cluster, peers, both, opts.mib << 20) for _ in range(opts.repeat)]
            into = ", ".join(f"{i / rate:.2f}" for i, _ in runs)
            egress = ", ".join(f"{o / rate:.2f}" for _, o in runs) if both else "-"
            print(f"| {peers} | {peers if both else 0} | {into} | {egress} |", flush=True)


if __name__ == "__main__":
    main()
