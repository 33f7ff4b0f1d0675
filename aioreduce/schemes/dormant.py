"""A kept session's comm: while another scheme runs, it hears only about its own steps.

``Node.use(scheme, keep=True)`` keeps the old session alive (a benchmark alternating schemes
keeps each one's learned state). Its early handlers stay installed on the same mesh, and every
scheme numbers its frames by the node's step and sends them from the same ranks (rank 0 is the
root of the tree, the star's master and a ring member), so without a gate a kept session takes
the running scheme's frames for its own: a coded tree's parent forwarding gradient coding's
results to its tree children, say, work and traffic in the middle of another scheme's step.

The gate lets a dormant session hear frames of the steps it ran (a late child's request for a
result it holds is still answered), not of later ones, which belong to whatever scheme ran
them. Receives it posts are unaffected: a dormant session posts none.

Every session runs behind a gate, kept or not, for a second reason: ranks switch schemes at
the same step but not at the same moment. A peer that switched first sends frames of the new
session's steps while this rank still runs the old one (or sleeps the kept one): they are
staged, and without an early handler to hear them they were heard by nobody. A ring's abort
(the step failed on the other side) was one: the rank that missed it waited forever. So a
session's handlers are installed with the staged frames of its own steps replayed to them,
when it opens and when it wakes.
"""

from __future__ import annotations

from collections.abc import Callable

from ..wire import Header
from .base import Comm, CommWrapper, EarlyHandler


class _Registration:
    """One early handler a session installed through the gate, re-installable on waking."""

    def __init__(self, rank: int, min_tag: int, handler: EarlyHandler) -> None:
        self.rank, self.min_tag, self.handler = rank, min_tag, handler
        self.remove_inner: Callable[[], None] = _nothing


def _nothing() -> None:
    pass


class GatedComm(CommWrapper):
    """A session's :class:`~.base.Comm`: its early handlers hear the steps from
    ``first_step`` on (frames already staged for those included, as peers may have started
    them before this rank opened the session) until the session is put to sleep, and again
    from the step it wakes at."""

    def __init__(self, inner: Comm, first_step: int | None = None) -> None:
        super().__init__(inner)
        self.first_step = first_step
        # Steps from this one on are not this session's (None: it is the running session).
        self.dormant_from: int | None = None
        self._registered: list[_Registration] = []

    def sleep(self, step: int) -> None:
        """Another scheme runs from ``step`` on: its frames are not this session's."""
        self.dormant_from = step

    def wake(self, step: int) -> None:
        """The session runs again from ``step``. Its handlers are installed anew, so that
        frames of ``step`` on that peers sent while it slept (they woke it first) reach it."""
        self.dormant_from = None
        for reg in self._registered:
            reg.remove_inner()
            reg.remove_inner = self._install(reg, since=step)

    def _install(self, reg: _Registration, since: int | None) -> Callable[[], None]:
        def gated(header: Header, payload: memoryview) -> None:
            if self.dormant_from is None or header.step < self.dormant_from:
                reg.handler(header, payload)

        return self.inner.on_early(reg.rank, reg.min_tag, gated, since=since)

    def on_early(self, rank: int, min_tag: int, handler: EarlyHandler, *,
                 since: int | None = None) -> Callable[[], None]:
        """Install ``handler`` behind the gate; staged frames are replayed from ``since`` or,
        if not given, from the session's first step."""
        reg = _Registration(rank, min_tag, handler)
        reg.remove_inner = self._install(reg, self.first_step if since is None else since)
        self._registered.append(reg)

        def remove() -> None:
            reg.remove_inner()
            if reg in self._registered:
                self._registered.remove(reg)

        return remove
