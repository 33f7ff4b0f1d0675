"""Where a rank takes each step's result from: its parent, or its grandparent too.

A pure state machine (no IO, no clock): the session feeds it events and carries out the
requests it returns. Drawn::

              parent silent past the deadline
    HEALTHY ───────────────────────────────────▶ SILENT ──(grandparent answered)──▶ BYPASSED
       ▲  ▲                                        │                                  │
       │  └───────────(parent answered)────────────┘                                  │
       │  └──────────(parent answered, even after the grandparent: a probe)───────────┘
       │                                                                               ▲
       │                 connection to the parent broke                                │
       └── (parent answered) ── LOST ───────(connection is back)───────────────────────┘

* HEALTHY: wait for the parent only.
* SILENT: the parent said nothing for a deadline this step: ask both it (we may be the one
  who was paused, and missed results it skipped) and the grandparent, from this step on.
* BYPASSED: the grandparent served us; from now on it is asked at the start of every step,
  while the parent's answer is still awaited (a probe). The first step the parent answers
  again, we are HEALTHY: a parent that paused and resumed is used normally again.
* LOST: the parent's connection broke; the grandparent is asked at every step start.

Asking means sending a request "the outcomes from step S on": the asked rank answers from its
window of recent results, or at once with FellBehind when S is older than that window.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Link(enum.Enum):
    HEALTHY = "healthy"
    SILENT = "silent"
    BYPASSED = "bypassed"
    LOST = "lost"


@dataclass(frozen=True)
class Ask:
    """Send ``rank`` a request for the outcomes from ``step`` on."""

    rank: int
    step: int


class ParentFailover:
    """The failover machine of one rank (see the module docstring)."""

    def __init__(self, parent: int, grandparent: int | None) -> None:
        self.parent = parent
        self.grandparent = grandparent
        self.state = Link.HEALTHY
        self.transitions: list[tuple[Link, Link, str]] = []  # for logs and tests
        self._asked: set[Ask] = set()

    def _go(self, state: Link, why: str) -> None:
        if state is not self.state:
            self.transitions.append((self.state, state, why))
            self.state = state

    def _ask(self, rank: int | None, step: int) -> list[Ask]:
        if rank is None:
            return []
        ask = Ask(rank, step)
        if ask in self._asked:
            return []
        self._asked = {a for a in self._asked if a.step >= step}  # forget older steps
        self._asked.add(ask)
        return [ask]

    @property
    def uses_grandparent(self) -> bool:
        """Is the grandparent a source of results right now?"""
        return self.state is not Link.HEALTHY and self.grandparent is not None

    # -- events -------------------------------------------------------------------------------
    def step_started(self, step: int) -> list[Ask]:
        if self.state in (Link.BYPASSED, Link.LOST):
            return self._ask(self.grandparent, step)
        if self.state is Link.SILENT:  # a silent step ended without an answer from anyone
            self._go(Link.HEALTHY, "new step")
        return []

    def deadline_passed(self, step: int) -> list[Ask]:
        if self.state is Link.LOST:
            return self._ask(self.grandparent, step)
        if self.state is Link.HEALTHY:
            self._go(Link.SILENT, f"no result for step {step} within the deadline")
        return self._ask(self.parent, step) + self._ask(self.grandparent, step)

    def parent_lost(self, step: int) -> list[Ask]:
        self._go(Link.LOST, "connection broke")
        return self._ask(self.grandparent, step)

    def parent_back(self) -> None:
        if self.state is Link.LOST:
            self._go(Link.BYPASSED, "connection is back")

    def answered(self, rank: int, step: int) -> None:
        """``rank`` delivered the whole outcome of ``step`` (first or not)."""
        if rank == self.parent:
            self._go(Link.HEALTHY, f"parent answered step {step}")
        elif rank == self.grandparent and self.state is Link.SILENT:
            self._go(Link.BYPASSED, f"grandparent answered step {step}")
