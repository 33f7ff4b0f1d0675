"""The outcomes a rank keeps for the ranks it serves: a bounded window of recent steps."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .report import Report, Verdict


@dataclass(frozen=True)
class Outcome:
    """What one step came to: a value with its report, or a verdict."""

    step: int
    value: np.ndarray | None = None
    bounds: tuple[tuple[int, int], ...] = ()
    report: Report | None = None
    verdict: Verdict | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.value is None else int(self.value.nbytes)


class ResultLog:
    """Outcomes of recent steps, oldest evicted first once over ``max_bytes`` (the last
    ``min_steps`` are always kept). A rank that asks for an evicted step fell behind."""

    def __init__(self, max_bytes: int, min_steps: int = 2) -> None:
        self.max_bytes = max_bytes
        self.min_steps = min_steps
        self._log: OrderedDict[int, Outcome] = OrderedDict()
        self._bytes = 0
        self.evicted_up_to = -1  # every step <= this one is gone

    def add(self, outcome: Outcome) -> None:
        if outcome.step in self._log or outcome.step <= self.evicted_up_to:
            return
        self._log[outcome.step] = outcome
        if len(self._log) > 1 and outcome.step < next(reversed(self._log)):
            self._log = OrderedDict(sorted(self._log.items()))  # arrived out of order
        self._bytes += outcome.nbytes
        while len(self._log) > self.min_steps and self._bytes > self.max_bytes:
            step, old = self._log.popitem(last=False)
            self._bytes -= old.nbytes
            self.evicted_up_to = max(self.evicted_up_to, step)

    def get(self, step: int) -> Outcome | None:
        return self._log.get(step)

    def since(self, step: int) -> list[Outcome]:
        """Kept outcomes of ``step`` and later, oldest first."""
        return [o for s, o in self._log.items() if s >= step]

    def too_old(self, step: int) -> bool:
        return step <= self.evicted_up_to

    @property
    def latest(self) -> int:
        """The newest step with a known outcome (-1 if none)."""
        return next(reversed(self._log), self.evicted_up_to)

    @property
    def nbytes(self) -> int:
        return self._bytes
