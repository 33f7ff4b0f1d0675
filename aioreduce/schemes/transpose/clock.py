"""How long a transpose stage may take: warm-up, then an adaptive bound agreed across ranks.

A pure state machine (no IO, no clock of its own): the session reports each stage's elapsed
time and received fraction, and the estimates its peers piggyback on their frames.

* **Warm-up** (the first ``warmup`` stages): stages wait for everything (``reliable``); their
  completion times set this rank's bound, ``bound = P95``.
* **Then**: ``estimate`` is an EWMA of ``elapsed / received_fraction`` (floating point; a
  stage cut at 3/4 of its data needed about 4/3 of its time). The stage deadline is
  ``slack × median(estimates of all ranks)``, clamped to ``[min_deadline, median(bounds)]``.
  The median keeps one slow rank from stretching everyone's deadline.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np


@dataclass
class StageClock:
    """One rank's view of the stage deadline."""

    warmup: int = 10
    slack: float = 1.5
    min_deadline: float = 0.01
    weight: float = 0.2  # EWMA weight of the newest stage
    fixed: float | None = None  # a fixed deadline: no warm-up, no adaptation
    samples: list[float] = field(default_factory=list)
    bound: float | None = None
    estimate: float | None = None
    peers: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> (est, bound)

    @property
    def reliable(self) -> bool:
        """True while stages wait for everything (warm-up)."""
        return self.fixed is None and self.bound is None

    def deadline(self) -> float | None:
        """Seconds the next stage may take; None while warming up (wait for everything)."""
        if self.fixed is not None:
            return self.fixed
        if self.bound is None or self.estimate is None:
            return None
        estimates = [self.estimate] + [e for e, _b in self.peers.values()]
        bounds = [self.bound] + [b for _e, b in self.peers.values()]
        agreed_bound = statistics.median(bounds)
        return min(max(self.slack * statistics.median(estimates), self.min_deadline),
                   max(agreed_bound, self.min_deadline))

    def observe(self, elapsed: float, fraction: float) -> None:
        """Record one stage: ``elapsed`` seconds, ``fraction`` of its data received."""
        if self.fixed is not None:
            return
        if self.bound is None:
            self.samples.append(elapsed)
            if len(self.samples) >= self.warmup:
                self.bound = float(np.percentile(self.samples, 95))
                self.estimate = float(np.mean(self.samples))
            return
        scaled = elapsed / max(fraction, 0.05)
        assert self.estimate is not None
        self.estimate = (1 - self.weight) * self.estimate + self.weight * scaled

    def heard(self, rank: int, estimate: object, bound: object) -> None:
        """A peer's piggybacked estimate and bound (ignored unless both are numbers > 0)."""
        if (isinstance(estimate, float) and isinstance(bound, float)
                and 0 < estimate < 1e6 and 0 < bound < 1e6):
            self.peers[rank] = (estimate, bound)

    def advert(self) -> dict[str, float]:
        """What this rank piggybacks on its frames (nothing while warming up)."""
        if self.fixed is not None or self.bound is None or self.estimate is None:
            return {}
        return {"tc": self.estimate, "tb": self.bound}
