"""How much a rank's CPU depends on how many threads move its lanes' bytes: the transpose's
traffic (every rank sends a 4 MiB slice to each peer and receives one from each, twice a
step) between real processes over Unix socket pairs, moved either by a thread per lane and
direction (our LaneLinks: 2(N-1) threads besides the rank's main one) or by one I/O thread
that polls every lane (non-blocking sends and receives), the main thread summing what came
as the transpose's does; and, for scale, the ring's traffic (the same bytes per rank, to one
neighbour, in 2(N-1) slices). The three run in one invocation, alternated, and it prints
each one's wall time and CPU (getrusage, every thread) per rank per step and the ratios.

It answers one question before anyone rewrites LaneLinks: on a host whose ranks share
cores, is the calm transpose's extra CPU against the ring (docs/transpose.md, "Where the
rest goes": futex and Python of seven threads per rank) the threads' own doing?

    python benchmarks/lane_threads.py [--ranks 4] [--mib 16] [--steps 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import faulthandler
import multiprocessing as mp
import queue
import select
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from aioreduce.bench.allreduce import cpu_seconds
from aioreduce.transport.sockopts import UNIX_SNDBUF
from aioreduce.wire import byte_view

RANK_LIMIT_S = 540.0  # within run()'s 600 s wait for the reports


class _Threads:
    """A sender and a reader thread per peer; a step's stage hands each sender its slice
    and waits for each reader's (the LaneLinks way, without its bookkeeping)."""

    def __init__(self, outs: dict[int, socket.socket], ins: dict[int, socket.socket]) -> None:
        self.sendq: dict[int, queue.SimpleQueue[memoryview | None]] = {}
        self.done: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.sent: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.unsent = 0
        self.into: dict[int, queue.SimpleQueue[memoryview | None]] = {}
        for peer, sock in outs.items():
            q: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
            self.sendq[peer] = q
            threading.Thread(target=self._send, args=(sock, q, self.sent), daemon=True).start()
        for peer, sock in ins.items():
            r: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
            self.into[peer] = r
            threading.Thread(target=self._read, args=(peer, sock, r), daemon=True).start()

    @staticmethod
    def _send(sock: socket.socket, q: queue.SimpleQueue[memoryview | None],
              sent: queue.SimpleQueue[None]) -> None:
        while (view := q.get()) is not None:
            sock.sendall(view)
            sent.put(None)

    def _read(self, peer: int, sock: socket.socket,
              q: queue.SimpleQueue[memoryview | None]) -> None:
        while (view := q.get()) is not None:
            got = 0
            while got < view.nbytes:  # chunk by chunk, as LaneLinks._fill (poll, then read)
                select.select([sock], [], [])
                got += sock.recv_into(view[got:], view.nbytes - got, socket.MSG_DONTWAIT)
            self.done.put(peer)

    def stage(self, sends: dict[int, memoryview], recvs: dict[int, memoryview],
              on_arrival: Callable[[int], None]) -> None:
        for peer, view in recvs.items():
            self.into[peer].put(view)
        for peer, view in sends.items():
            self.sendq[peer].put(view)
        self.unsent += len(sends)
        for _ in recvs:
            on_arrival(self.done.get())

    def flush(self) -> None:
        """Wait until every slice handed to the senders is sent (its buffer may change)."""
        for _ in range(self.unsent):
            self.sent.get()
        self.unsent = 0


@dataclass
class _Move:
    """One slice a stage moves over one lane: ``op`` (the socket's send or recv_into) until
    ``view`` is through; an arrival (``peer`` set) is handed to the main thread then."""

    op: Callable[[memoryview], int]
    view: memoryview
    peer: int | None
    done: int = 0


class _OneThread:
    """One I/O thread polls every lane: non-blocking sends and receives of a stage's
    slices, each arrival handed to the main thread."""

    def __init__(self, outs: dict[int, socket.socket], ins: dict[int, socket.socket]) -> None:
        for sock in (*outs.values(), *ins.values()):
            sock.setblocking(False)
        self.outs, self.ins = outs, ins
        self.jobs: queue.SimpleQueue[tuple[dict[int, memoryview], dict[int, memoryview]]
                                     | None] = queue.SimpleQueue()
        self.done: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.finished: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.unfinished = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        poller = select.poll()
        while (job := self.jobs.get()) is not None:
            sends, recvs = job
            moves: dict[int, _Move] = {}
            for peer, view in sends.items():
                sock = self.outs[peer]
                moves[sock.fileno()] = _Move(sock.send, view, None)
                poller.register(sock, select.POLLOUT)
            for peer, view in recvs.items():
                sock = self.ins[peer]
                moves[sock.fileno()] = _Move(sock.recv_into, view, peer)
                poller.register(sock, select.POLLIN)
            while moves:
                for fd, _ev in poller.poll():
                    move = moves[fd]
                    try:
                        move.done += move.op(move.view[move.done:])
                    except BlockingIOError:
                        continue
                    if move.done == move.view.nbytes:
                        poller.unregister(fd)
                        del moves[fd]
                        if move.peer is not None:
                            self.done.put(move.peer)
            self.finished.put(None)

    def stage(self, sends: dict[int, memoryview], recvs: dict[int, memoryview],
              on_arrival: Callable[[int], None]) -> None:
        self.jobs.put((sends, recvs))
        self.unfinished += 1
        for _ in recvs:
            on_arrival(self.done.get())

    def flush(self) -> None:
        """Wait until every stage's slices are sent (their buffers may change)."""
        for _ in range(self.unfinished):
            self.finished.get()
        self.unfinished = 0


def _ring_steps(rank: int, n: int, nbytes: int, steps: int, out: socket.socket,
                into: socket.socket) -> bool:
    """The ring's traffic for comparison: 2(N-1) slices of the same size to the next rank
    (a sender thread, waited for at the step's end) and from the previous one (read by the
    main thread, in order, as the ring's own thread reads), the first N-1 summed; whether
    the last step's sum is exact."""
    sendq: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
    sent: queue.SimpleQueue[None] = queue.SimpleQueue()
    threading.Thread(target=_Threads._send, args=(out, sendq, sent), daemon=True).start()
    vec = np.ones(n * nbytes // 4, np.float32)
    chunks = [vec[c * nbytes // 4:(c + 1) * nbytes // 4] for c in range(n)]
    scratch = np.empty(nbytes // 4, np.float32)
    for _ in range(steps):
        vec[:] = 1.0  # this step's vector (the bench's refill)
        for r in range(2 * (n - 1)):
            send_c = (rank - r) % n
            recv_c = (rank - r - 1) % n
            sendq.put(byte_view(chunks[send_c]))
            target = scratch if r < n - 1 else chunks[recv_c]
            view = byte_view(target)
            got = 0
            while got < view.nbytes:
                got += into.recv_into(view[got:], view.nbytes - got, socket.MSG_WAITALL)
            if r < n - 1:
                chunks[recv_c] += scratch
        for _ in range(2 * (n - 1)):  # every slice sent before the vector changes
            sent.get()
    return bool(np.all(vec == n))


def _transpose_steps(rank: int, n: int, way: str, nbytes: int, steps: int,
                     outs: dict[int, socket.socket], ins: dict[int, socket.socket]) -> bool:
    """The transpose's traffic, moved ``way``; whether the last step's sum is exact."""
    mover = (_Threads if way == "threads" else _OneThread)(outs, ins)
    peers = [p for p in range(n) if p != rank]
    vec = np.ones(n * nbytes // 4, np.float32)
    shards = {p: byte_view(vec[p * nbytes // 4:(p + 1) * nbytes // 4]) for p in range(n)}
    scratch = {p: np.empty(nbytes // 4, np.float32) for p in peers}
    mine = vec[rank * nbytes // 4:(rank + 1) * nbytes // 4]

    def add(src: int) -> None:
        mine.__iadd__(scratch[src])

    for _ in range(steps):
        vec[:] = 1.0  # this step's vector (the bench's refill)
        # Stage 1: our copy of each peer's shard to it; each peer's copy of ours, summed.
        mover.stage({p: shards[p] for p in peers},
                    {p: byte_view(scratch[p]) for p in peers}, add)
        # Stage 2: our reduced shard to every peer; their reduced shards into the vector.
        mover.stage({p: shards[rank] for p in peers}, {p: shards[p] for p in peers},
                    lambda _src: None)
        # Our reduced shard may still be going to a slow peer: sent before it changes (the
        # transpose copies it out instead; a refill written over it could spoil the sums).
        mover.flush()
    return bool(np.all(vec == n))


def _rank(rank: int, n: int, way: str, nbytes: int, steps: int,
          outs: dict[int, socket.socket], ins: dict[int, socket.socket],
          start: threading.Barrier, results: mp.Queue) -> None:  # type: ignore[type-arg]
    # A rank stuck this long prints every thread's stack on its stderr and exits (then the
    # launch names it): one launch of stop 87 hung with nothing to show why.
    faulthandler.dump_traceback_later(RANK_LIMIT_S, exit=True)
    start.wait()
    t0, c0 = time.perf_counter(), cpu_seconds()
    if way == "ring":
        exact = _ring_steps(rank, n, nbytes, steps, outs[(rank + 1) % n], ins[(rank - 1) % n])
    else:
        exact = _transpose_steps(rank, n, way, nbytes, steps, outs, ins)
    results.put((way, rank, (time.perf_counter() - t0) / max(steps, 1),
                 (cpu_seconds() - c0) / max(steps, 1), exact))
    faulthandler.cancel_dump_traceback_later()


def run(way: str, n: int, nbytes: int, steps: int) -> tuple[float, float]:
    """One launch of ``n`` ranks moving their lanes ``way`` (``threads``, ``one`` or
    ``ring``): (median rank's wall seconds, mean CPU seconds) per step. Raises if a rank's
    last sum was not exact (the bytes went astray)."""
    ctx = mp.get_context("fork")
    pairs = {(a, b): socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
             for a in range(n) for b in range(n) if a != b}  # a -> b
    for w, _r in pairs.values():
        w.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)  # as the lanes
    start = ctx.Barrier(n)  # (the type of a threading.Barrier, across processes)
    results: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = []
    for rank in range(n):
        outs = {b: pairs[(rank, b)][0] for b in range(n) if b != rank}
        ins = {a: pairs[(a, rank)][1] for a in range(n) if a != rank}
        p = ctx.Process(target=_rank, args=(rank, n, way, nbytes, steps, outs, ins, start,
                                            results), daemon=True)
        p.start()
        procs.append(p)
    try:
        got = _collect(results, procs, way, timeout=600)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():  # (stuck: nothing of this launch outlives it)
                p.kill()
                p.join()
        for a, b in pairs.values():
            a.close()
            b.close()
    wrong = sorted(g[1] for g in got if not g[4])
    if wrong:
        raise RuntimeError(f"{way}: ranks {wrong} ended with a wrong sum")
    return (statistics.median(g[2] for g in got), statistics.fmean(g[3] for g in got))


def _collect(results: mp.Queue, procs: Sequence[mp.process.BaseProcess],  # type: ignore[type-arg]
             way: str, timeout: float) -> list[tuple[str, int, float, float, bool]]:
    """Every rank's report; a rank that died first (an exception in it, printed on its
    stderr, or a signal) is named at once instead of being waited for until ``timeout``."""
    got: list[tuple[str, int, float, float, bool]] = []
    until = time.monotonic() + timeout
    suspects: set[int] = set()
    while len(got) < len(procs):
        try:
            got.append(results.get(timeout=1.0))
            continue
        except queue.Empty:
            pass
        reported = {g[1] for g in got}
        dead = [(r, p.exitcode) for r, p in enumerate(procs)
                if r not in reported and p.exitcode is not None]
        # (a rank reports, then exits: one more quiet second before its silence is believed)
        if dead and {r for r, _ in dead} <= suspects:
            raise RuntimeError(f"{way}: ranks (rank, exit code) {dead} died without a report")
        suspects = {r for r, _ in dead}
        if time.monotonic() > until:
            raise RuntimeError(f"{way}: ranks {sorted(set(range(len(procs))) - reported)} "
                               f"did not report within {timeout:.0f} s")
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mib", type=int, default=16, help="the vector, MiB")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="launches of each way")
    args = parser.parse_args()
    nbytes = (args.mib << 20) // args.ranks
    figures: dict[str, list[tuple[float, float]]] = {"threads": [], "one": [], "ring": []}
    for i in range(args.rounds):
        ways = ("threads", "one", "ring")
        for way in (ways if i % 2 == 0 else ways[::-1]):
            figures[way].append(run(way, args.ranks, nbytes, args.steps))
            wall, cpu = figures[way][-1]
            print(f"round {i} {way:8s} {wall * 1e3:7.2f} ms/step  cpu {cpu * 1e3:6.2f} "
                  f"ms/rank-step", flush=True)
    for i in range(args.rounds):
        (tw, tc), (ow, oc) = figures["threads"][i], figures["one"][i]
        rw, rc = figures["ring"][i]
        print(f"round {i}: one I/O thread / thread per lane: wall {ow / tw:.2f}, "
              f"cpu {oc / tc:.2f}; thread per lane / ring: wall {tw / rw:.2f}, "
              f"cpu {tc / rc:.2f}")


if __name__ == "__main__":
    main()
