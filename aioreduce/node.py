"""The public runtime: a :class:`Node` is one rank of a job.

Use it as an async context manager; entering it joins the job (listener, rendezvous through
rank 0), leaving it waits for the other ranks (bounded) and closes every connection::

    async with Node.from_env() as node:
        await node.send(1, array, step=0)
        await node.recv_into(1, out, step=0)

``send`` and ``recv_into`` are the Comm interface the collective schemes are written against.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from types import TracebackType
from typing import Any

import numpy as np

from .env import NodeEnv, discover
from .schemes import CodedTree, GradientCoding, Result, Scheme
from .straggle import StraggleModel, parse_straggle
from .transport import Mesh, MeshOptions, barrier, rendezvous
from .wire import Header

log = logging.getLogger("aioreduce")

BACKLOG_SECONDS = 10.0
BACKLOG_STEPS = 16


class Node:
    """One rank of an aioreduce job."""

    def __init__(self, env: NodeEnv, *, scheme: Scheme | None = None,
                 straggle: StraggleModel | str | None = None,
                 options: MeshOptions | None = None, close_timeout: float = 10.0) -> None:
        self.env = env
        self.scheme = scheme
        if scheme is not None:
            scheme.validate(env.world_size)
        if isinstance(straggle, str):
            straggle = parse_straggle(straggle)
        self.straggle = straggle or StraggleModel()
        self._step = 0
        self._like: np.ndarray | None = None
        self._last_return = time.perf_counter()
        self._background: dict[int, list[tuple[int, asyncio.Task[None]]]] = {}
        self._forwarded: set[tuple[int, int]] = set()
        self._background_started: dict[tuple[int, int], float] = {}
        self.scheme_state: dict[str, Any] = {}  # what a scheme keeps from step to step
        self.closing = False
        if options is None and env.max_frame is not None:
            options = MeshOptions(max_payload=env.max_frame)
        self.mesh = Mesh(env.rank, env.world_size, env.secret, env.job, options)
        self.close_timeout = close_timeout
        self._started = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *,
                 scheme: Scheme | None = None, options: MeshOptions | None = None,
                 **kwargs: Any) -> Node:
        """A node configured from ``AIOREDUCE_*``/torchrun/SLURM/Open MPI variables.

        ``AIOREDUCE_STRAGGLE`` (see :mod:`aioreduce.straggle`) injects stragglers unless a
        ``straggle`` argument is given.
        """
        env_map = os.environ if environ is None else environ
        if "straggle" not in kwargs and env_map.get("AIOREDUCE_STRAGGLE"):
            kwargs["straggle"] = parse_straggle(env_map["AIOREDUCE_STRAGGLE"],
                                                int(env_map.get("AIOREDUCE_STRAGGLE_SEED", 0)))
        return cls(discover(environ), scheme=scheme, options=options, **kwargs)

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
            await self.mesh.listen(env.bind_addr or _bind_for(env.master_addr), env.master_port)
        await rendezvous(self.mesh, (env.master_addr, env.master_port),
                         advertise=env.advertise_addr, bind=env.bind_addr,
                         timeout=env.rendezvous_timeout)
        self._started = True
        await self._preconnect()
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
        """Leave the job: a bounded barrier so peers get their last frames, then disconnect."""
        self.closing = True  # no new background sends, no replays to the children of the lost
        pending = [t for tasks in self._background.values() for _s, t in tasks if not t.done()]
        if pending:  # results still on their way to slower ranks
            await asyncio.wait(pending, timeout=self.close_timeout)
        if self._started and wait_for_peers:
            try:
                await barrier(self.mesh, self.close_timeout)
            except Exception as exc:  # a dead peer must not block shutdown
                log.warning("rank %d: closing without a clean barrier: %s", self.rank, exc)
        self._started = False
        await self.mesh.close()

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

    # -- Comm interface -----------------------------------------------------------------------
    async def send(self, rank: int, array: np.ndarray, *, step: int = 0, tag: int = 0,
                   meta: dict[str, Any] | None = None) -> None:
        """Send ``array`` to ``rank`` as frame (step, tag), with optional small ``meta``.

        Returns once every byte is in the kernel, so ``array`` may be changed afterwards.
        A non-contiguous array is sent from a contiguous copy; object arrays are refused.
        The receiver finds ``meta`` in the returned header.
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
        Use it to post many receives at once and wait on them with your own deadline.
        """
        return self.mesh.post_recv(rank, out, step=step, tag=tag)

    def discard_before(self, step: int) -> None:
        """Frames of steps below ``step`` are stale: dropped on arrival, never delivered."""
        self.mesh.set_floor(step)

    async def barrier(self, timeout: float = 60.0) -> None:
        """Wait until every rank has called ``barrier``."""
        await barrier(self.mesh, timeout)

    def relay_from(self, rank: int, min_tag: int,
                   relay: Callable[[Header, memoryview], None]) -> None:
        """Forward frames from ``rank`` (tags >= ``min_tag``) as soon as they arrive."""
        self.mesh.set_relay(rank, min_tag, relay)

    def claim_forward(self, step: int, tag: int) -> bool:
        """True the first time a (step, tag) result chunk is to be forwarded, False after."""
        key = (step, tag)
        if key in self._forwarded:
            return False
        if len(self._forwarded) > 4096:
            self._forwarded = {k for k in self._forwarded if k[0] >= step - 2}
        self._forwarded.add(key)
        return True

    def on_peer_lost(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(rank)`` whenever a peer's last connection breaks."""
        self.mesh.lost_listeners.append(listener)

    def is_lost(self, rank: int) -> bool:
        """True if the connection to ``rank`` broke (killed process, reset) and is not back."""
        return self.mesh.is_lost(rank)

    def abort_peer(self, rank: int, reason: str) -> None:
        """Cut every connection with ``rank`` (a peer that stopped reading)."""
        log.warning("rank %d: dropping connections to rank %d: %s", self.rank, rank, reason)
        self.mesh.abort(rank, reason)

    # -- aggregation --------------------------------------------------------------------------
    async def use(self, scheme: Scheme) -> None:
        """Switch to another scheme between steps (every rank must switch at the same step);
        its connections are opened right away. Benchmarks use it to alternate schemes."""
        scheme.validate(self.world_size)
        self.scheme = scheme
        self._like = None
        await self._preconnect()

    @property
    def step(self) -> int:
        """The number of the next aggregation step."""
        return self._step

    def placement(self, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, weights) this rank computes its coded gradient on, for a data set of
        ``num_samples`` samples, under the node's coded scheme."""
        scheme = self._require(coded=True)
        assert isinstance(scheme, CodedTree | GradientCoding)
        return scheme.placement(self.rank, num_samples)

    async def aggregate(self, vector: np.ndarray | Callable[[], np.ndarray]) -> Result:
        """One step of a coded scheme: the exact sum of everyone's data, same on every rank.

        ``vector`` is this rank's weighted gradient over :meth:`placement`, or a function that
        computes it: then the receives from this rank's children are posted first and the
        function runs in a worker thread while their messages arrive.
        """
        self._require(coded=True)
        return await self._run(vector)

    async def allreduce(self, array: np.ndarray | Callable[[], np.ndarray]) -> Result:
        """One step of an uncoded scheme (Ring, Tree, Star): the sum of every rank's array."""
        self._require(coded=False)
        return await self._run(array)

    def _require(self, *, coded: bool) -> Scheme:
        if self.scheme is None:
            raise RuntimeError("this node has no scheme: Node.from_env(scheme=...)")
        if self.scheme.coded != coded:
            what = "aggregate() with a coded vector" if self.scheme.coded else "allreduce()"
            raise TypeError(f"{type(self.scheme).__name__} is used through {what}")
        return self.scheme

    async def _run(self, vector: np.ndarray | Callable[[], np.ndarray]) -> Result:
        scheme = self.scheme
        assert scheme is not None  # aggregate()/allreduce() checked it
        step = self._step
        self._step += 1
        loop = asyncio.get_running_loop()
        since_return = time.perf_counter() - self._last_return
        if callable(vector):
            if self._like is None:  # first step: the shape is not known before computing
                t = time.perf_counter()
                vector = await loop.run_in_executor(None, vector)
                since_return = time.perf_counter() - t  # the compute time, not the start-up
            else:
                compute = vector

                async def produce() -> np.ndarray:
                    t = time.perf_counter()
                    out = await loop.run_in_executor(None, compute)
                    return await self._finish_own(step, out, time.perf_counter() - t)

                own = asyncio.ensure_future(produce())
                try:
                    return await self._step_with(scheme, self._like, own, step)
                finally:
                    own.cancel()
        assert isinstance(vector, np.ndarray)
        vec = np.ascontiguousarray(vector)
        self._like = np.empty_like(vec)
        own = asyncio.ensure_future(self._finish_own(step, vec, since_return))
        try:
            return await self._step_with(scheme, vec, own, step)
        finally:
            own.cancel()

    async def _finish_own(self, step: int, vec: np.ndarray, compute_seconds: float
                          ) -> np.ndarray:
        """Encode (communication-efficient codes) and apply injected straggling."""
        if isinstance(self.scheme, GradientCoding):
            vec = self.scheme.encode(self.rank, vec.reshape(-1))
        delay = self.straggle.extra_delay(self.rank, step, compute_seconds)
        if delay > 0:
            await asyncio.sleep(delay)
        return vec

    async def _step_with(self, scheme: Scheme, like: np.ndarray,
                         own: asyncio.Future[np.ndarray], step: int) -> Result:
        try:
            return await scheme.step(self, like, own, step, self._spawn)
        finally:
            self._last_return = time.perf_counter()

    def _spawn(self, peer: int, step: int, coro: Coroutine[Any, Any, None]) -> None:
        """Send to ``peer`` in the background. A peer that has not taken a result for
        ``BACKLOG_SECONDS`` while newer ones queue up, or that falls ``BACKLOG_STEPS`` results
        behind, has stopped reading (a stopped process): its connections are cut, so memory
        stays bounded and later steps go on without it."""
        if self.closing:
            coro.close()
            return
        now = time.monotonic()
        tasks = [(s, t) for s, t in self._background.get(peer, []) if not t.done()]
        oldest = min((s for s, _t in tasks), default=step)
        started = self._background_started.get((peer, oldest), now)
        if tasks and oldest < step and (now - started > BACKLOG_SECONDS
                                        or step - oldest > BACKLOG_STEPS):
            self.abort_peer(peer, f"results of step {min(s for s, _ in tasks)} still unsent")
            for _s, t in tasks:
                t.cancel()
            tasks = []
        task = asyncio.ensure_future(coro)
        task.add_done_callback(_quiet)
        tasks.append((step, task))
        self._background[peer] = tasks
        self._background_started.setdefault((peer, step), now)
        if len(self._background_started) > 4 * BACKLOG_STEPS * max(1, self.world_size):
            live = {(p, s) for p, ts in self._background.items() for s, _t in ts}
            self._background_started = {k: v for k, v in self._background_started.items()
                                        if k in live}


def _quiet(task: asyncio.Task[None]) -> None:
    """Background sends to dead peers fail; that is expected and not an error of the step."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("background send failed: %s", task.exception())


def _bind_for(master_addr: str) -> str:
    """Rank 0 listens on the rendezvous address if it is a loopback one, else on all interfaces."""
    loopback = master_addr.startswith("127.") or master_addr == "localhost"
    return master_addr if loopback else "0.0.0.0"
