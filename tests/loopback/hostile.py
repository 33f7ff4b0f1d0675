"""Hostile connections against a live job's listener (only 127.0.0.1, only ports we started).

Kinds: random bytes, crafted headers (too long, or with fields not allowed before
authentication, or a pathological dtype), truncated handshakes, wrong secrets, idle sockets.
Used by ``test_hostile.py``; run the long version as a script::

    python -m tests.loopback.hostile --connections 10000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import msgpack
import psutil

from aioreduce.wire import FrameDecoder, Header, Kind, encode_frame
from aioreduce.wire.frame import MAGIC, PREFIX, VERSION
from aioreduce.wire.handshake import ConnectorHandshake

from .harness import SCHEMEPROG, Ranks

KINDS = ("random", "long-header", "dtype-header", "truncated", "wrong-secret", "idle")


def _bytes(header: Header) -> bytes:
    return b"".join(bytes(b) for b in encode_frame(header))


def _crafted(body: dict, declared: int | None = None) -> bytes:
    head = msgpack.packb(body, use_bin_type=True)
    return PREFIX.pack(MAGIC, VERSION, 0, declared or len(head), 0) + head


def hostile_connection(port: int, kind: str, rng: random.Random, job: str) -> None:
    """One hostile connection of ``kind``; returns when the listener dropped it or we gave up."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        if kind == "random":
            sock.sendall(rng.randbytes(rng.randint(1, 4096)))
        elif kind == "long-header":  # 64 KiB header with a pathological dtype, as measured
            body = {"kind": 1, "step": 0, "tag": 0, "src": 0, "dtype": "(" * 60000 + "i4",
                    "shape": [1]}
            sock.sendall(_crafted(body))
        elif kind == "dtype-header":
            sock.sendall(_crafted({"kind": 1, "step": 0, "tag": 0, "src": 0,
                                   "dtype": "(-1,)i4", "shape": [1]}))
        elif kind == "truncated":
            hello = ConnectorHandshake(b"x", job, 1, 0).start()
            sock.sendall(_bytes(hello)[: rng.randint(1, 40)])
        elif kind == "wrong-secret":
            hs = ConnectorHandshake(rng.randbytes(16), job, 1, 0)
            sock.sendall(_bytes(hs.start()))
            dec = FrameDecoder(lambda h: None, 0, authenticated=False)
            with contextlib.suppress(Exception):
                while not dec.receive_data(sock.recv(4096)):
                    pass
                sock.sendall(_bytes(Header(Kind.AUTH, src=1, meta={"proof": b"\0" * 32})))
        # "idle": connect and say nothing
        with contextlib.suppress(OSError):
            sock.settimeout(0.1)
            sock.recv(1)  # until the listener drops us (or a tenth of a second)


@dataclass
class Flood:
    port: int
    job: str
    seed: int = 0
    done: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def run(self, connections: int, threads: int = 16) -> None:
        lock = threading.Lock()

        def worker(w: int) -> None:
            rng = random.Random(self.seed * 1000 + w)
            while True:
                with lock:
                    if self.done >= connections:
                        return
                    self.done += 1
                kind = KINDS[rng.randrange(len(KINDS))]
                try:
                    hostile_connection(self.port, kind, rng, self.job)
                except OSError as exc:
                    with lock:
                        self.errors[type(exc).__name__] = self.errors.get(
                            type(exc).__name__, 0) + 1

        pool = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()


def read_ranks(job: Ranks, *tags: str) -> tuple[dict[int, list[dict]], dict[int, list[str]],
                                                 dict[str, list[dict]], list[threading.Thread]]:
    """Read every rank's output in threads as it comes (a full pipe never blocks a rank):
    the ``STEP {...}`` lines per rank, stderr lines per rank, ``TAG {...}`` lines by tag."""
    n = len(job.procs)
    lines: dict[int, list[dict]] = {r: [] for r in range(n)}
    errs: dict[int, list[str]] = {r: [] for r in range(n)}
    tagged: dict[str, list[dict]] = {t: [] for t in tags}

    def read(rank: int) -> None:
        for line in job.procs[rank].stdout:  # type: ignore[union-attr]
            tag, _, rest = line.partition(" ")
            if tag == "STEP":
                lines[rank].append(json.loads(rest))
            elif tag in tagged:
                tagged[tag].append(json.loads(rest))

    def read_err(rank: int) -> None:
        for line in job.procs[rank].stderr:  # type: ignore[union-attr]
            errs[rank].append(line)

    readers = [threading.Thread(target=f, args=(r,), daemon=True)
               for r in range(n) for f in (read, read_err)]
    for t in readers:
        t.start()
    return lines, errs, tagged, readers


def ring_under_flood(connections: int, steps: int = 3000, pace: float = 0.005) -> dict:
    """A 4-rank ring doing exact steps while rank 0's listener is flooded."""
    job = Ranks(4)
    job.start_all("ring", "--steps", str(steps), "--pace", str(pace), "--dim", "1000",
                  prog=SCHEMEPROG)
    lines, errs, _tagged, readers = read_ranks(job)
    try:
        end = time.monotonic() + 60
        while len(lines[0]) < 20 and time.monotonic() < end:
            time.sleep(0.02)  # polling the ranks' progress
        rank0 = psutil.Process(job.procs[0].pid)
        rss0 = rank0.memory_info().rss
        env0 = job.specs[0].env
        flood = Flood(int(env0["AIOREDUCE_MASTER_PORT"]), env0["AIOREDUCE_JOB"])
        t0 = time.monotonic()
        flood.run(connections)
        flood_s = time.monotonic() - t0
        rss1 = rank0.memory_info().rss
        steps_during = len(lines[0])
        codes = {r: p.wait(steps * pace * 4 + 60) for r, p in job.procs.items()}
        for t in readers:
            t.join(5)
    finally:
        job.kill()
    wrong = sum(1 for r in range(4) for s in lines[r]
                if "error" in s or s["rel_err"] >= 1e-9)
    return {"connections": flood.done, "flood_seconds": round(flood_s, 2),
            "client_errors": flood.errors, "codes": codes, "wrong": wrong,
            "steps": {r: len(lines[r]) for r in range(4)}, "steps_when_flood_ended":
            steps_during, "rss_growth_mib": round((rss1 - rss0) / 2**20, 1),
            "tracebacks": sum("Traceback" in line for e in errs.values() for line in e),
            "log_lines_rank0": len(errs[0])}


def crafted_slowdown(rate: float = 4.0, seconds: float = 8.0) -> dict:
    """Step median of a 4-rank ring without, then with, crafted 64 KiB headers arriving at
    ``rate`` connections per second (one run, so the ratio compares like with like)."""
    job = Ranks(4)
    job.start_all("ring", "--steps", "100000", "--dim", "1000", prog=SCHEMEPROG)
    times: list[tuple[float, float]] = []  # (end wall time, step seconds) of rank 0

    def read() -> None:
        for line in job.procs[0].stdout:  # type: ignore[union-attr]
            if line.startswith("STEP "):
                s = json.loads(line[5:])
                times.append((s["t1"], s["t1"] - s["t0"]))

    def drain(pipe) -> None:  # type: ignore[no-untyped-def]
        for _line in pipe:  # every pipe is read, so no rank ever blocks on a full one
            pass

    pipes = [p.stderr for p in job.procs.values()] + [job.procs[r].stdout for r in (1, 2, 3)]
    for t in [threading.Thread(target=read, daemon=True)] + [
            threading.Thread(target=drain, args=(pipe,), daemon=True) for pipe in pipes]:
        t.start()
    port = int(job.specs[0].env["AIOREDUCE_MASTER_PORT"])
    rng = random.Random(0)
    try:
        while len(times) < 50:
            time.sleep(0.05)  # polling rank 0's progress
        quiet0 = time.time()
        time.sleep(seconds)  # the quiet phase
        attack0 = time.time()
        while time.time() < attack0 + seconds:
            threading.Thread(target=hostile_connection, args=(port, "long-header", rng, "j"),
                             daemon=True).start()
            time.sleep(1 / rate)  # the attack's pace
        attack1 = time.time()
    finally:
        job.kill()
    quiet = [d for t, d in times if quiet0 <= t < attack0]
    attacked = [d for t, d in times if attack0 <= t < attack1]
    q, a = statistics.median(quiet), statistics.median(attacked)
    return {"rate_per_s": rate, "quiet_median_ms": round(q * 1e3, 2),
            "attacked_median_ms": round(a * 1e3, 2), "slowdown": round(a / q, 2),
            "steps": [len(quiet), len(attacked)]}


def insider_flood(kind: str, steps: int = 300, flood_step: int = 30) -> dict:
    """An authenticated rank (leaf 5 of a 13-rank coded tree) floods its parent (rank 1) with
    ``kind`` frames mid-run. Returns the parent's peak RSS growth while it happens, whether it
    closed that connection naming rank 5, and the other ranks' wrong results."""
    job = Ranks(13)
    job.start_all("coded-tree", "--steps", str(steps), "--pace", "0.01", "--dim", "1000",
                  "--flood", kind, "--flood-rank", "5", "--flood-to", "1",
                  "--die-step", str(flood_step), prog=SCHEMEPROG)
    lines, errs, tagged, readers = read_ranks(job, "FLOOD")
    flood = tagged["FLOOD"]
    try:
        end = time.monotonic() + 120
        while len(lines[1]) < flood_step - 5 and time.monotonic() < end:
            time.sleep(0.01)  # polling rank 1's progress
        target = psutil.Process(job.procs[1].pid)
        base = peak = target.memory_info().rss
        while not flood and time.monotonic() < end:
            peak = max(peak, target.memory_info().rss)
            time.sleep(0.002)  # sampling the parent's memory while the flood lasts
        codes = {r: p.wait(steps * 0.05 + 120) for r, p in job.procs.items()}
        for t in readers:
            t.join(5)
    finally:
        job.kill()
    others = [r for r in range(13) if r != 5]
    wrong = sum(1 for r in others for s in lines[r] if "error" in s or s["rel_err"] >= 1e-9)
    closed = [line.strip()[-200:] for line in errs[1] if "protocol error from rank 5" in line]
    other_closed = [f"rank {r}: {line.strip()[-200:]}" for r in range(13) for line in errs[r]
                    if "protocol error" in line and "from rank 5" not in line]
    return {"kind": kind, "flood": flood[0] if flood else None, "codes": codes,
            "wrong": wrong, "steps": {r: len(lines[r]) for r in others},
            "peak_growth_mib": round((peak - base) / 2**20, 1), "closed": closed[:1],
            "error_samples": sorted({f"rank {r}: {s.get('message', '')[:120]}" for r in others
                                     for s in lines[r] if "error" in s})[:5],
            "other_closed": other_closed[:5],
            "log_samples": [f"rank {r}: {line.strip()[-200:]}" for r in others
                            for line in errs[r] if "protocol error from rank 5" not in line
                            and "is not reading" not in line][:12]}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=10000)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--crafted-rate", type=float, default=0.0,
                    help="instead: the step slowdown under crafted headers at this rate")
    ap.add_argument("--insider", choices=["ahead", "early", "tiny", "control", "all"],
                    help="instead: an authenticated rank floods its parent with these frames")
    a = ap.parse_args(argv)
    if a.insider:
        kinds = ["ahead", "early", "tiny", "control"] if a.insider == "all" else [a.insider]
        reps = [insider_flood(k) for k in kinds]
        for rep in reps:
            print(json.dumps(rep))
        return 0 if all(r["wrong"] == 0 and r["closed"] for r in reps) else 1
    if a.crafted_rate:
        rep = crafted_slowdown(a.crafted_rate)
        print(json.dumps(rep))
        return 0 if rep["slowdown"] <= 2.0 else 1
    rep = ring_under_flood(a.connections, a.steps)
    print(json.dumps(rep, indent=1))
    ok = (rep["wrong"] == 0 and set(rep["codes"].values()) == {0}
          and rep["rss_growth_mib"] <= 50 and rep["tracebacks"] == 0)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
