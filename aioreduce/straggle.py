"""Straggler injection for experiments: per-rank delay models, seeded.

A spec is a ``;``-separated list of ``TARGET:MODEL`` items:

* ``TARGET`` is ``rank=R`` (or ``rank=R1,R2``) or ``all``;
* ``MODEL`` is ``delay=SECONDS`` (added to every step), ``slow=FACTOR`` (the rank computes
  FACTOR times slower: its measured compute time is stretched by FACTOR - 1),
  ``shifted-exp=SHIFT,RATE`` (each step adds SHIFT + Exp(1)/RATE seconds, the compute model
  of the gradient-coding papers, the same for every rank), ``load-exp=RATE`` (each step
  stretches the rank's own compute time by Exp(1)/RATE of itself: a delay per unit of data,
  so a rank with twice the coded load is delayed twice as long, as in the papers' model of
  a worker's time as its load times a shifted exponential), ``spike=PROB,SECONDS`` (each
  step, with probability PROB, SECONDS more: the rare long delays of a heavy tail, such as a
  GC pause or a noisy neighbour), ``pause=LO,HI`` (each step ONE of the target ranks, drawn
  anew per step and the same draw on every rank, pauses a uniform LO..HI seconds: a GC pause
  or a preempted VM somewhere in the cluster), or ``kill=STEP`` (the rank SIGKILLs itself
  when it reaches step STEP: a dead node, for testing tolerance; a process that replaced it
  under ``aioreduce-launch --restart`` does not).

Examples: ``rank=4:delay=0.5``, ``rank=4:slow=3``, ``rank=5:kill=10``,
``all:shifted-exp=0.01,20;rank=2:slow=3``, ``all:load-exp=2``, ``all:spike=0.005,0.2``,
``all:pause=0.1,0.5``.
The runtime reads ``AIOREDUCE_STRAGGLE`` (and ``AIOREDUCE_STRAGGLE_SEED``) when a node is
created from the environment, so a launcher can slow chosen ranks without touching the program.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StraggleRule:
    """One ``TARGET:MODEL`` item."""

    ranks: frozenset[int] | None  # None: every rank
    delay: float = 0.0
    slow: float = 1.0
    shift: float = 0.0
    rate: float = 0.0  # 0: no exponential part
    kill_at: int | None = None  # the step at which the rank kills itself
    spike_prob: float = 0.0
    spike: float = 0.0
    pause: tuple[float, float] | None = None  # one target rank per step pauses LO..HI s
    load_rate: float = 0.0  # load-exp: compute x Exp(1)/load_rate more (0: none)

    def applies(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


@dataclass(frozen=True)
class StraggleModel:
    """The extra seconds each rank waits before its contribution is ready."""

    rules: tuple[StraggleRule, ...] = ()
    seed: int = 0

    def extra_delay(self, rank: int, step: int, compute_seconds: float, world: int = 0
                    ) -> float:
        """Seconds to add at ``step`` for a rank whose own work took ``compute_seconds``
        (``world``: the job's size, which ``all:pause`` draws its rank from)."""
        extra = 0.0
        for i, rule in enumerate(self.rules):
            if not rule.applies(rank):
                continue
            if rule.pause is not None:
                if self._paused(i, step, world) == rank:
                    lo, hi = rule.pause
                    extra += lo + (hi - lo) * np.random.default_rng(
                        [self.seed, i, step, 2]).random()
                continue
            extra += rule.delay + (rule.slow - 1.0) * max(0.0, compute_seconds)
            if rule.rate > 0 or rule.shift > 0:
                rng = np.random.default_rng([self.seed, i, rank, step])
                extra += rule.shift + (rng.exponential(1.0) / rule.rate if rule.rate else 0.0)
            if rule.load_rate > 0:
                rng = np.random.default_rng([self.seed, i, rank, step, 4])
                extra += max(0.0, compute_seconds) * rng.exponential(1.0) / rule.load_rate
            if rule.spike_prob > 0 and self._spiked(i, rank, step):
                extra += rule.spike
        return extra

    def late_on_purpose(self, rank: int, step: int, world: int) -> bool:
        """Whether ``rank``'s own step is late by design at ``step``: a rule names it, a pause
        rule picked it, or a spike rule hit it. No collective can bring such a rank's result
        on time; what a straggler-tolerant one bounds is how long the others wait for it
        (benchmarks report that tail apart)."""
        if rank in self.stragglers(step, world):
            return True
        return any(rule.spike_prob > 0 and rule.applies(rank) and self._spiked(i, rank, step)
                   for i, rule in enumerate(self.rules))

    def _spiked(self, i: int, rank: int, step: int) -> bool:
        """Whether spike rule ``i`` hits ``rank`` at ``step`` (the same draw everywhere)."""
        draw = np.random.default_rng([self.seed, i, rank, step, 1]).random()
        return bool(draw < self.rules[i].spike_prob)

    def _paused(self, i: int, step: int, world: int) -> int:
        """The rank rule ``i`` (a pause) pauses at ``step``: the same on every rank."""
        rule = self.rules[i]
        if rule.ranks is not None:
            pool = sorted(rule.ranks)
        elif world > 0:
            pool = list(range(world))
        else:
            raise ValueError("an 'all:pause' straggler model needs the world size")
        return pool[int(np.random.default_rng([self.seed, i, step, 3]).integers(len(pool)))]

    def stragglers(self, step: int, world: int) -> frozenset[int]:
        """The ranks slowed on purpose at ``step``: those a rule names, and the one a pause
        rule picked (benchmarks leave them out of the makespan of the others)."""
        out: set[int] = set()
        for i, rule in enumerate(self.rules):
            if rule.pause is not None:
                out.add(self._paused(i, step, world))
            elif rule.ranks is not None:
                out |= rule.ranks
        return frozenset(out)

    def kills(self, rank: int, step: int) -> bool:
        """True if ``rank`` is to die (SIGKILL itself) on reaching ``step``."""
        return any(rule.kill_at is not None and rule.applies(rank) and step >= rule.kill_at
                   for rule in self.rules)

    def __bool__(self) -> bool:
        return bool(self.rules)


def parse_seeded(spec: str, environ: Mapping[str, str] | None = None) -> StraggleModel:
    """:func:`parse_straggle` with the seed ``AIOREDUCE_STRAGGLE_SEED`` of ``environ`` (the
    process's environment by default; 0 where it is not set), as the runtime reads it."""
    env = os.environ if environ is None else environ
    return parse_straggle(spec, int(env.get("AIOREDUCE_STRAGGLE_SEED", 0)))


def parse_straggle(spec: str, seed: int = 0) -> StraggleModel:
    """Parse a straggler spec (see the module docstring); errors name the bad item."""
    rules = []
    for item in (x.strip() for x in spec.split(";")):
        if not item:
            continue
        target, sep, model = item.partition(":")
        if not sep:
            raise ValueError(f"straggler spec {item!r}: expected TARGET:MODEL, e.g. "
                             "rank=4:slow=3")
        ranks: frozenset[int] | None
        if target.strip() == "all":
            ranks = None
        elif target.strip().startswith("rank="):
            try:
                ranks = frozenset(int(r) for r in target.strip()[5:].split(","))
            except ValueError:
                raise ValueError(f"straggler spec {item!r}: bad rank list") from None
        else:
            raise ValueError(f"straggler spec {item!r}: target must be rank=R or all")
        kind, _, value = model.partition("=")
        try:
            if kind == "delay":
                rule = StraggleRule(ranks, delay=float(value))
            elif kind == "slow":
                rule = StraggleRule(ranks, slow=float(value))
            elif kind == "kill":
                rule = StraggleRule(ranks, kill_at=int(value))
            elif kind == "shifted-exp":
                shift, rate = (float(v) for v in value.split(","))
                rule = StraggleRule(ranks, shift=shift, rate=rate)
            elif kind == "load-exp":
                rule = StraggleRule(ranks, load_rate=float(value))
                if not rule.load_rate > 0:
                    raise ValueError(kind)
            elif kind == "spike":
                prob, seconds = (float(v) for v in value.split(","))
                rule = StraggleRule(ranks, spike_prob=prob, spike=seconds)
            elif kind == "pause":
                lo, hi = (float(v) for v in value.split(","))
                if not 0 <= lo <= hi:
                    raise ValueError(kind)
                rule = StraggleRule(ranks, pause=(lo, hi))
            else:
                raise ValueError(kind)
        except ValueError:
            raise ValueError(f"straggler spec {item!r}: model must be delay=S, slow=K, "
                             "shifted-exp=SHIFT,RATE, load-exp=RATE (RATE > 0), "
                             "spike=PROB,SECONDS, pause=LO,HI or kill=STEP") from None
        if (rule.delay < 0 or rule.slow < 1 or rule.shift < 0 or rule.rate < 0
                or (rule.kill_at or 0) < 0 or not 0 <= rule.spike_prob <= 1
                or rule.spike < 0):
            raise ValueError(f"straggler spec {item!r}: values must be non-negative "
                             "(slow >= 1)")
        rules.append(rule)
    return StraggleModel(tuple(rules), seed)
