"""The step graph of every scheme, as the runtime runs it, for :mod:`.engine`.

Each builder takes the per-rank compute times of one step (emulated compute plus injected
delay) and returns the graph and, per rank, the op after which that rank holds the result.
A message is three ops: the sender's CPU (framing, the send call), the wire, the receiver's
CPU (the receive, plus a per-byte cost for the add, decode or copy into the result). Vectors
longer than ``chunk_bytes`` travel as several frames (at most ``MAX_CHUNKS``, as in the runtime),
each paying the per-message cost.

* **ring** (ours and Gloo's): reduce-scatter then all-gather, 2(N-1) steps of V/N bytes; a
  rank forwards step k once it has received step k-1 (and, at step 0, computed); Gloo's in
  lockstep with its neighbours (see :func:`ring`).
* **tree / coded-tree**: up the tree chunk by chunk (a parent forwards chunk c once it has
  chunk c of all its children, or of the first ``fanout - stragglers`` for the coded tree,
  and has computed itself), then the result down, chunk by chunk, each parent sending to its
  children one after the other. The coded tree's root does not compute.
* **gc** (gradient coding on a star): the runtime runs it as a tree of one level (the same
  session): workers 1..N-1 send V/m bytes per chunk to rank 0, which decodes each chunk from
  the first N-1-s and sends it on to every worker while later chunks still come in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..schemes.base import CHUNK_BYTES, MAX_CHUNKS, chunk_step
from .engine import Graph, Op


@dataclass(frozen=True)
class Costs:
    """What one message and one byte cost; fitted by :mod:`.calibrate`.

    ``msg_cpu`` is the CPU time a frame costs at each end (syscalls, framing, the event
    loop's wake-up), ``byte_cpu`` what each received byte costs (the add or copy),
    ``decode_cpu`` what choosing and applying a decoder costs a coded parent, ``step_cpu``
    what a rank's step costs before its first message (leaving the barrier, handing the
    compute to a thread and back: on a host whose cores all ranks share, every rank pays it
    at the same moment, so it sets a floor of ranks x step_cpu / cores), ``alpha`` the wire
    latency of a message, ``bandwidth`` a link's bytes per second in each direction,
    ``cores`` the cores all ranks share (the emulation host) or ``None`` (a host per rank),
    ``shared_port`` the fraction of a port's rate left when several streams share it (one
    each way gets the whole rate; see :mod:`.engine`).
    """

    alpha: float = 50e-6
    bandwidth: float = 1.25e8
    msg_cpu: float = 100e-6
    byte_cpu: float = 0.5e-9
    decode_cpu: float = 0.0  # a coded parent's decode, per chunk and child (the solve)
    step_cpu: float = 0.0  # a rank's fixed CPU per step, before it computes
    cores: int | None = None
    chunk_bytes: int = CHUNK_BYTES
    max_chunks: int = MAX_CHUNKS
    shared_port: float = 1.0


def _frames(nbytes: float, c: Costs) -> int:
    """Frames of a message of ``nbytes``, chunked as the runtime does (``chunk_bounds``)."""
    whole = math.ceil(nbytes)
    return max(1, math.ceil(whole / chunk_step(whole, 1, c.chunk_bytes, c.max_chunks)))


class _Builder:
    def __init__(self, costs: Costs) -> None:
        self.c = costs
        self.g = Graph()

    def compute(self, rank: int, seconds: float) -> Op:
        """The rank's step up to its first send: its fixed CPU, then its (emulated) compute."""
        if self.c.step_cpu <= 0:
            return self.g.add("delay", rank, seconds)
        start = self.g.add("cpu", rank, self.c.step_cpu)
        return self.g.add("delay", rank, seconds, after=[start])

    def message(self, src: int, dst: int, nbytes: float, after: list[Op],
                frames: int | None = None) -> Op:
        """Send ``nbytes`` from ``src`` to ``dst`` once ``after`` are done; returns the op
        after which ``dst`` has used them."""
        c = self.c
        n = frames if frames is not None else _frames(nbytes, c)
        send = self.g.add("cpu", src, n * c.msg_cpu, after=after)
        wire = self.g.add("wire", src, nbytes / c.bandwidth, dst=dst, latency=c.alpha,
                          after=[send])
        return self.g.add("cpu", dst, n * c.msg_cpu + nbytes * c.byte_cpu, after=[wire])

    def join(self, rank: int, after: list[Op], need: int | None = None) -> Op:
        return self.g.add("delay", rank, 0.0, after=after, need=need)


def ring(costs: Costs, compute: Sequence[float], vector_bytes: float,
         lockstep: bool = False) -> tuple[Graph, list[Op]]:
    """Ours (``lockstep`` False): a rank sends step k once it has received step k-1; its
    successor's receive of it is posted ahead. Gloo's (``lockstep``): a send also waits until
    its receiver is at that step (Gloo's unbound buffers send once the receiver has posted
    the receive), and a rank begins step k+1 only once its send and receive of step k are
    done, so ranks cannot run ahead of a paused neighbour's chain."""
    n = len(compute)
    b = _Builder(costs)
    seg = vector_bytes / n
    have = [b.compute(r, compute[r]) for r in range(n)]  # what rank r can send next after
    for _ in range(2 * (n - 1)):
        if not lockstep:
            have = [b.message((r - 1) % n, r, seg, [have[(r - 1) % n]]) for r in range(n)]
            continue
        got = [b.message((r - 1) % n, r, seg, [have[(r - 1) % n], have[r]]) for r in range(n)]
        have = [b.join(r, [got[r], got[(r + 1) % n]]) for r in range(n)]
    return b.g, have


def tree(costs: Costs, compute: Sequence[float], vector_bytes: float,
         children: Sequence[Sequence[int]], stragglers: int = 0, root_computes: bool = True,
         m: int = 1) -> tuple[Graph, list[Op]]:
    """A tree rooted at rank 0 (``children[r]``: rank r's children, all numbered above r, as
    in the runtime's heap and level-order trees): uncoded (``stragglers == 0``), CodedReduce,
    or gradient coding's star (one level); children send ``1/m`` of a chunk up
    (communication-efficient codes)."""
    n = len(children)
    b = _Builder(costs)
    chunks = _frames(vector_bytes, costs)
    piece = vector_bytes / chunks
    own = [b.compute(r, compute[r] if (r or root_computes) else 0.0) for r in range(n)]
    # up[r][c]: rank r has its partial sum of chunk c (its own and its children's); children
    # are numbered above their parent, so going down the ranks builds them first
    up: list[list[Op]] = [[] for _ in range(n)]
    for r in range(n - 1, -1, -1):
        kids = children[r]
        for c in range(chunks):
            if not kids:
                up[r].append(own[r])
                continue
            got = [b.message(k, r, piece / m, [up[k][c]], frames=1) for k in kids]
            first = b.join(r, got, need=len(kids) - stragglers)
            if stragglers:
                first = b.g.add("cpu", r, costs.decode_cpu * len(kids), after=[first])
            up[r].append(b.join(r, [first, own[r]]))
    # down: the result, chunk after chunk, to each child in turn
    down: list[list[Op]] = [[] for _ in range(n)]
    down[0] = up[0]
    for r in range(n):
        for c in range(chunks):
            for k in children[r]:
                down[k].append(b.message(r, k, piece, [down[r][c]], frames=1))
    # a rank's step returns once it has the result *and* its own compute has ended (a rank
    # that was skipped still finishes computing before its call returns)
    return b.g, [b.join(r, [*down[r], own[r]]) for r in range(n)]


