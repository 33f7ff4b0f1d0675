"""The public runtime: a :class:`Node` is one rank of a job.

Use it as an async context manager; entering it joins the job (listener, rendezvous through
rank 0), leaving it waits for the other ranks (bounded) and closes every connection::

    async with Node.from_env() as node:
        await node.send(1, array, step=0)
        await node.recv_into(1, out, step=0)

The node owns the mesh (connections) and one scheme *session* at a time; everything a scheme
keeps from step to step lives in that session (see :mod:`aioreduce.schemes`). ``send`` and
``recv_into`` give trainers point-to-point messages of their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Literal, TypeAlias

import numpy as np

from .env import NodeEnv, discover
from .errors import ConfigError, VectorMismatch
from .schemes import CodedScheme, FellBehind, Result, Scheme, Session
from .schemes.base import Comm, DecodeTimed, SumsInPlace, WritesInto
from .schemes.broadcast import broadcast
from .schemes.dormant import GatedComm
from .schemes.exchange import exchange
from .schemes.gather import allgather
from .schemes.p2p import PointToPoint
from .stepgc import StepGC
from .straggle import StraggleModel, parse_straggle
from .telemetry import Tracer, TracingComm, trace_path
from .transport import Mesh, MeshOptions, barrier, rendezvous
from .wire import Header

log = logging.getLogger("aioreduce")

ReduceOp = Literal["sum", "mean"]
# A numpy array, a CPU torch tensor, or a function returning either (typed loosely so that
# importing aioreduce never imports torch).
Reducible: TypeAlias = "np.ndarray | Callable[[], np.ndarray] | Any"


def _is_tensor(obj: object) -> bool:
    """A torch tensor? Decided without importing torch unless the object comes from it."""
    if not type(obj).__module__.startswith("torch"):
        return False
    from .tensors import is_tensor
    return is_tensor(obj)


def _describe(obj: object) -> str:
    """What a caller passed, for an error message."""
    if isinstance(obj, np.ndarray):
        flags = [] if obj.flags.writeable else ["read-only"]
        flags += [] if obj.flags.c_contiguous else ["non-contiguous"]
        return " ".join([*flags, f"{obj.dtype} array"])
    return type(obj).__name__


def mean_divisor(res: Result, world_size: int) -> float:
    """How many contributions ``res.value`` sums: every rank it used, or for a bounded-time
    result the fraction that arrived of all ranks' contributions."""
    if res.received < 1.0:
        return max(world_size * res.received, 1.0)
    return float(max(len(res.used), 1))


class Node:
    """One rank of an aioreduce job."""

    def __init__(self, env: NodeEnv, *, scheme: Scheme | Literal["auto"] | None = None,
                 straggle: StraggleModel | str | None = None,
                 options: MeshOptions | None = None, close_timeout: float = 10.0,
                 trace: str | None = None,
                 on_listen: Callable[[str, int], None] | None = None,
                 gc_every: int = 0) -> None:
        self.env = env
        # Rank 0: called with the rendezvous (address, port) once it listens, before waiting
        # for the others (the torch backend publishes it in torch's store).
        self.on_listen = on_listen
        # "auto": the first allreduce picks the scheme (aioreduce.sim.auto)
        self._auto = scheme == "auto"
        self.scheme: Scheme | None = None if isinstance(scheme, str) else scheme
        if isinstance(scheme, str) and not self._auto:
            raise ValueError(f"rank {env.rank}: scheme must be a Scheme or 'auto', not "
                             f"{scheme!r} (by name: aioreduce.schemes.by_name)")
        if self.scheme is not None:
            self.scheme.validate(env.world_size)
        if isinstance(straggle, str):
            straggle = parse_straggle(straggle)
        self.straggle = straggle or StraggleModel()
        self._step = 0
        self._like: np.ndarray | None = None
        # (device, dtype) of the tensors the compute function passed returns, if it does
        self._tensor_out: Any = None
        self._holders: tuple[Scheme, int] | None = None  # see _data_holders
        self._last_return = time.perf_counter()
        self._session: Session | None = None
        # Sessions kept by use(keep=True), each with the gate that keeps it out of the
        # running scheme's frames; and the running session's gate.
        self._kept: list[tuple[Scheme, Session, GatedComm]] = []
        self._gate: GatedComm | None = None
        if options is None and env.max_frame is not None:
            options = MeshOptions(max_payload=env.max_frame)
        self.mesh = Mesh(env.rank, env.world_size, env.secret, env.job, options)
        # send/recv outside the collective steps (torch's point-to-point calls)
        self.p2p = PointToPoint(self.mesh)
        self.close_timeout = close_timeout
        self._started = False
        # Step telemetry: one JSON line per step (see aioreduce.telemetry).
        self.tracer = Tracer(env.rank, trace_path(trace, env.rank)) if trace else None
        # gc_every=N: Python's collector runs after every N-th step, the same on every rank
        # (see aioreduce.stepgc); 0 leaves it alone.
        if gc_every < 0:
            raise ValueError(f"rank {env.rank}: gc_every must be >= 0, not {gc_every}")
        self.stepgc = StepGC(gc_every) if gc_every else None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *,
                 scheme: Scheme | Literal["auto"] | None = None,
                 options: MeshOptions | None = None,
                 **kwargs: Any) -> Node:
        """A node configured from ``AIOREDUCE_*``/torchrun/SLURM/Open MPI variables.

        ``AIOREDUCE_STRAGGLE`` (see :mod:`aioreduce.straggle`) injects stragglers unless a
        ``straggle`` argument is given; ``AIOREDUCE_LATENCY=SECONDS`` adds that one-way latency
        to every data frame received (an emulated link's, see ``MeshOptions.latency``) unless
        ``options`` are given; ``AIOREDUCE_TRACE=DIR`` writes step telemetry to
        ``DIR/rank.N.jsonl`` unless a ``trace`` argument is given; ``AIOREDUCE_GC_EVERY=N``
        moves Python's garbage collection to after every N-th step (see
        :mod:`aioreduce.stepgc`) unless a ``gc_every`` argument is given.
        """
        env_map = os.environ if environ is None else environ
        env = discover(environ)
        for key, value in env_extras(env_map, env.max_frame).items():
            if key == "options":
                options = value if options is None else options
            else:
                kwargs.setdefault(key, value)
        return cls(env, scheme=scheme, options=options, **kwargs)

    @property
    def rank(self) -> int:
        """This process's rank, 0..world_size-1."""
        return self.env.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the job."""
        return self.env.world_size

    async def start(self) -> None:
        """Listen and rendezvous; afterwards every rank's address is known."""
        env = self.env
        if env.rank == 0:
            _host, port = await self.mesh.listen(env.bind_addr or _bind_for(env.master_addr),
                                                 env.master_port)
            if env.master_port == 0:  # a free port was taken: tell the others (a torch store)
                env = self.env = dataclasses.replace(env, master_port=port)
            if self.on_listen is not None:
                self.on_listen(env.master_addr, env.master_port)
        await rendezvous(self.mesh, (env.master_addr, env.master_port),
                         advertise=env.advertise_addr, bind=env.bind_addr,
                         timeout=env.rendezvous_timeout)
        self._started = True
        await self._preconnect()
        if self.scheme is not None:
            self._session = self.scheme.open(self._gated())
        if self.stepgc is not None:  # last: nothing after it can fail and leave it on
            self.stepgc.start()
        log.debug("rank %d joined job %s (%d ranks)", env.rank, env.job, env.world_size)

    async def _preconnect(self) -> None:
        """Open the scheme's connections now, in parallel, instead of inside the first steps.
        Each link is dialed by its lower rank, so every pair gets one connection."""
        if self.scheme is None:
            return
        peers = [p for p in self.scheme.neighbours(self.rank, self.world_size) if p > self.rank]
        results = await asyncio.gather(*(self.mesh.connect(p) for p in peers),
                                       return_exceptions=True)
        for p, r in zip(peers, results, strict=True):
            if isinstance(r, BaseException):  # the step will dial again and report it
                log.warning("rank %d: could not pre-connect to rank %d: %s", self.rank, p, r)

    async def close(self, *, wait_for_peers: bool = True) -> None:
        """Leave the job: results still on their way to slower ranks get ``close_timeout``
        seconds, a bounded barrier lets peers get their last frames, then disconnect."""
        if self._started and wait_for_peers:
            try:  # the session keeps serving slower ranks meanwhile
                await barrier(self.mesh, self.close_timeout, closing=True)
            except Exception as exc:  # a dead peer must not block shutdown
                log.warning("rank %d: closing without a clean barrier: %s", self.rank, exc)
        sessions = [s for _scheme, s, _gate in self._kept]
        self._kept.clear()
        if self._session is not None:
            sessions.append(self._session)
            self._session = None
        for session in sessions:
            await session.close(self.close_timeout)
        self._started = False
        await self.mesh.close()
        if self.stepgc is not None:
            self.stepgc.stop()
        if self.tracer is not None:
            self.tracer.close()

    async def __aenter__(self) -> Node:
        try:
            await self.start()
        except BaseException:
            await self.mesh.close()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close(wait_for_peers=exc is None)

    # -- point-to-point messages ----------------------------------------------------------------
    async def send(self, rank: int, array: np.ndarray, *, step: int = 0, tag: int = 0,
                   meta: dict[str, Any] | None = None) -> None:
        """Send ``array`` to ``rank`` as frame (step, tag), with optional small ``meta``.

        Returns once every byte is in the kernel, so ``array`` may be changed afterwards.
        A non-contiguous array is sent from a contiguous copy; object arrays are refused.
        The receiver finds ``meta`` in the returned header. Once the receiver has run a step,
        a frame more than ``PeerBudget.steps_ahead`` (65536) steps ahead of it is refused.
        """
        await self.mesh.send(rank, array, step=step, tag=tag, meta=meta)

    async def recv_into(self, rank: int, out: np.ndarray, *, step: int = 0, tag: int = 0,
                        timeout: float | None = None) -> Header:
        """Receive frame (step, tag) from ``rank`` directly into ``out`` (no copy).

        ``out`` must be writable and C-contiguous with the sender's dtype and byte size.
        Raises :class:`~aioreduce.errors.RecvTimeout` after ``timeout`` seconds and
        :class:`~aioreduce.errors.PeerLost` (naming the rank) if the peer's connection breaks.
        """
        return await self.mesh.recv_into(rank, out, step=step, tag=tag, timeout=timeout)

    def post_recv(self, rank: int, out: np.ndarray, *, step: int = 0,
                  tag: int = 0) -> asyncio.Future[Header]:
        """Post a receive without waiting: a future that resolves when ``out`` is filled.

        Cancel the future to withdraw the receive (``out`` is then never written again).
        """
        return self.mesh.post_recv(rank, out, step=step, tag=tag)

    def discard_before(self, step: int) -> None:
        """Frames of steps below ``step`` are stale: dropped on arrival, never delivered
        (unless a receive for them is still posted)."""
        self.mesh.discard_before(step)

    async def barrier(self, timeout: float = 60.0) -> None:
        """Wait until every rank has called ``barrier``."""
        await barrier(self.mesh, timeout)

    # -- aggregation --------------------------------------------------------------------------
    async def use(self, scheme: Scheme, *, keep: bool = False) -> None:
        """Switch to another scheme between steps (every rank must switch at the same step).
        The old scheme's session is closed (nothing of it stays behind) and the new one's
        connections are opened right away. Benchmarks use it to alternate schemes.

        With ``keep=True`` the old session is kept instead, and a later ``use`` of an equal
        scheme resumes it with its state (a bounded-time scheme's learned deadline, a tree's
        result window); kept sessions close with the node."""
        scheme.validate(self.world_size)
        if self._session is not None:
            session, self._session = self._session, None
            if keep and self.scheme is not None and self._gate is not None:
                self._gate.sleep(self._step)  # the steps from here are not its own
                self._kept.append((self.scheme, session, self._gate))
            else:
                await session.close(self.close_timeout)
        self.scheme = scheme
        self._like = None
        await self._preconnect()
        if self._started:
            kept = next((i for i, (s, _, _) in enumerate(self._kept) if s == scheme), None)
            if kept is not None:
                _scheme, self._session, self._gate = self._kept.pop(kept)
                self._gate.wake(self._step)
            else:
                self._session = scheme.open(self._gated())

    def _gated(self) -> Comm:
        """A new session's comm, behind the gate that keeps its handlers to its own steps
        (from the next one on)."""
        self._gate = GatedComm(self._comm(), first_step=self._step)
        return self._gate

    def _comm(self) -> Comm:
        """The comm sessions run on: the mesh, counted when tracing."""
        return self.mesh if self.tracer is None else TracingComm(self.mesh, self.tracer)

    @property
    def sums_in_place(self) -> bool:
        """Does the current scheme sum straight into the caller's array with
        ``allreduce(in_place=True)`` (every rank in every sum, so ``op="mean"`` divides by the
        world size), rather than copying its result in?"""
        return isinstance(self._session, SumsInPlace)

    @property
    def step(self) -> int:
        """The number of the next step (aggregation or broadcast)."""
        return self._step

    def placement(self, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, weights) this rank computes its coded gradient on, for a data set of
        ``num_samples`` samples, under the node's coded scheme."""
        scheme = self._require(coded=True)
        assert isinstance(scheme, CodedScheme)
        return scheme.placement(self.rank, num_samples)

    async def aggregate(self, vector: Reducible, *, op: ReduceOp = "sum") -> Result:
        """One step of a coded scheme: the exact sum of everyone's data, same on every rank.

        ``vector`` is this rank's weighted gradient over :meth:`placement`, or a function that
        computes it: then the receives from this rank's children are posted first and the
        function runs in a worker thread while their messages arrive. A function is not
        called at all for a step whose result is already here (this rank was paused and is
        catching up), so pass one where you can. A CPU torch tensor (or a function returning
        one) works too: the result's ``value`` is then a tensor (see :mod:`aioreduce.torch`).
        ``op="mean"`` divides the sum by the number of ranks that hold data.

        Raises :class:`~aioreduce.StragglerError` when a step cannot be decoded in time and
        :class:`~aioreduce.FellBehind` when this rank is further behind than its peers keep
        results for (the node then stands at the job's current step).
        """
        scheme = self._require(coded=True)
        res = await self._reduce(vector, op, any_shape=False)
        if op == "mean":
            res = dataclasses.replace(res, value=res.value / self._data_holders(scheme))
        return res

    def _data_holders(self, scheme: Scheme) -> int:
        """How many ranks hold data under a coded ``scheme`` (computed once per scheme)."""
        if self._holders is None or self._holders[0] is not scheme:
            assert isinstance(scheme, CodedScheme)
            count = sum(1 for r in range(self.world_size)
                        if len(scheme.placement(r, scheme.min_samples)[0]))
            self._holders = (scheme, count)
        return self._holders[1]

    async def allreduce(self, array: Reducible, *, op: ReduceOp = "sum",
                        any_shape: bool = False, in_place: bool = False) -> Result:
        """One step of an uncoded scheme (Ring, Tree, Star, Transpose): the sum of every
        rank's array, or with ``op="mean"`` the sum divided by the number of contributions
        it holds. A CPU torch tensor works too (the result's ``value`` is then a tensor).

        ``any_shape=True`` lets every step have a shape of its own (as a collective library
        does: the ranks agree per call, and a disagreement raises ``VectorMismatch`` on every
        rank) instead of refusing a change of shape as a caller mistake.

        ``in_place=True`` writes the result into ``array`` itself (a writable C-contiguous
        floating-point array or CPU tensor), which is then the result's ``value``, as
        ``torch.distributed.all_reduce`` does. The ring sums straight into it (no result
        buffer, no copy; a mean costs a pass over 1/N of it); other schemes copy their result
        in. If the step fails, ``array`` holds partial sums."""
        if self._auto and self.scheme is None:
            array = await self._choose_scheme(array)
        self._require(coded=False)
        if in_place:
            return await self._reduce_in_place(array, op, any_shape=any_shape)
        res = await self._reduce(array, op, any_shape=any_shape)
        if op == "mean":
            res = dataclasses.replace(res, value=res.value / mean_divisor(res, self.world_size))
        return res

    async def _reduce_in_place(self, array: Reducible, op: str, *, any_shape: bool
                               ) -> Result:
        """:meth:`allreduce` with ``in_place=True``."""
        target = array
        if _is_tensor(array):
            from .tensors import to_numpy
            if not target.is_contiguous():  # type: ignore[union-attr]
                raise ValueError(f"rank {self.rank}: in_place=True needs a contiguous tensor "
                                 "(call .contiguous() and reduce that)")
            array = to_numpy(array, self.rank)  # a copy where numpy cannot view it (GPU)
        if not isinstance(array, np.ndarray) or array.dtype.kind not in "fc" or not (
                array.flags.c_contiguous and array.flags.writeable):
            raise TypeError(f"rank {self.rank}: in_place=True needs a writable C-contiguous "
                            "floating-point array or CPU tensor, not "
                            f"{_describe(array)}")
        # A session that sums in place sums every rank: it divides by the world size as it
        # goes. Any other copies its sum in, divided here by the contributions it holds.
        folded = op == "mean" and self.sums_in_place
        res = await self._reduce(array, op, any_shape=any_shape, into=array,
                                 divisor=self.world_size if folded else 1)
        if op == "mean" and not folded:
            np.divide(array, mean_divisor(res, self.world_size), out=array)
        if target is not array:  # a tensor: the result is a TensorResult, its value that tensor
            from .tensors import tensor_result, write_back
            write_back(target, array)  # type: ignore[arg-type]  # a tensor
            return tensor_result(res, value=target)  # type: ignore[arg-type]  # a tensor
        return dataclasses.replace(res, value=array)

    async def _reduce(self, vector: Reducible, op: str, *, any_shape: bool,
                      into: np.ndarray | None = None, divisor: float = 1) -> Result:
        """Tensors to arrays and back around :meth:`_run`."""
        if op not in ("sum", "mean"):
            raise ValueError(f"rank {self.rank}: op must be 'sum' or 'mean', not {op!r} (min, "
                             "max and product: gather with Node.allgather)")
        if any_shape:
            self._like = None
        like = None  # (device, dtype) of a tensor argument, for a result like it
        if _is_tensor(vector):
            from .tensors import describe, to_numpy
            like = describe(vector)
            vector = to_numpy(vector, self.rank)
        elif callable(vector):
            vector = self._numpy_compute(vector)
        res = await self._run(vector, into, divisor)
        if into is not None:
            return res
        if like is None and callable(vector):
            like = self._tensor_out
        if like is not None:
            from .tensors import tensor_result
            return tensor_result(res, like=like)
        return res

    def _numpy_compute(self, compute: Callable[[], object]) -> Callable[[], np.ndarray]:
        """``compute`` as a function of numpy arrays; remembers that it returns tensors, so
        a step whose compute is skipped (known already) returns a tensor all the same."""
        def run() -> np.ndarray:
            out = compute()
            if _is_tensor(out):
                from .tensors import describe, to_numpy
                self._tensor_out = describe(out)
                return to_numpy(out, self.rank)
            return out  # type: ignore[return-value]  # checked by the session
        return run

    async def _choose_scheme(self, array: Reducible) -> Reducible:
        """``scheme="auto"``: rank 0 ranks the uncoded schemes by simulated step time for
        this vector and every rank uses its pick (one broadcast step). A compute function is
        called here, once, to learn the vector's size; its result is what this step sums."""
        from .sim import auto

        value: Any = array() if callable(array) and not _is_tensor(array) else array
        nbytes = (int(value.element_size() * value.nelement()) if _is_tensor(value)
                  else np.asarray(value).nbytes)
        opts = auto.options(self.world_size)
        choice = np.zeros(1, np.int64)
        ranked: list[Any] = []
        if self.rank == 0:
            ranked = auto.choose(self.world_size, nbytes, auto.platform_for(self.world_size))
            best = ranked[0]
            choice[0] = next(i for i, o in enumerate(opts)
                             if (o.scheme, o.settings) == (best.scheme, best.settings))
        picked = (await self.broadcast(choice, root=0)).value
        option = opts[int(picked[0])]
        if self.rank == 0:
            log.info("rank 0: scheme='auto' chose %s for %d bytes on %d ranks (predicted "
                     "%s)", option.label, nbytes, self.world_size,
                     ", ".join(f"{o.label} {o.median * 1e3:.1f} ms" for o in ranked[:3]))
        await self.use(auto.build(option))
        return value

    async def allgather(self, array: np.ndarray) -> Result:
        """Every rank's ``array``, stacked (row ``r`` is rank ``r``'s), exactly, on every rank.
        A collective step; point to point (each rank sends ``N - 1`` copies), for small
        arrays: shapes, flags, or reductions other than a sum."""
        step = self._step
        self._step += 1
        return await allgather(self.mesh, step, array)

    async def broadcast(self, array: np.ndarray, root: int = 0) -> Result:
        """Every rank gets ``root``'s ``array`` exactly (others pass an array of the same
        shape and dtype, which is not modified). A collective step: every rank calls it at the
        same step, e.g. to re-sync a model after :class:`~aioreduce.FellBehind`."""
        if not 0 <= root < self.world_size:
            raise ValueError(f"rank {self.rank}: broadcast root {root} is not a rank "
                             f"(world size {self.world_size})")
        step = self._step
        self._step += 1
        return await broadcast(self.mesh, step, array, root)

    async def exchange(self, sends: Mapping[int, np.ndarray],
                       recvs: Mapping[int, np.ndarray]) -> None:
        """A collective step that sends ``sends[r]`` to rank ``r`` and receives from rank
        ``r`` straight into ``recvs[r]``, exactly (all-to-all, gather, scatter). Every rank
        calls it at the same step, each with the sizes it receives."""
        step = self._step
        self._step += 1
        await exchange(self.mesh, step, sends, recvs)

    def _require(self, *, coded: bool) -> Scheme:
        if self.scheme is None or self._session is None:
            raise RuntimeError(f"rank {self.rank}: this node has no scheme (pass scheme=... "
                               "and enter the node first)")
        if self.scheme.coded != coded:
            what = "aggregate() with a coded vector" if self.scheme.coded else "allreduce()"
            raise TypeError(f"rank {self.rank}: {type(self.scheme).__name__} is used through "
                            f"{what}")
        return self.scheme

    def _check_input(self, vector: object) -> None:
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
        like = self._like
        if like is not None and (vector.shape != like.shape or vector.dtype != like.dtype):
            raise ValueError(f"rank {self.rank}, step {self._step}: this vector is "
                             f"{vector.dtype} {list(vector.shape)}, earlier steps were "
                             f"{like.dtype} {list(like.shape)}; every step of a scheme needs "
                             "the same shape and dtype on every rank (Node.use() starts anew)")

    async def _run(self, vector: np.ndarray | Callable[[], np.ndarray],
                   into: np.ndarray | None = None, divisor: float = 1) -> Result:
        """One step of the session; with ``into``, the result lands there (divided by
        ``divisor`` if the session sums in place; others ignore it)."""
        session = self._session
        assert session is not None  # aggregate()/allreduce() checked it
        self._check_input(vector)
        step = self._step
        self._step += 1
        loop = asyncio.get_running_loop()
        since_return = time.perf_counter() - self._last_return
        if callable(vector) and self._like is None:
            # First step: the shape is not known before computing.
            t = time.perf_counter()
            vector = await loop.run_in_executor(None, vector)
            since_return = time.perf_counter() - t  # the compute time, not the start-up
        if callable(vector) and self._like is not None and session.known(step):
            # This rank is behind and the step's result is already here: skip the compute
            # (and any injected delay), so a rank that was paused catches up instead of
            # replaying at compute speed.
            skipped: asyncio.Future[np.ndarray] = loop.create_future()
            skipped.set_result(np.zeros_like(self._like))
            return await self._step_session(session, step, self._like, skipped)
        if callable(vector):
            compute = vector

            async def produce() -> np.ndarray:
                t = time.perf_counter()
                out = await loop.run_in_executor(None, compute)
                return await self._straggle(step, out, time.perf_counter() - t)

            own = asyncio.ensure_future(produce())
            assert self._like is not None
            like = self._like
        else:
            vec = np.ascontiguousarray(vector)
            like = self._like = np.empty_like(vec)
            own = asyncio.ensure_future(self._straggle(step, vec, since_return))
        return await self._step_session(session, step, like, own, into, divisor)

    async def _step_session(self, session: Session, step: int, like: np.ndarray,
                            own: asyncio.Future[np.ndarray], into: np.ndarray | None = None,
                            divisor: float = 1) -> Result:
        tracer = self.tracer
        if tracer is not None:
            tracer.begin(step, type(self.scheme).__name__)
            own.add_done_callback(lambda f: None if f.cancelled() else tracer.ready(step))
        result: Result | None = None
        error: BaseException | None = None
        try:
            if into is None:
                result = await session.step(step, like, own)
            elif isinstance(session, SumsInPlace):
                result = await session.step_into(step, like, own, into, divisor)
            elif isinstance(session, WritesInto):
                result = await session.step_to(step, like, own, into)
            else:
                result = await session.step(step, like, own)
                np.copyto(into.reshape(result.value.shape), result.value)
                result = dataclasses.replace(result, value=into)
            return result
        except BaseException as exc:
            error = exc
            if isinstance(exc, FellBehind):
                self._step = max(self._step, exc.current_step)
            elif isinstance(exc, VectorMismatch):
                # The ranks did not agree on the shape: the next step starts anew (a corrected
                # vector is not refused as "differs from earlier steps").
                self._like = None
            raise
        finally:
            own.cancel()
            if self.stepgc is not None:
                self.stepgc.after(step)
            self._last_return = time.perf_counter()
            if tracer is not None:
                decode = session.decode_seconds(step) if isinstance(session, DecodeTimed) else 0
                tracer.finish(step, result, error, decode)

    async def _straggle(self, step: int, vec: np.ndarray, compute_seconds: float
                        ) -> np.ndarray:
        """Apply injected straggling (a delay model per rank) to this rank's vector."""
        if self.straggle.kills(self.rank, step):
            # A real death, as a crashed or preempted machine: no cleanup, no goodbye.
            os.kill(os.getpid(), signal.SIGKILL)
        delay = self.straggle.extra_delay(self.rank, step, compute_seconds, self.world_size)
        if delay > 0:
            await asyncio.sleep(delay)
        return vec


def env_extras(env_map: Mapping[str, str], max_frame: int | None = None) -> dict[str, Any]:
    """The :class:`Node` arguments that ``AIOREDUCE_*`` variables set besides the job itself
    (see :meth:`Node.from_env`): ``options`` (``AIOREDUCE_LATENCY``,
    ``AIOREDUCE_LOCAL_UNIX``), ``trace``, ``gc_every`` and ``straggle``, each only if its
    variable is set; a malformed value is a :class:`ConfigError` naming the variable. Shared
    with the torch backend."""
    extras: dict[str, Any] = {}
    mesh: dict[str, Any] = {}
    if env_map.get("AIOREDUCE_LATENCY"):
        try:
            latency = float(env_map["AIOREDUCE_LATENCY"])
        except ValueError:
            latency = -1.0
        if not 0 <= latency < 60:
            raise ConfigError(f"AIOREDUCE_LATENCY={env_map['AIOREDUCE_LATENCY']!r}: give "
                              "the emulated one-way latency in seconds (e.g. 0.0001)")
        mesh["latency"] = latency
    if env_map.get("AIOREDUCE_LOCAL_UNIX"):
        value = env_map["AIOREDUCE_LOCAL_UNIX"]
        if value not in ("0", "1"):
            raise ConfigError(f"AIOREDUCE_LOCAL_UNIX={value!r}: give 1 (ranks on one host "
                              "talk over Unix sockets, the default) or 0 (TCP always)")
        mesh["local_unix"] = value == "1"
    if mesh:
        if max_frame is not None:
            mesh["max_payload"] = max_frame
        extras["options"] = MeshOptions(**mesh)
    if env_map.get("AIOREDUCE_TRACE"):
        extras["trace"] = env_map["AIOREDUCE_TRACE"]
    if env_map.get("AIOREDUCE_GC_EVERY"):
        value = env_map["AIOREDUCE_GC_EVERY"]
        if not value.isdigit():
            raise ConfigError(f"AIOREDUCE_GC_EVERY={value!r}: give a number of steps "
                              "(0: leave Python's collector alone)")
        extras["gc_every"] = int(value)
    if env_map.get("AIOREDUCE_STRAGGLE"):
        extras["straggle"] = parse_straggle(env_map["AIOREDUCE_STRAGGLE"],
                                            int(env_map.get("AIOREDUCE_STRAGGLE_SEED", 0)))
    return extras


def _bind_for(master_addr: str) -> str:
    """Rank 0 listens on the rendezvous address if it is a loopback one, else on all interfaces."""
    loopback = master_addr.startswith("127.") or master_addr == "localhost"
    return master_addr if loopback else "0.0.0.0"
