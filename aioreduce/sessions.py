"""The scheme sessions of one node: the running one, and those kept to be resumed.

Each session runs behind a gate (:class:`~aioreduce.schemes.dormant.GatedComm`) that keeps its
handlers to its own steps, so a kept session ignores the frames of the steps another scheme
runs meanwhile, and wakes at the step it is resumed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import numpy as np

from .schemes import CodedScheme, Scheme, Session
from .schemes.base import Comm, Reforms, Rejoins
from .schemes.dormant import GatedComm
from .transport import Mesh

log = logging.getLogger("aioreduce")


class Sessions:
    """The running session (:attr:`current`, of :attr:`scheme`) and the kept ones."""

    def __init__(self, comm: Callable[[], Comm]) -> None:
        self._comm = comm  # a new session's comm (the mesh, counted when tracing)
        self.scheme: Scheme | None = None
        self.current: Session | None = None
        self._gate: GatedComm | None = None
        self._kept: list[tuple[Scheme, Session, GatedComm]] = []
        self._holders: tuple[Scheme, int] | None = None  # see data_holders

    def data_holders(self, world_size: int) -> int:
        """How many ranks hold data under the (coded) scheme: what ``op="mean"`` divides
        by. Computed once per scheme."""
        scheme = self.scheme
        assert isinstance(scheme, CodedScheme)
        if self._holders is None or self._holders[0] is not scheme:
            count = sum(1 for r in range(world_size)
                        if len(scheme.placement(r, scheme.min_samples)[0]))
            self._holders = (scheme, count)
        return self._holders[1]

    def open(self, scheme: Scheme, step: int) -> None:
        """Run ``scheme`` from ``step`` on: a kept session of an equal scheme resumes, else a
        new one opens."""
        self.scheme = scheme
        kept = next((i for i, (s, _, _) in enumerate(self._kept) if s == scheme), None)
        if kept is not None:
            _scheme, self.current, self._gate = self._kept.pop(kept)
            self._gate.wake(step)
        else:
            self._gate = GatedComm(self._comm(), first_step=step)
            self.current = scheme.open(self._gate)

    def pick(self, scheme: Scheme | str | None, rank: int, world_size: int) -> None:
        """The node's scheme argument: a scheme (checked against the world size), "auto"
        (chosen at the first step) or None."""
        if isinstance(scheme, str) and scheme != "auto":
            raise ValueError(f"rank {rank}: scheme must be a Scheme or 'auto', not {scheme!r} "
                             "(by name: aioreduce.schemes.by_name)")
        if scheme is not None and not isinstance(scheme, str):
            scheme.validate(world_size)
            self.scheme = scheme

    def require(self, rank: int, *, coded: bool) -> Scheme:
        """The running scheme, if it is a coded one (``coded``) or not; else a clear error
        for the caller of ``aggregate()`` / ``allreduce()`` on ``rank``."""
        if self.scheme is None or self.current is None:
            raise RuntimeError(f"rank {rank}: this node has no scheme (pass scheme=... and "
                               "enter the node first)")
        if self.scheme.coded != coded:
            what = "aggregate() with a coded vector" if self.scheme.coded else "allreduce()"
            raise TypeError(f"rank {rank}: {type(self.scheme).__name__} is used through "
                            f"{what}")
        return self.scheme

    def placement(self, rank: int, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, weights) ``rank`` computes its coded gradient on (see
        ``Node.placement``); a clear error if the running scheme is not coded."""
        scheme = self.require(rank, coded=True)
        assert isinstance(scheme, CodedScheme)
        return scheme.placement(rank, num_samples)

    def rejoined(self, step: int, members: tuple[int, ...] | None = None, *,
                 taken_back: bool = False) -> None:
        """This process replaced a dead rank and starts at ``step``, in a ring over
        ``members`` if it healed into one (``taken_back``: one that ran without it, whose
        members change at ``step``): tell the session."""
        if members is not None and isinstance(self.current, Reforms):
            self.current.reform(members, joined=taken_back)
        if isinstance(self.current, Rejoins):
            self.current.rejoined(step)

    def members(self) -> tuple[int, ...] | None:
        """The ranks the running session's steps run over, for a session that can re-form
        (a ring); None for any other."""
        current = self.current
        return current.members if isinstance(current, Reforms) else None

    async def leave(self, step: int, *, keep: bool, timeout: float) -> None:
        """Stop running the current session at ``step``: keep it (asleep) or close it."""
        session, self.current = self.current, None
        if session is None:
            return
        if keep and self.scheme is not None and self._gate is not None:
            self._gate.sleep(step)  # the steps from here are not its own
            self._kept.append((self.scheme, session, self._gate))
        else:
            await session.close(timeout)

    async def close(self, timeout: float) -> None:
        """Close every session, kept ones too (each finishes its background sends first)."""
        sessions = [s for _scheme, s, _gate in self._kept]
        self._kept.clear()
        if self.current is not None:
            sessions.append(self.current)
            self.current = None
        for session in sessions:
            await session.close(timeout)


async def preconnect(mesh: Mesh, scheme: Scheme | None) -> None:
    """Open ``scheme``'s connections now, in parallel, instead of inside the first steps.
    Each link is dialed by its lower rank, so every pair gets one connection; a process that
    replaced a dead rank dials every neighbour (their connections to the dead one broke)."""
    if scheme is None:
        return
    rank = mesh.rank
    peers = [p for p in scheme.neighbours(rank, mesh.world_size)
             if p > rank or mesh.incarnations.rejoined]
    results = await asyncio.gather(*(mesh.connect(p) for p in peers), return_exceptions=True)
    for p, r in zip(peers, results, strict=True):
        if isinstance(r, BaseException):  # the step will dial again and report it
            log.warning("rank %d: could not pre-connect to rank %d: %s", rank, p, r)
