"""Healing a replacement process: the job's step and the program's state from a live peer.

A process that replaces a dead rank joins the running job (rank 0 gives it a new incarnation,
see :mod:`aioreduce.wire.incarnation`) and then needs what the dead one had: the job's step and
whatever state the program keeps (model, optimizer). It asks a live peer (:class:`HealAsk`);
the peer answers at its next step boundary, where its state is that of every step before it:
it calls the program's :attr:`StateHooks.state` and sends the step and the blob, in pieces, in
the background (the peer's steps go on). The newcomer hands the blob to
:attr:`StateHooks.load_state` and starts at that step; the steps the job ran meanwhile come
from the scheme's result window like a paused rank's (see :mod:`aioreduce.schemes.reduce`).

A program without state hooks heals the step alone (its data is a function of the step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import PeerLost
from .wire import tags
from .wire.control import HealAsk

if TYPE_CHECKING:
    from .transport import Mesh

log = logging.getLogger("aioreduce")

PIECE = 64 << 20  # bytes of the state per frame
EMPTY = np.empty(0, np.uint8)


@dataclass(frozen=True)
class StateHooks:
    """What a program gives a node so a replacement of one of its ranks can heal.

    ``state()`` is called on a live rank at a step boundary (on the node's event loop) and
    returns the program's state as bytes or a numpy array it will not change afterwards;
    ``load_state(blob)`` is called on the replacement with those bytes before its first step.
    """

    state: Callable[[], bytes | bytearray | memoryview | np.ndarray]
    load_state: Callable[[memoryview], None]


class Healer:
    """One node's side of healing: serving peers that ask, and asking (see the module
    docstring)."""

    def __init__(self, mesh: Mesh, hooks: StateHooks | None, timeout: float,
                 neighbours: Callable[[], list[int]]) -> None:
        self.mesh, self.hooks, self.timeout = mesh, hooks, timeout
        self._neighbours = neighbours  # the scheme's: the first peers to ask
        self._asked: dict[int, HealAsk] = {}  # rank -> its request, served at the next boundary
        self._tickets = 0  # our requests so far: each one's replies travel on its own key
        self.served = 0  # heals answered (for tests and logs)
        mesh.on_heal = self._ask

    def _ask(self, rank: int, ask: HealAsk) -> None:
        if ask.incarnation == self.mesh.incarnations.known[rank]:  # not a replaced process's
            self._asked[rank] = ask

    def serve(self, step: int) -> None:
        """A step boundary (``step`` is about to run): answer every rank that asked."""
        if not self._asked:
            return
        asked, self._asked = self._asked, {}
        blob = self._blob()
        meta = {"step": step, "nbytes": blob.nbytes, "barriers": self.mesh.barriers}
        for rank, ask in asked.items():
            log.info("rank %d: healing rank %d (incarnation %d) at step %d, %d bytes",
                     self.mesh.rank, rank, ask.incarnation, step, blob.nbytes)
            self.mesh.spawn(self._send(rank, ask.ticket, meta, blob))

    def _blob(self) -> np.ndarray:
        if self.hooks is None:
            return EMPTY
        state = self.hooks.state()
        if isinstance(state, np.ndarray):
            return np.ascontiguousarray(state).reshape(-1).view(np.uint8)
        return np.frombuffer(state, np.uint8)

    async def _send(self, rank: int, ticket: int, meta: dict[str, Any],
                    blob: np.ndarray) -> None:
        try:
            await self.mesh.send(rank, EMPTY, step=ticket, tag=tags.HEAL, meta=meta)
            for i, lo in enumerate(range(0, blob.nbytes, PIECE)):
                await self.mesh.send(rank, blob[lo:lo + PIECE], step=ticket,
                                     tag=tags.HEAL + 1 + i)
            self.served += 1
        except PeerLost as exc:
            log.warning("rank %d: rank %d went away while healing: %s", self.mesh.rank, rank,
                        exc)

    async def heal(self) -> int:
        """Ask the first peer that answers (see :func:`sources`) for the job's step and state,
        each within the timeout; load the state (and the barrier count) and return the step."""
        mesh, timeout = self.mesh, self.timeout
        failures = []
        for source in sources(mesh.rank, mesh.world_size, self._neighbours()):
            ticket = self._tickets
            self._tickets += 1
            try:
                await mesh.send_control(source, HealAsk(mesh.incarnations.mine, ticket))
                head = await mesh.recv_into(source, EMPTY, step=ticket, tag=tags.HEAL,
                                            timeout=timeout)
                step, nbytes, barriers = (head.meta.get(k) for k in ("step", "nbytes",
                                                                     "barriers"))
                if type(step) is not int or type(nbytes) is not int or nbytes < 0:
                    raise PeerLost(source, "sent a malformed heal")
                blob = np.empty(nbytes, np.uint8)
                for i, lo in enumerate(range(0, nbytes, PIECE)):
                    await mesh.recv_into(source, blob[lo:lo + PIECE], step=ticket,
                                         tag=tags.HEAL + 1 + i, timeout=timeout)
            except (PeerLost, TimeoutError) as exc:
                failures.append(f"rank {source}: {exc}")
                continue
            if self.hooks is not None:
                self.hooks.load_state(blob.data)
            if type(barriers) is int:
                mesh.barriers = barriers
            log.warning("rank %d (incarnation %d) healed from rank %d at step %d, %d bytes",
                        mesh.rank, mesh.incarnations.mine, source, step, nbytes)
            return step
        raise PeerLost(mesh.rank, "no live peer healed this rank: " + "; ".join(failures))


def sources(rank: int, world_size: int, neighbours: list[int]) -> list[int]:
    """The peers to heal from, in order: the scheme's neighbours (a tree rank's parent
    first), then every other rank."""
    near = sorted(neighbours)
    return [*near, *(r for r in range(world_size) if r != rank and r not in near)]
