"""Which scheme to run: every candidate simulated on the measured costs, ranked.

``advise`` takes a cluster (ranks, vector size, compute, a straggler model: measured or
assumed) and the costs fitted on it (:mod:`.calibrate`), simulates every scheme and shape
that fits the ranks (ring, Gloo's ring, the uncoded tree, CodedReduce on each full tree,
gradient coding with each tolerance; the uncoded tree runs on any number of ranks, each
fan-out up to 8) and returns them fastest first, with the predicted
median and p99 step time of each, so the user sees what the alternatives cost too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..codes import TreeTopology
from . import Platform, simulate
from .config import Config


@dataclass(frozen=True)
class Option:
    """One scheme with its settings and its predicted step time."""

    scheme: str
    settings: dict[str, int] = field(default_factory=dict)
    median: float = float("nan")
    p99: float = float("nan")

    @property
    def label(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        return f"{self.scheme} ({extra})" if extra else self.scheme


def tree_shapes(nodes: int, max_fanout: int = 16) -> list[tuple[int, int]]:
    """Every (fanout, levels) whose full tree has exactly ``nodes`` ranks."""
    shapes = []
    for f in range(2, max_fanout + 1):
        for levels in range(1, 12):
            size = TreeTopology(f, levels).size
            if size == nodes and not (levels == 1 and f == nodes - 1):
                shapes.append((f, levels))  # (N-1, 1) is the star: gc covers it
            if size >= nodes:
                break
    return shapes


def candidates(nodes: int, gloo: bool = True, max_tolerance: int = 3) -> list[Option]:
    """Every scheme and setting the simulator can rank on ``nodes`` ranks."""
    out = [Option("ring")] + ([Option("gloo")] if gloo else [])
    out += [Option("tree", {"fanout": f}) for f in range(2, min(8, nodes - 1) + 1)]
    for f, levels in tree_shapes(nodes):
        for s in range(1, min(max_tolerance, f - 1) + 1):
            out.append(Option("coded-tree", {"fanout": f, "levels": levels, "stragglers": s}))
    for s in range(1, min(max_tolerance, nodes - 2) + 1):
        out.append(Option("gc", {"stragglers": s}))
    return out


def predict(option: Option, cfg: Config, platform: Platform, steps: int | None = None
            ) -> Option:
    """``option`` with its simulated median and p99 on ``cfg``'s cluster."""
    changes: dict[str, Any] = dict(option.settings)
    times = simulate(option.scheme, replace(cfg, **changes), platform, steps)
    return replace(option, median=float(np.median(times)),
                   p99=float(np.quantile(times, 0.99)))


def advise(cfg: Config, platform: Platform, options: Iterable[Option] | None = None,
           steps: int | None = None) -> list[Option]:
    """``options`` (default: every candidate for ``cfg.nodes``) ranked by predicted median
    step time on ``cfg``'s cluster, compute and stragglers; the first is the advice."""
    pool = list(options) if options is not None else candidates(cfg.nodes)
    ranked = [predict(o, cfg, platform, steps) for o in pool]
    return sorted(ranked, key=lambda o: o.median)
