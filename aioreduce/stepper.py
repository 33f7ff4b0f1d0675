"""Running one step of a node's scheme session: numbering it, checking the vector, overlapping
the compute with arrival, injected stragglers, telemetry and garbage collection around it.

The node (:mod:`aioreduce.node`) decides *which* session runs and turns tensors into arrays
(:mod:`aioreduce.inputs`); a :class:`Stepper` runs the steps and keeps what lives from one to
the next: the step number, the vector's shape and dtype, and when the caller last got a result
(the compute time an injected ``slow=K`` stretches).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import cast

import numpy as np

from .errors import VectorMismatch
from .schemes import FellBehind, Result, Session
from .schemes.base import Arrival, DecodeTimed, SumsInPlace, WritesInto
from .stepgc import StepGC
from .straggle import StraggleModel, parse_straggle
from .telemetry import Tracer, trace_path


class Stepper:
    """The steps of one node (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, straggle: StraggleModel,
                 tracer: Tracer | None, stepgc: StepGC | None) -> None:
        self.rank, self.world_size = rank, world_size
        self.straggle, self.tracer, self.stepgc = straggle, tracer, stepgc
        self.step = 0  # the number of the next step
        self.like: np.ndarray | None = None  # shape and dtype of this scheme's steps
        # This process replaced a dead one (see aioreduce.heal): an injected death (kill=STEP)
        # was its predecessor's.
        self.replacement = False
        self._last_return = time.perf_counter()

    @classmethod
    def configured(cls, rank: int, world_size: int, straggle: StraggleModel | str | None,
                   trace: str | None, gc_every: int) -> Stepper:
        """A stepper from a node's arguments: ``straggle`` a model or its text (see
        :mod:`aioreduce.straggle`), ``trace`` a folder for one JSON line per step (see
        :mod:`aioreduce.telemetry`), ``gc_every=N`` runs Python's collector after every N-th
        step, the same on every rank (see :mod:`aioreduce.stepgc`; 0 leaves it alone)."""
        if gc_every < 0:
            raise ValueError(f"rank {rank}: gc_every must be >= 0, not {gc_every}")
        if isinstance(straggle, str):
            straggle = parse_straggle(straggle)
        return cls(rank, world_size, straggle or StraggleModel(),
                   Tracer(rank, trace_path(trace, rank)) if trace else None,
                   StepGC(gc_every) if gc_every else None)

    def start(self) -> None:
        """The node joined the job: collections between steps from now on (if asked)."""
        if self.stepgc is not None:
            self.stepgc.start()

    def close(self) -> None:
        """The node leaves the job: collections back to Python's, the telemetry closed."""
        if self.stepgc is not None:
            self.stepgc.stop()
        if self.tracer is not None:
            self.tracer.close()

    def take(self) -> int:
        """A step number for a collective step (allgather, broadcast, exchange)."""
        step = self.step
        self.step += 1
        return step

    def check_input(self, vector: object) -> None:
        """Refuse a bad argument before a step number is taken, so a corrected retry joins
        the same step as the other ranks."""
        if callable(vector):
            return
        if not isinstance(vector, np.ndarray):
            hint = (" (a torch tensor: pass tensor.numpy(), or use aioreduce.torch)"
                    if type(vector).__module__.startswith("torch") else "")
            raise TypeError(f"rank {self.rank}: pass a numpy array or a function that returns "
                            f"one, not {type(vector).__name__}{hint}")
        if vector.dtype.hasobject:
            raise TypeError(f"rank {self.rank}: an object array cannot be aggregated; pass a "
                            "numeric array")
        like = self.like
        if like is not None and (vector.shape != like.shape or vector.dtype != like.dtype):
            raise ValueError(f"rank {self.rank}, step {self.step}: this vector is "
                             f"{vector.dtype} {list(vector.shape)}, earlier steps were "
                             f"{like.dtype} {list(like.shape)}; every step of a scheme needs "
                             "the same shape and dtype on every rank (Node.use() starts anew)")

    async def run(self, session: Session, label: str,
                  vector: np.ndarray | Callable[[], np.ndarray],
                  into: np.ndarray | None = None, divisor: float = 1,
                  arrival: Arrival | None = None) -> Result:
        """One step of ``session`` (``label``: the scheme, for telemetry); with ``into``, the
        result lands there (divided by ``divisor`` if the session sums in place; others
        ignore it). ``arrival``: the vector is still landing (see
        :class:`~aioreduce.schemes.base.Arrival`)."""
        self.check_input(vector)
        step = self.take()
        loop = asyncio.get_running_loop()
        since_return = time.perf_counter() - self._last_return
        if callable(vector) and self.like is None:
            # First step: the shape is not known before computing.
            t = time.perf_counter()
            vector = await loop.run_in_executor(None, vector)
            since_return = time.perf_counter() - t  # the compute time, not the start-up
        if callable(vector) and self.like is not None and session.known(step):
            # This rank is behind and the step's result is already here: skip the compute
            # (and any injected delay), so a rank that was paused catches up instead of
            # replaying at compute speed.
            skipped: asyncio.Future[np.ndarray] = loop.create_future()
            skipped.set_result(np.zeros_like(self.like))
            return await self._session_step(session, label, step, self.like, skipped)
        if callable(vector):
            compute = vector

            async def produce() -> np.ndarray:
                t = time.perf_counter()
                out = await loop.run_in_executor(None, compute)
                delay = self._injected(step, time.perf_counter() - t)
                if delay > 0:
                    await asyncio.sleep(delay)
                return out

            own: asyncio.Future[np.ndarray] = asyncio.ensure_future(produce())
            assert self.like is not None
            like = self.like
        else:
            vec = np.ascontiguousarray(vector)
            if self.like is None:  # (else check_input found the same shape and dtype: kept)
                self.like = np.empty_like(vec)
            like = self.like
            delay = self._injected(step, since_return)
            if delay > 0:
                own = asyncio.ensure_future(_after(delay, vec))
            else:  # (a task would cost a turn of the loop and tens of microseconds a step)
                own = loop.create_future()
                own.set_result(vec)
        return await self._session_step(session, label, step, like, own, into, divisor,
                                        arrival)

    async def _session_step(self, session: Session, label: str, step: int, like: np.ndarray,
                            own: asyncio.Future[np.ndarray], into: np.ndarray | None = None,
                            divisor: float = 1, arrival: Arrival | None = None) -> Result:
        tracer = self.tracer
        if tracer is not None:
            tracer.begin(step, label)
            own.add_done_callback(lambda f: None if f.cancelled() else tracer.ready(step))
        result: Result | None = None
        error: BaseException | None = None
        try:
            sums_in_place, writes_into = _capabilities(type(session))
            if into is not None and sums_in_place:
                result = await cast(SumsInPlace, session).step_into(step, like, own, into,
                                                                    divisor, arrival)
                return result
            if arrival is not None:  # a session that reads the vector whole: all of it first
                own = asyncio.ensure_future(_landed(own, arrival))
            if into is None:
                result = await session.step(step, like, own)
            elif writes_into:
                result = await cast(WritesInto, session).step_to(step, like, own, into)
            else:
                result = await session.step(step, like, own)
                np.copyto(into.reshape(result.value.shape), result.value)
                result = dataclasses.replace(result, value=into)
            return result
        except BaseException as exc:
            error = exc
            if isinstance(exc, FellBehind):
                self.step = max(self.step, exc.current_step)
            elif isinstance(exc, VectorMismatch):
                # The ranks did not agree on the shape: the next step starts anew (a corrected
                # vector is not refused as "differs from earlier steps").
                self.like = None
            raise
        finally:
            own.cancel()
            if self.stepgc is not None:
                self.stepgc.after(step)
            self._last_return = time.perf_counter()
            if tracer is not None:
                decode = session.decode_seconds(step) if isinstance(session, DecodeTimed) else 0
                tracer.finish(step, result, error, decode)
            # The error's traceback holds this frame: kept here, the two would form a cycle
            # that holds the step's buffers until Python's collector runs (with StepGC, up to
            # gc_every steps): a pool then takes fresh memory for the next steps, whose page
            # faults made a transpose's steps late, cut and raised again (docs/transpose.md).
            error = None

    def _injected(self, step: int, compute_seconds: float) -> float:
        """Injected straggling (a delay model per rank): the seconds this rank's vector is
        held back at ``step`` (or the process dies here, if the model says so)."""
        if not self.straggle.rules:  # (nearly every job: two calls a step less)
            return 0.0
        if self.straggle.kills(self.rank, step) and not self.replacement:
            # A real death, as a crashed or preempted machine: no cleanup, no goodbye.
            os.kill(os.getpid(), signal.SIGKILL)
        return self.straggle.extra_delay(self.rank, step, compute_seconds, self.world_size)


async def _after(delay: float, vec: np.ndarray) -> np.ndarray:
    """``vec``, ``delay`` seconds from now."""
    await asyncio.sleep(delay)
    return vec


def mean_divisor(res: Result, world_size: int) -> float:
    """How many contributions ``res.value`` sums: every rank it used, or for a bounded-time
    result the fraction that arrived of all ranks' contributions."""
    if res.received < 1.0:  # (of the ranks in the step: a re-formed one has fewer)
        return max(min(world_size, len(res.used) + len(res.late)) * res.received, 1.0)
    return float(max(len(res.used), 1))


def finish_mean(array: np.ndarray, res: Result, world_size: int, *, mean: bool,
                folded: bool) -> None:
    """An in-place step's result in ``array`` as asked: ``mean`` divides a sum by the
    contributions it holds; a session that sums in place divided by the world size as it
    went (``folded``), which a ring re-formed without some ranks corrects here."""
    if mean and not folded:
        np.divide(array, mean_divisor(res, world_size), out=array)
    elif folded and len(res.used) != world_size:
        np.multiply(array, world_size / max(len(res.used), 1), out=array)


@functools.cache
def _capabilities(kind: type) -> tuple[bool, bool]:
    """Whether sessions of ``kind`` sum in place and write into a given array (typed
    capabilities, asked once per class: a protocol's isinstance walks its members, tens of
    microseconds a step)."""
    return issubclass(kind, SumsInPlace), issubclass(kind, WritesInto)


async def _landed(own: Awaitable[np.ndarray], arrival: Arrival) -> np.ndarray:
    """``own``'s vector once all of it is on the host."""
    vec = await own
    await asyncio.to_thread(arrival.landed, 0, vec.size)
    return vec
