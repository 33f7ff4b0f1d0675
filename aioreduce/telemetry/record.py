"""Recording what each step did on this rank, for the trace files.

The :class:`TracingComm` sits between a scheme's session and the real comm and counts, per
step, the bytes sent and, per peer, the bytes received and when the last frame of that peer
arrived. The node adds what only it knows (when the step began, when this rank's own vector
was ready, the result, the decode time) and :class:`Tracer` writes one JSON line per step.

Times are seconds relative to the step's start on this rank (``t0``, a wall-clock time, so the
ranks of a job can be laid on one timeline); a frame that arrived before this rank began the
step has a negative time. A step's line is written when the next one ends, so frames of late
peers and background sends of that step are counted too; later ones are not.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import numpy as np

from ..schemes.base import BulkLink, BulkLinks, Comm, CommWrapper, EarlyHandler, Result
from ..wire import Header

#: Steps whose counters are kept while they have not been written (frames far ahead of us).
MAX_OPEN_STEPS = 64


@dataclass
class PeerIn:
    """What arrived from one peer during one step."""

    bytes: int = 0
    frames: int = 0
    last_s: float = 0.0  # when its last frame arrived, relative to the step's t0


@dataclass
class StepRecord:
    """One line of a trace file: one step on one rank."""

    rank: int
    step: int
    scheme: str
    t0: float  # wall-clock start of the step on this rank (time.time())
    seconds: float = 0.0  # until the result (or error) was here
    ready_s: float | None = None  # when this rank's own vector was ready (compute + delay)
    used: list[int] = field(default_factory=list)
    late: list[int] = field(default_factory=list)
    exact: bool | None = None
    error_bound: float = 0.0
    decode_s: float = 0.0  # time this rank spent decoding and combining
    sent_bytes: int = 0
    recv_bytes: int = 0
    recv: dict[int, PeerIn] = field(default_factory=dict)  # by source rank
    error: str | None = None  # the exception the step ended with, if any

    def to_json(self) -> str:
        d = asdict(self)
        d["recv"] = {str(k): v for k, v in d["recv"].items()}
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> StepRecord:
        d = json.loads(line)
        d["recv"] = {int(k): PeerIn(**v) for k, v in d["recv"].items()}
        return cls(**d)


def trace_path(where: str, rank: int) -> str:
    """The file of ``rank``: ``where`` with ``{rank}`` filled in, or ``where/rank.N.jsonl``."""
    if "{rank}" in where:
        return where.format(rank=rank)
    return os.path.join(where, f"rank.{rank}.jsonl")


class Tracer:
    """Collects the counters of open steps and writes each finished step as a line."""

    def __init__(self, rank: int, path: str) -> None:
        self.rank = rank
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._file: IO[str] | None = open(path, "a", buffering=1)  # noqa: SIM115
        self._open: dict[int, StepRecord] = {}
        self._t0: dict[int, float] = {}  # monotonic start of each open step
        self._written_up_to = -1  # frames of steps up to here come too late to be counted
        self._done: set[int] = set()  # ended, not yet written

    def _record(self, step: int) -> StepRecord | None:
        rec = self._open.get(step)
        if rec is None and step > self._written_up_to and len(self._open) < MAX_OPEN_STEPS:
            # A frame of a step this rank has not begun: count it from now on.
            rec = self._open[step] = StepRecord(self.rank, step, "", time.time())
            self._t0[step] = time.monotonic()
        return rec

    def begin(self, step: int, scheme: str) -> None:
        """The node starts ``step``; frames that came earlier keep their (negative) times."""
        rec = self._record(step)
        if rec is None:
            return
        early = time.monotonic() - self._t0[step]
        rec.scheme, rec.t0 = scheme, time.time()
        self._t0[step] += early
        for peer in rec.recv.values():
            peer.last_s -= early

    def now(self, step: int) -> float:
        """Seconds since ``step`` began here."""
        return time.monotonic() - self._t0.get(step, time.monotonic())

    def sent(self, step: int, nbytes: int) -> None:
        rec = self._record(step)
        if rec is not None:
            rec.sent_bytes += nbytes

    def received(self, src: int, step: int, nbytes: int, frames: int = 1) -> None:
        rec = self._record(step)
        if rec is None:
            return
        peer = rec.recv.setdefault(src, PeerIn())
        peer.bytes += nbytes
        peer.frames += frames
        peer.last_s = self.now(step)
        rec.recv_bytes += nbytes

    def ready(self, step: int) -> None:
        """This rank's own vector for ``step`` is ready."""
        rec = self._open.get(step)
        if rec is not None:
            rec.ready_s = self.now(step)

    def finish(self, step: int, result: Result | None, error: BaseException | None,
               decode_s: float = 0.0) -> None:
        """``step`` ended here. Its line is written when the next step ends (or at close), so
        sends still in the background and frames of late peers are counted too."""
        rec = self._open.get(step)
        if rec is None:
            return
        rec.seconds = self.now(step)
        rec.decode_s = decode_s
        if result is not None:
            rec.used, rec.late = list(result.used), list(result.late)
            rec.exact, rec.error_bound = result.exact, result.error_bound
        if error is not None:
            rec.error = f"{type(error).__name__}: {error}"
        self._done.add(step)
        self._flush(before=step)

    def _flush(self, before: int) -> None:
        """Write the ended steps below ``before``; forget the others (never begun here)."""
        for s in sorted(k for k in self._open if k < before):
            rec = self._open.pop(s)
            self._t0.pop(s, None)
            if s in self._done and self._file is not None:
                self._file.write(rec.to_json() + "\n")
        self._done = {s for s in self._done if s >= before}
        self._written_up_to = max(self._written_up_to, before - 1)

    def close(self) -> None:
        """Write every ended step and close the file."""
        self._flush(before=max(self._open, default=-1) + 1)
        if self._file is not None:
            self._file.close()
            self._file = None


class TracingComm(CommWrapper):
    """A :class:`~aioreduce.schemes.base.Comm` that counts what passes through it."""

    def __init__(self, inner: Comm, tracer: Tracer) -> None:
        super().__init__(inner)
        self.tracer = tracer

    async def send(self, rank: int, array: np.ndarray, *, step: int, tag: int = 0,
                   meta: dict[str, Any] | None = None) -> None:
        # Counted when handed over: background sends may finish after the step is written.
        self.tracer.sent(step, array.nbytes)
        await self.inner.send(rank, array, step=step, tag=tag, meta=meta)

    def post_recv(self, rank: int, out: np.ndarray, *, step: int,
                  tag: int = 0) -> asyncio.Future[Header]:
        fut = self.inner.post_recv(rank, out, step=step, tag=tag)
        nbytes = out.nbytes

        def arrived(f: asyncio.Future[Header]) -> None:
            if not f.cancelled() and f.exception() is None:
                self.tracer.received(rank, step, nbytes)

        fut.add_done_callback(arrived)
        return fut

    def bulk_links(self) -> BulkLinks | None:
        links = self.inner.bulk_links()
        return None if links is None else _CountedLinks(links, self.tracer)

    def on_early(self, rank: int, min_tag: int, handler: EarlyHandler, *,
                 since: int | None = None) -> Callable[[], None]:
        def counted(header: Header, payload: memoryview) -> None:
            self.tracer.received(rank, header.step, payload.nbytes)
            handler(header, payload)

        return self.inner.on_early(rank, min_tag, counted, since=since)


class _CountedLinks:
    """The inner comm's bulk links, with what a step moves over them counted by the tracer
    (they bypass the comm's own calls)."""

    def __init__(self, inner: BulkLinks, tracer: Tracer) -> None:
        self.inner, self.tracer = inner, tracer

    async def open_links(self, send_to: Sequence[int], recv_from: Sequence[int], step: int,
                         *, partial: bool = False
                         ) -> tuple[Mapping[int, BulkLink], Mapping[int, BulkLink]]:
        return await self.inner.open_links(send_to, recv_from, step, partial=partial)

    @property
    def spans_hosts(self) -> bool:
        return self.inner.spans_hosts

    def count_moved(self, step: int, sent: int, src: int, received: int, frames: int) -> None:
        self.tracer.sent(step, sent)
        self.tracer.received(src, step, received, frames)
        self.inner.count_moved(step, sent, src, received, frames)
