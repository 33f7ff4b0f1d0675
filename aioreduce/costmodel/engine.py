"""A discrete-event engine for one collective step: a graph of operations on shared resources.

An :class:`Op` is a piece of work that starts once ``need`` of its predecessors have finished
(all of them for an ordinary dependency; the first *k* of *n* for a decoder that takes the
first sufficient set of its children) and then holds resources for its duration:

* ``delay``: only time passes (emulated compute runs in a worker thread and holds nothing);
* ``cpu``: the rank's event loop (one thread, so a rank's CPU work is serial) and one core of
  the host pool (``cores`` shared by every rank, as on the emulation machine; ``None``: a core
  per rank, as on a real cluster);
* ``wire``: a message on the stream from sender to receiver (``bytes / bandwidth`` at the
  full link rate, then ``alpha`` of latency). A stream sends its messages in order; streams
  through the same port share its rate equally, as TCP connections into one NIC do (twelve
  children sending to one parent each get a twelfth, and finish chunk 0 together). A port
  that several streams share delivers only ``shared`` of its rate: on the emulated links,
  TCP streams into and out of one host at once lose a fifth to a third of it (their ACKs
  wait behind data in the same queues), which a lone stream each way does not.

CPU ops are started in the order they become ready (FIFO), which is what an event loop's
ready queue does. The engine is pure: no clock, no IO.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["delay", "cpu", "wire"]


@dataclass(eq=False)
class Op:
    """One operation of the step graph; ``done`` is set when the engine has run it."""

    kind: Kind
    rank: int  # the rank that does it (the sender, for a wire op)
    seconds: float = 0.0  # delay and cpu: how long; wire: serialisation time
    dst: int = -1  # wire: the receiving rank
    latency: float = 0.0  # wire: added after serialisation
    need: int = 0  # predecessors that must finish first (set by :meth:`Graph.add`)
    succ: list[Op] = field(default_factory=list)
    done: float | None = None
    _waiting: int = field(default=0, repr=False)


class Graph:
    """The operations of one step and their dependencies."""

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def add(self, kind: Kind, rank: int, seconds: float = 0.0, *, dst: int = -1,
            latency: float = 0.0, after: list[Op] | None = None, need: int | None = None
            ) -> Op:
        """A new op that starts when ``need`` (default: all) of ``after`` have finished."""
        op = Op(kind, rank, seconds, dst, latency)
        self.ops.append(op)
        preds = after or []
        for p in preds:
            p.succ.append(op)
        op.need = len(preds) if need is None else min(need, len(preds))
        return op


@dataclass(eq=False)
class _Flow:
    """A message being sent: what is left of it and at what share of the link."""

    left: float  # seconds at the full link rate still to send
    since: float  # when ``left`` was last brought up to date
    rate: float = 1.0  # share of the link
    version: int = 0  # of its finish plan; an older plan is stale


class _Links:
    """Flows on full-duplex links: each connection (sender, receiver) sends its messages in
    order, one at a time (one TCP stream); the streams through one port share it equally (a
    flow gets ``1 / max(streams out of its sender, streams into its receiver)`` of the link).
    Rates change whenever a stream starts or ends, so finish times are re-planned then; an
    outdated plan is recognised by its version and skipped."""

    def __init__(self, ranks: int, shared: float = 1.0) -> None:
        self.shared = shared
        # dicts as ordered sets: re-planning in insertion order keeps runs reproducible (a
        # set of Ops iterates by id, which changed tie-breaks from one run to the next)
        self.out: list[dict[Op, None]] = [{} for _ in range(ranks)]
        self.into: list[dict[Op, None]] = [{} for _ in range(ranks)]
        self.queued: dict[tuple[int, int], list[Op]] = {}
        self.flows: dict[Op, _Flow] = {}  # the messages being sent

    def offer(self, op: Op, t: float) -> list[tuple[float, Op, int]]:
        """``op`` is ready to send at ``t``: start it, or queue it behind its stream."""
        queue = self.queued.setdefault((op.rank, op.dst), [])
        queue.append(op)
        return self._start(op, t) if len(queue) == 1 else []

    def finish(self, op: Op, t: float) -> list[tuple[float, Op, int]]:
        """``op`` has sent its last byte at ``t``: re-plan the others, start the next."""
        del self.out[op.rank][op], self.into[op.dst][op]
        del self.flows[op]
        plans = self._replan(self.out[op.rank] | self.into[op.dst], t)
        queue = self.queued[(op.rank, op.dst)]
        queue.pop(0)
        if queue:
            plans += self._start(queue[0], t)
        return plans

    def current(self, op: Op, version: int) -> bool:
        flow = self.flows.get(op)
        return flow is not None and flow.version == version

    def _start(self, op: Op, t: float) -> list[tuple[float, Op, int]]:
        self.out[op.rank][op] = self.into[op.dst][op] = None
        self.flows[op] = _Flow(op.seconds, t)
        return self._replan(self.out[op.rank] | self.into[op.dst], t)

    def _replan(self, ops: dict[Op, None], t: float) -> list[tuple[float, Op, int]]:
        plans = []
        for op in ops:
            f = self.flows[op]
            f.left -= (t - f.since) * f.rate
            f.since = t
            streams = max(len(self.out[op.rank]), len(self.into[op.dst]))
            f.rate = (self.shared if streams > 1 else 1.0) / streams
            f.version += 1
            plans.append((t + max(0.0, f.left) / f.rate, op, f.version))
        return plans


def run(graph: Graph, ranks: int, cores: int | None, shared: float = 1.0) -> None:
    """Run every op of ``graph`` (sets ``op.done``); ops whose ``need`` is never met stay
    ``None``. ``shared``: the fraction of a port's rate its streams get when it has several
    (see :class:`_Links`)."""
    thread_free = [0.0] * ranks
    core_free = [0.0] * cores if cores else []
    links = _Links(ranks, shared)
    # (time, sequence, what, op, version): "start" an op when ready, a wire op's "sent" (its
    # last byte, if the plan is still current), and "finished", when successors are told, in
    # time order, so a k-of-n join sees the first k to *finish*.
    events: list[tuple[float, int, str, Op, int]] = []
    seq = 0

    def push(t: float, what: str, op: Op, version: int = 0) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, what, op, version))
        seq += 1

    for op in graph.ops:
        op._waiting = op.need
        op.done = None
        if op.need == 0:
            push(0.0, "start", op)
    while events:
        t, _, what, op, version = heapq.heappop(events)
        if what == "finished":
            for s in op.succ:
                s._waiting -= 1
                if s._waiting == 0:  # exactly when the need-th predecessor finishes
                    push(t, "start", s)
            continue
        if what == "sent":
            if links.current(op, version):
                for when, f, v in links.finish(op, t):
                    push(when, "sent", f, v)
                op.done = t + op.latency
                push(op.done, "finished", op)
            continue
        if op.kind == "wire":
            for when, f, v in links.offer(op, t):
                push(when, "sent", f, v)
            continue
        if op.kind == "delay":
            end = t + op.seconds
        else:  # the rank's thread, and the earliest free core of a shared pool
            end = max(t, thread_free[op.rank], core_free[0] if core_free else 0.0) + op.seconds
            if core_free:
                heapq.heapreplace(core_free, end)
            thread_free[op.rank] = end
        op.done = end
        push(end, "finished", op)
