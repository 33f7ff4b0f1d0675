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

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Literal

import numpy as np

from .env import NodeEnv, discover
from .heal import Healer, StateHooks
from .inputs import Inputs, ReduceOp, Reducible
from .peers import Peers
from .schemes import Result, Scheme, Session
from .schemes.base import Arrival, Comm, SumsInPlace
from .schemes.p2p import PointToPoint
from .sessions import Sessions, preconnect
from .settings import bind_for, env_extras
from .stepper import Stepper, finish_mean, mean_divisor
from .straggle import StraggleModel
from .telemetry import TracingComm
from .transport import Mesh, MeshOptions, barrier, rendezvous
from .wire.incarnation import JOINING

log = logging.getLogger("aioreduce")


class Node(Peers):
    """One rank of an aioreduce job."""

    def __init__(self, env: NodeEnv, *, scheme: Scheme | Literal["auto"] | None = None,
                 straggle: StraggleModel | str | None = None,
                 options: MeshOptions | None = None, close_timeout: float = 10.0,
                 trace: str | None = None, on_listen: Callable[[str, int], None] | None = None,
                 gc_every: int = 0, state: StateHooks | None = None,
                 rejoin_wait: float = 0.0) -> None:
        self.env = env
        # Rank 0: called with the rendezvous (address, port) once it listens, before waiting
        # for the others (the torch backend publishes it in torch's store).
        self.on_listen = on_listen
        # "auto": the first allreduce picks the scheme (aioreduce.costmodel.auto)
        self._auto = scheme == "auto"
        self._sessions = Sessions(self._comm)
        self._sessions.pick(scheme, env.rank, env.world_size)
        self._inputs = Inputs(env.rank)
        if options is None and env.max_frame is not None:
            options = MeshOptions(max_payload=env.max_frame)
        mesh = Mesh(env.rank, env.world_size, env.secret, env.job, options)
        # send/recv outside the collective steps (torch's point-to-point calls)
        self.p2p = PointToPoint(mesh)
        # how a replacement of a dead rank heals, and how long a step waits for one
        self.healer = Healer(mesh, state, env.rendezvous_timeout, lambda: (
            self.scheme.neighbours(self.rank, self.world_size) if self.scheme else []),
            rejoin_wait, self._sessions.members)
        self.close_timeout = close_timeout
        self._started = False
        steps = Stepper.configured(env.rank, env.world_size, straggle, trace, gc_every)
        # injected stragglers, step telemetry and garbage collection: see the Stepper
        self.straggle, self.tracer, self.stepgc = steps.straggle, steps.tracer, steps.stepgc
        super().__init__(mesh, steps)

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
        :mod:`aioreduce.stepgc`; 0 leaves it alone) unless a ``gc_every`` argument is
        given."""
        env = discover(environ)
        extras = env_extras(os.environ if environ is None else environ, env.max_frame)
        env_options = extras.pop("options", None)
        return cls(env, scheme=scheme, options=options if options is not None else env_options,
                   **{**extras, **kwargs})

    @property
    def scheme(self) -> Scheme | None:
        """The scheme the node runs (None before ``scheme="auto"`` has chosen)."""
        return self._sessions.scheme

    @property
    def session(self) -> Session | None:
        """The running scheme session (for tests and tools: its state across steps)."""
        return self._sessions.current

    async def start(self) -> None:
        """Listen and rendezvous; afterwards every rank's address is known."""
        env = self.env
        if env.rank == 0:
            # No incarnation until the rendezvous says whether the job starts or runs (this
            # process may replace a dead rank 0: see aioreduce.transport.rendezvous).
            self.mesh.incarnations.mine = JOINING
            _host, port = await self.mesh.listen(env.bind_addr or bind_for(env.master_addr),
                                                 env.master_port)
            if env.master_port == 0:  # a free port was taken: tell the others (a torch store)
                env = self.env = dataclasses.replace(env, master_port=port)
            if self.on_listen is not None:
                self.on_listen(env.master_addr, env.master_port)
        await rendezvous(self.mesh, (env.master_addr, env.master_port),
                         advertise=env.advertise_addr, bind=env.bind_addr,
                         timeout=env.rendezvous_timeout)
        self._started = True
        if self.mesh.incarnations.rejoined:  # this process replaces a dead one: heal it
            self._steps.step, self._steps.replacement = await self.healer.heal(), True
        await preconnect(self.mesh, self.scheme)
        if self.scheme is not None:
            self._sessions.open(self.scheme, self._steps.step)
            if self.mesh.incarnations.rejoined:
                self._sessions.rejoined(self._steps.step, self.healer.healed_members,
                                        taken_back=self.healer.taken_back)
        self._steps.start()  # last: nothing after it can fail with the collector held off
        log.debug("rank %d joined job %s (%d ranks)", env.rank, env.job, env.world_size)

    async def close(self, *, wait_for_peers: bool = True) -> None:
        """Leave the job: results still on their way to slower ranks get ``close_timeout``
        seconds, a bounded barrier lets peers get their last frames, then disconnect."""
        if self._started and wait_for_peers:
            try:  # the session keeps serving slower ranks meanwhile
                await barrier(self.mesh, self.close_timeout, closing=True)
            except Exception as exc:  # a dead peer must not block shutdown
                log.warning("rank %d: closing without a clean barrier: %s", self.rank, exc)
        await self._sessions.close(self.close_timeout)
        await self.close_lanes(self.close_timeout)
        self._started = False
        await self.mesh.close()
        self._steps.close()

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

    # -- aggregation --------------------------------------------------------------------------
    async def use(self, scheme: Scheme, *, keep: bool = False) -> None:
        """Switch to another scheme between steps (every rank must switch at the same step).
        The old scheme's session is closed (nothing of it stays behind) and the new one's
        connections are opened right away. Benchmarks use it to alternate schemes.

        With ``keep=True`` the old session is kept instead, and a later ``use`` of an equal
        scheme resumes it with its state (a bounded-time scheme's learned deadline, a tree's
        result window); kept sessions close with the node."""
        scheme.validate(self.world_size)
        await self._sessions.leave(self._steps.step, keep=keep, timeout=self.close_timeout)
        self._sessions.scheme = scheme
        self._steps.like = None
        await preconnect(self.mesh, self.scheme)
        if self._started:
            self._sessions.open(scheme, self._steps.step)

    def _comm(self) -> Comm:
        """The comm sessions run on: the mesh, counted when tracing."""
        return self.mesh if self.tracer is None else TracingComm(self.mesh, self.tracer)

    @property
    def sums_in_place(self) -> bool:
        """Does the current scheme sum straight into the caller's array with
        ``allreduce(in_place=True)`` (the ring), rather than copying its result in?"""
        return isinstance(self._sessions.current, SumsInPlace)

    @property
    def step(self) -> int:
        """The number of the next step (aggregation or broadcast)."""
        return self._steps.step

    def placement(self, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, weights) this rank computes its coded gradient on, for a data set of
        ``num_samples`` samples, under the node's coded scheme."""
        return self._sessions.placement(self.rank, num_samples)

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
        self._sessions.require(self.rank, coded=True)
        res = await self._reduce(vector, op, any_shape=False)
        if op == "mean":
            holders = self._sessions.data_holders(self.world_size)
            res = dataclasses.replace(res, value=res.value / holders)
        return res

    async def allreduce(self, array: Reducible, *, op: ReduceOp = "sum",
                        any_shape: bool = False, in_place: bool = False,
                        arrival: Arrival | None = None, rerun: bool = True,
                        last: bool = False) -> Result:
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
        in. If the step fails, ``array`` holds partial sums.

        ``arrival`` (with ``in_place=True``): ``array`` is still being filled, piece by piece
        (see :class:`~aioreduce.schemes.base.Arrival`). ``rerun=False``: one of a group of
        steps the caller runs again after :meth:`replace_lost` (see ``Healer.step``);
        ``last=True`` too: the group's last step, which a rank where it failed because a rank
        died takes from a live rank that finished it (with ``in_place=True``; the others
        keep a copy of its result until the next group's step)."""
        if self._auto and self.scheme is None:
            from .costmodel.auto import pick  # the cost model ranks the uncoded schemes
            array = await pick(self, array)
        self._sessions.require(self.rank, coded=False)
        if in_place:
            return await self._reduce_in_place(array, op, any_shape=any_shape, arrival=arrival,
                                               rerun=rerun, last=last)
        if arrival is not None:
            raise ValueError(f"rank {self.rank}: arrival= needs in_place=True")
        res = await self._reduce(array, op, any_shape=any_shape, rerun=rerun)
        if op == "mean":
            res = dataclasses.replace(res, value=res.value / mean_divisor(res, self.world_size))
        return res

    async def replace_lost(self) -> bool:
        """See :meth:`aioreduce.heal.Healer.replace_lost` (after ``rerun=False`` steps)."""
        return await self.healer.replace_lost(self._steps)

    async def _reduce_in_place(self, target: Reducible, op: str, *, any_shape: bool,
                               arrival: Arrival | None, rerun: bool, last: bool = False
                               ) -> Result:
        """:meth:`allreduce` with ``in_place=True``."""
        array = self._inputs.in_place(target)
        # A session that sums in place sums every rank: it divides by the world size as it
        # goes. Any other copies its sum in, divided here by the contributions it holds.
        folded = op == "mean" and self.sums_in_place
        res = await self._reduce(array, op, any_shape=any_shape, into=array, arrival=arrival,
                                 divisor=self.world_size if folded else 1, rerun=rerun,
                                 last=last)
        finish_mean(array, res, self.world_size, mean=op == "mean", folded=folded)
        return self._inputs.in_place_result(target, array, res)

    async def _reduce(self, vector: Reducible, op: str, *, any_shape: bool,
                      into: np.ndarray | None = None, divisor: float = 1,
                      arrival: Arrival | None = None, rerun: bool = True,
                      last: bool = False) -> Result:
        """One step of the session, tensors to arrays and back."""
        self._inputs.check_op(op)
        if any_shape:
            self._steps.like = None
        array: np.ndarray | Callable[[], np.ndarray]
        if type(vector) is np.ndarray:  # the usual argument: nothing to convert
            array, like = vector, None
        else:
            array, like = self._inputs.numpy(vector)
        session = self._sessions.current
        assert session is not None  # aggregate()/allreduce() checked it
        res = await self.healer.step(self._steps, lambda: self._steps.run(
            session, type(self.scheme).__name__, array, into, divisor, arrival),
            into, rerun=rerun, session=session, last=last, arrival=arrival)
        if into is not None or (like is None and type(array) is np.ndarray):
            return res  # (what Inputs.result returns for these, without the call)
        return self._inputs.result(res, like, callable(array))
