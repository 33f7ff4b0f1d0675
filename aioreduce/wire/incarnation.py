"""Which process of each rank this one talks to: incarnations, judged per handshake (sans-IO).

A rank's process that dies can be replaced by a new one (restarted by the launcher, an engine,
or by hand: same rank, maybe another host and port). Each process of a rank is one
*incarnation*: 0 for the processes the job started with, one more for each replacement. Rank 0
hands them out: every other process starts as :data:`JOINING` and learns its incarnation
from rank 0's address table at the rendezvous; a process that registers while the job runs
is a replacement and gets the next number (rank 0 tells every rank, see
:class:`~aioreduce.wire.control.Moved`). A rank-0 process is :data:`JOINING` too until its
rendezvous says whether the job starts (0) or runs: a live rank that dials it then sends it
the job's table (:class:`~aioreduce.wire.control.Running`), and it takes rank 0's next number
(:meth:`Incarnations.resume`) and tells every rank.

Every handshake carries both sides' incarnations (bound into the proofs), and
:class:`Incarnations` says what to do with the peer's claim:

* the one we know: carry on;
* a newer one: the old process is gone; forget whatever of it is still here (its staged
  frames) before the new one's first frame, so none is mixed into the new one's steps;
* an older one: a process that was replaced and still runs (it was cut off, not dead): refuse
  it and say so on every rank;
* joining, at rank 0 while the job runs: a replacement registering; give it the next number.
  Joining anywhere else: refused (a process learns its peers' addresses only from rank 0).
  A listener that is still joining (rank 0 told the others where it listens an instant before
  it told it its number) is taken as it is: it has sent nothing yet.

A second *live* process claiming a rank is the mesh's own check (two connections dialed by one
rank at once), made before this one.
"""

from __future__ import annotations

from dataclasses import dataclass

JOINING = -1  # a process that has not registered with rank 0 yet


@dataclass(frozen=True)
class Same:
    """The incarnation we know: carry on."""


@dataclass(frozen=True)
class Newer:
    """``rank``'s process was replaced by incarnation ``incarnation``: drop the old one's
    frames, then carry on."""

    rank: int
    incarnation: int


@dataclass(frozen=True)
class Stale:
    """A replaced process of ``rank`` (incarnation ``claimed``, we know ``known``): refuse it
    and name it on every rank."""

    rank: int
    claimed: int
    known: int

    def text(self, where: str) -> str:
        return (f"a replaced process of rank {self.rank} (incarnation {self.claimed}, the job "
                f"runs incarnation {self.known}) connected from {where} and was refused: stop "
                "it, its rank runs elsewhere")


@dataclass(frozen=True)
class Unregistered:
    """A joining process dialed a rank other than 0: refuse it."""

    rank: int


Judgement = Same | Newer | Stale | Unregistered


class Incarnations:
    """One process's view of every rank's current incarnation (see the module docstring)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.mine = 0  # JOINING from the rendezvous's start until rank 0's table (rank > 0)
        self.known = [0] * world_size
        self.running = False  # rank 0: the rendezvous is over, a joining process replaces one

    def judge(self, rank: int, claimed: int, *, dialed: bool = False) -> Judgement:
        """What to do with a handshake in which ``rank`` claims incarnation ``claimed``
        (``dialed``: we dialed it, it listens); the decision is applied: a newer incarnation
        is known from now on."""
        stale = self.stale(rank, claimed)
        if stale is not None:
            return stale
        known = self.known[rank]
        if claimed == JOINING:
            if dialed:  # rank 0 told us where it listens before it told it its number
                return Same()
            if self.rank != 0:
                return Unregistered(rank)
            if not self.running:
                return Same()  # the job's start: everyone is incarnation 0
            claimed = known + 1
        if claimed > known:
            self.known[rank] = claimed
            return Newer(rank, claimed)
        return Same()

    def stale(self, rank: int, claimed: int) -> Stale | None:
        """Is ``claimed`` an older incarnation of ``rank`` than we know? (Checked before any
        other judgement: a replaced process that comes back is named as what it is.)"""
        known = self.known[rank]
        return Stale(rank, claimed, known) if JOINING < claimed < known else None

    def learn(self, table: tuple[int, ...]) -> None:
        """Rank 0's address table: every rank's incarnation, ours among them."""
        for r, inc in enumerate(table):
            self.known[r] = max(self.known[r], inc)
        if self.rank < len(table):
            self.mine = table[self.rank]

    def resume(self, table: tuple[int, ...]) -> None:
        """This process replaces a dead rank 0 in a running job whose incarnations (a live
        rank's view) are ``table``: it is rank 0's next one, and hands out numbers from now."""
        self.learn(table)
        self.mine = self.known[self.rank] = self.known[self.rank] + 1
        self.running = True

    @property
    def rejoined(self) -> bool:
        """Is this process a replacement (it joined a running job)?"""
        return self.mine > 0
