"""Run a scheme's sessions on every rank of an in-memory network, one step at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import numpy as np

from aioreduce.schemes import CodedScheme, Result, Scheme, Session
from aioreduce.schemes.base import Comm
from aioreduce.transport.memory import MemoryNetwork

DIM = 6


class Job:
    """Every rank's session of ``scheme``; vectors are deterministic per (rank, step)."""

    def __init__(self, scheme: Scheme, world: int, net: MemoryNetwork | None = None,
                 comms: Sequence[Comm] | None = None, dim: int = DIM) -> None:
        self.scheme, self.world, self.dim = scheme, world, dim
        self.net = net or MemoryNetwork(world)
        self.sessions: list[Session] = [scheme.open(c) for c in comms or self.net.comms]
        self.coded = isinstance(scheme, CodedScheme)
        if self.coded:
            assert isinstance(scheme, CodedScheme)
            self.samples = 2 * getattr(scheme, "min_samples", 0) or 2 * scheme.code.k  # type: ignore[attr-defined]
            self.place = [scheme.placement(r, self.samples) for r in range(world)]

    def data(self, step: int) -> np.ndarray:
        return np.random.default_rng([7, step]).standard_normal((self.samples, self.dim))

    def vector(self, rank: int, step: int) -> np.ndarray:
        if self.coded:
            ids, w = self.place[rank]
            return w @ self.data(step)[ids] if len(ids) else np.zeros(self.dim)
        return np.random.default_rng([rank, step]).standard_normal(self.dim)

    def truth(self, step: int) -> np.ndarray:
        if self.coded:
            return self.data(step).sum(axis=0)
        return sum(self.vector(r, step) for r in range(self.world))  # type: ignore[return-value]

    def start(self, step: int, ranks: Iterable[int]) -> dict[int, asyncio.Task[Result]]:
        """Start ``step`` on ``ranks``; a task per rank."""
        async def one(rank: int) -> Result:
            own: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
            own.set_result(self.vector(rank, step))
            return await self.sessions[rank].step(step, np.zeros(self.dim), own)
        return {r: asyncio.ensure_future(one(r)) for r in ranks}

    async def run(self, step: int, ranks: Iterable[int] | None = None
                  ) -> dict[int, Result | BaseException]:
        tasks = self.start(step, range(self.world) if ranks is None else ranks)
        await asyncio.wait(tasks.values())
        return {r: (t.exception() or t.result()) for r, t in tasks.items()}

    def assert_exact(self, step: int, results: dict[int, Result | BaseException]) -> None:
        want = self.truth(step)
        reports = set()
        for rank, res in results.items():
            assert isinstance(res, Result), (rank, res)
            assert res.step == step and res.exact, (rank, res)
            np.testing.assert_allclose(res.value, want, rtol=1e-9, atol=1e-9,
                                       err_msg=f"rank {rank} step {step}")
            reports.add((tuple(res.used), tuple(res.late)))
        assert len(reports) == 1, f"ranks disagree on step {step}: {reports}"

    async def close(self) -> None:
        await asyncio.gather(*(s.close(1.0) for s in self.sessions))
