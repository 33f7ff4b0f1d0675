"""Other tenants' traffic on the emulated cluster's links: bulk TCP flows, steady or in bursts.

A steady flow fills its links' queues and keeps them full: every step over those links is
slow by the same amount, which is a slower link, not a tail. Cloud neighbours come and go:
``Bursts`` sends for an exponentially distributed time, then pauses for one (seeded, so two
runs put the same bursts on the same flow), which gives the network's own tail.

Run inside an emulated host (see :meth:`aioreduce.bench.cluster.Cluster.background`)::

    python -m aioreduce.bench.flows sink ADDR PORT
    python -m aioreduce.bench.flows source ADDR PORT [--on S --off S --seed K] [--bursts N]
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

CHUNK = 1 << 20  # bytes a source hands the kernel per call, and a sink reads


@dataclass(frozen=True)
class Bursts:
    """A flow that sends for ``on`` seconds, then pauses for ``off``, both exponentially
    distributed about those means; ``on <= 0``: steady (sends all the time)."""

    on: float = 0.0
    off: float = 0.0

    def __post_init__(self) -> None:
        if self.on > 0 and self.off <= 0:
            raise ValueError("a flow in bursts needs a pause: off > 0")
        if self.on < 0 or self.off < 0:
            raise ValueError("on and off are mean durations: >= 0")

    @property
    def steady(self) -> bool:
        return self.on <= 0

    def schedule(self, seed: int) -> Iterator[tuple[float, float]]:
        """The (send, pause) durations of one flow, burst after burst, forever."""
        rng = random.Random(seed)
        while True:
            yield rng.expovariate(1 / self.on), rng.expovariate(1 / self.off)

    @classmethod
    def parse(cls, text: str) -> Bursts:
        """``"ON,OFF"`` (mean seconds) as the bench's ``--background-burst`` takes it."""
        try:
            on, off = (float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"bursts are 'ON,OFF' in seconds (e.g. 0.1,0.4), not {text!r}"
                             ) from None
        if on <= 0:
            raise ValueError("a burst lasts some time: ON > 0")
        return cls(on, off)


def source(addr: str, port: int, bursts: Bursts, seed: int = 0,
           limit: int | None = None) -> list[int]:
    """Send to ``addr:port`` as ``bursts`` says until the peer goes (the cluster's teardown)
    or, given ``limit``, for that many bursts (steady: that many chunks); returns the bytes
    of each burst sent."""
    conn = socket.create_connection((addr, port))
    payload = bytes(CHUNK)
    sent: list[int] = []
    try:
        if bursts.steady:  # one burst that never ends (given a limit: that many chunks)
            sent.append(0)
            while limit is None or sent[0] < limit * CHUNK:
                conn.sendall(payload)
                sent[0] += CHUNK
            return sent
        for on, off in bursts.schedule(seed):
            if limit is not None and len(sent) >= limit:
                break
            # Timed as handed to the kernel: on the wire a burst goes on until the socket's
            # buffer has drained into the link, and its pause is that much shorter.
            until, n = time.monotonic() + on, 0
            while True:  # at least one chunk a burst, however short it was drawn
                conn.sendall(payload)
                n += CHUNK
                if time.monotonic() >= until:
                    break
            sent.append(n)
            time.sleep(off)
    except OSError:  # the sink went with the cluster: the end, not an error
        pass
    finally:
        conn.close()
    return sent


def sink(addr: str, port: int, ready: bool = True) -> int:
    """Accept one flow on ``addr:port`` and read it to its end; returns the bytes read. With
    ``ready``, says so on stdout once it listens, and on which port (the cluster waits for
    that line)."""
    server = socket.create_server((addr, port))
    if ready:  # (with its port: 0 asks for any free one)
        print(f"ready {server.getsockname()[1]}", flush=True)
    conn, _ = server.accept()
    server.close()
    buf = bytearray(CHUNK)
    total = 0
    try:
        while n := conn.recv_into(buf):
            total += n
    except OSError:
        pass
    finally:
        conn.close()
    return total


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aioreduce.bench.flows", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", choices=["source", "sink"])
    ap.add_argument("addr")
    ap.add_argument("port", type=int)
    ap.add_argument("--on", type=float, default=0.0, help="mean burst, seconds (0: steady)")
    ap.add_argument("--off", type=float, default=0.0, help="mean pause, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bursts", type=int, default=None,
                    help="stop after this many bursts (tests); default: until torn down")
    a = ap.parse_args(argv)
    if a.role == "sink":
        print(f"received {sink(a.addr, a.port)}", flush=True)
    else:
        sent = source(a.addr, a.port, Bursts(a.on, a.off), a.seed, a.bursts)
        print("sent " + " ".join(map(str, sent)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
