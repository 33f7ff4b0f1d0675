"""How long a transpose stage may take: warm-up, then an adaptive bound agreed across ranks.

A pure state machine (no IO, no clock of its own): the session reports each stage's elapsed
time and received fraction, and the proposals its peers piggyback on their frames.

* **Warm-up** (the first ``warmup`` stages): stages wait for everything (``reliable``); their
  completion times set this rank's ceiling, ``bound = headroom × P95``. (The P95 alone cuts
  one stage in twenty by construction, and a step waits for ``2(N-1)`` arrivals: on a busy
  machine that cut a quarter of all steps. The ceiling is for the tail, not the body.) The
  ceiling rises to ``headroom`` × the longest of the recent complete stages since warm-up
  where that is more: with one set by warm-up alone, a network that slowed down later (4
  emulated hosts with 2 background flows, whose queues filled over some 200 steps: steps
  from 37 to 95 ms) cut every stage at it (the losses: docs/transpose.md "Deadlines").
* **Then**, as TCP sets its retransmission timeout (RFC 6298): an EWMA of the completion time
  ``estimate`` and an EWMA of its deviation; this rank proposes ``estimate + slack ×
  deviation``. A stage cut at 3/4 of its data counts as ``elapsed / 0.75`` (floating point;
  the public OptiReduce code divides integers here); one cut while a sender had sent nothing
  counts as the time the others took (a straggler's lateness is not the network's). The
  deadline is the median of every rank's proposal, clamped to ``[min_deadline, median of the
  ceilings]``: the median keeps one slow rank from stretching everyone's deadline. Until a
  rank has heard a peer's proposal (they ride on the first adaptive step's frames) it uses its
  ceiling. (A mean-based proposal, ``2 × estimate``, sat below the P90 of stage times when 4
  ranks shared 2 cores and cut a fifth of all steps; the deviation term follows the jitter
  instead.)
* **A floor from recent stages**: the proposal is at least ``recent_margin`` × the longest of
  the last ``recent`` stages that completed (warm-up's included). Calm stages over shaped
  links have a tail the deviation misses, and it cut calm steps (figures in
  docs/transpose.md). A stage cut by its deadline is not among them, so a straggler does not
  raise the floor; one that completed late does, for ``recent`` stages, never past the
  ceiling. The margin is 1.5: with 1.25, 4 ranks on 2 cores, 16 MiB in place, the median
  stage 1 took 0.48 of its deadline and one in a thousand reached it (a stall of the shared
  machine), which cut calm steps in 5 of 17 runs; with 1.5, none in 8 (2026-11-28).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class StageClock:
    """One rank's view of one stage's deadline."""

    warmup: int = 10
    slack: float = 4.0  # deviations above the estimate (RFC 6298 uses 4)
    headroom: float = 2.0
    min_deadline: float = 0.02
    gain: float = 1 / 8  # EWMA weight of the newest stage in the estimate
    deviation_gain: float = 1 / 4
    fixed: float | None = None  # a fixed deadline: no warm-up, no adaptation
    samples: list[float] = field(default_factory=list)
    bound: float | None = None
    estimate: float | None = None
    deviation: float = 0.0
    peers: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> (prop, bound)
    recent_margin: float = 1.5
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=32))  # complete stages
    # The complete stages among those since warm-up (whose outliers its P95 leaves out).
    settled: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    # The senders late to start in each of the last stages (see observe): one late in at
    # least ``slow_share`` of them is slow as a rule, and the stage's pace is its pace.
    # Three quarters, not half: where a random rank pauses at every step (the straggler
    # soak's pause model), one of 4 was late in 4 of 8 stages by chance within a few dozen
    # steps, its pauses then counted whole and the floor rose past every pause; 6 of 8 by
    # chance is some 25 times rarer, and a slower machine, late every time, still
    # counts from its seventh stage.
    late_history: deque[frozenset[int]] = field(default_factory=lambda: deque(maxlen=8))
    slow_share: float = 0.75

    @property
    def reliable(self) -> bool:
        """True while stages wait for everything (warm-up)."""
        return self.fixed is None and self.bound is None

    @property
    def ceiling(self) -> float | None:
        """This rank's cap on a stage's deadline (None while warming up): ``headroom`` x the
        warm-up's P95, or ``headroom`` x the longest of the recent complete stages since
        then where that is more. A network that slows down after warm-up (links filling with
        other tenants' traffic) raises it with the stages that still complete; a stage cut by its
        deadline does not, so a straggler that is cut never does."""
        if self.bound is None:
            return None
        return max(self.bound, self.headroom * max(self.settled, default=0.0))

    @property
    def proposal(self) -> float | None:
        """The deadline this rank would choose alone."""
        if self.estimate is None:
            return None
        floor = self.recent_margin * max(self.recent, default=0.0)
        return max(self.estimate + self.slack * self.deviation, floor)

    def deadline(self) -> float | None:
        """Seconds the next stage may take; None while warming up (wait for everything)."""
        if self.fixed is not None:
            return self.fixed
        mine, bound = self.proposal, self.ceiling
        if bound is None or mine is None:
            return None
        if not self.peers:
            # The first step after warm-up: the peers' proposals ride on its own frames, so
            # none is known yet when its bound is set. Alone, one rank whose warm-up stages
            # were quick would cut the others at its own estimate (4 ranks on 2 cores: a rank
            # at 35 ms beside others at 40-56 cut a fifth of one rank's data); the ceiling
            # until then.
            return max(bound, self.min_deadline)
        proposals = [mine] + [p for p, _b in self.peers.values()]
        ceiling = max(statistics.median([bound] + [b for _p, b in self.peers.values()]),
                      self.min_deadline)
        return min(max(statistics.median(proposals), self.min_deadline), ceiling)

    def observe(self, elapsed: float, fraction: float, others: float | None = None,
                late: frozenset[int] = frozenset()) -> None:
        """Record one stage: ``elapsed`` seconds, ``fraction`` of its data received.

        ``others``: for a stage with a sender that had sent nothing when it was cut, or (one
        that completed) when every other sender was in (late to start, paused; see
        :meth:`Stage.others_took` and :meth:`Stage.late_start`), the seconds the others
        needed (None: no such sender); ``late``: those senders. The clock learns that, not
        ``elapsed / fraction``, which measures how long the stage waited for the straggler
        (its deadline), not how long the network needs: in the tail row each spike, cut at
        its deadline, raised the next ten or so bounds from about 16 ms to 24 (and a spike
        among them paid that).

        A straggler that completed (in warm-up, or under a bound it fitted) is left out of
        the warm-up's P95, the recent stages and the ceiling's the same way. Counted, one
        straggler raised the floor to ``recent_margin`` x its lateness for the next
        ``recent`` stages, every straggler in them completed under it and raised it again,
        and with stragglers in one step of ten no step was bounded at all (figures in
        docs/transpose.md, "Stragglers that complete"). Two kinds of late sender count whole:
        one merely behind the others (by at most their time again plus ``min_deadline``: the
        ranks' skew, which stage 1 absorbs), and one late past that skew (or cut while
        silent) in ``slow_share`` of the last stages (a slower machine, not a straggler: the
        bound follows it, as it follows a slower network, instead of cutting it every
        step)."""
        if self.fixed is not None:
            return
        skew = (others is not None and fraction >= 1.0
                and elapsed <= 2 * others + self.min_deadline)
        usual = self._usually_late(late)
        # Only a sender late past the skew goes into the history: in quick stages one
        # sender or another starts last by a millisecond nearly every time, and counted,
        # such noise plus a few real pauses made a rank "slow" (4 ranks, a random one paused
        # 0.3-0.5 s each step): its pauses counted whole, the floor rose past them, and no
        # step was bounded again (docs/transpose.md "Stragglers that complete").
        self.late_history.append(frozenset() if skew else late)
        if usual or skew:
            others = None
        took = others if others is not None and fraction >= 1.0 else elapsed
        if fraction >= 1.0:
            self.recent.append(took)
            if self.bound is not None:
                self.settled.append(took)
        if self.bound is None:
            self.samples.append(took)
            if len(self.samples) >= self.warmup:
                mean = statistics.fmean(self.samples)
                self.bound = self.headroom * _p95(self.samples)
                self.estimate = mean
                self.deviation = statistics.fmean(abs(t - mean) for t in self.samples)
            return
        assert self.estimate is not None
        scaled = others if others is not None else elapsed / max(fraction, 0.05)
        self.deviation += self.deviation_gain * (abs(scaled - self.estimate) - self.deviation)
        self.estimate += self.gain * (scaled - self.estimate)

    def _usually_late(self, late: frozenset[int]) -> bool:
        """Whether a sender of ``late`` was late to start in ``slow_share`` of the last
        stages."""
        history = self.late_history
        need = self.slow_share * (history.maxlen or 1)
        return any(sum(src in past for past in history) >= need for src in late)

    def heard(self, rank: int, proposal: object, bound: object) -> None:
        """A peer's piggybacked proposal and ceiling (ignored unless both are numbers > 0)."""
        if (isinstance(proposal, float) and isinstance(bound, float)
                and 0 < proposal < 1e6 and 0 < bound < 1e6):
            self.peers[rank] = (proposal, bound)

    def advert(self) -> dict[str, float]:
        """What this rank piggybacks on its frames (nothing while warming up)."""
        mine, bound = self.proposal, self.ceiling
        if self.fixed is not None or bound is None or mine is None:
            return {}
        return {"tc": mine, "tb": bound}


def _p95(samples: list[float]) -> float:
    """The 95th percentile, interpolated as numpy's default does. Not ``np.percentile``: its
    first call in a process takes about 7 ms (this machine), and every rank made it at the
    end of its last warm-up step, so each began the first bounded step that much late, by a
    different amount on a busy host: 4 ranks x 160 KB cut a rank at that step (and raised)
    in 3 runs of 5."""
    if len(samples) < 2:
        return samples[0]
    return statistics.quantiles(samples, n=20, method="inclusive")[-1]
