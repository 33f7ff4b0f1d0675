"""Measure this machine's costs for the simulator: a short run of every scheme, fitted.

What ``aioreduce-bench advise --measure`` runs before it advises: every simulated scheme
(and Gloo, when torch is installed) on ``nodes`` ranks, at a latency-bound and a
bandwidth-bound vector size, without injected stragglers, a few steps each; the simulator's
costs are then fitted to the medians (:func:`aioreduce.sim.calibrate.fit`).
"""

from __future__ import annotations

import os
from dataclasses import replace

from ..sim import Platform
from ..sim.calibrate import Measured, emulation_start, fit
from .allreduce import run_allreduce
from .sweep import Cell, cell_config, gloo_available

SIZES = (40 << 10, 4 << 20)


def measure_costs(nodes: int, *, netns: bool = True, link_mbit: float | None = None,
                  iters: int = 6, compute: float = 0.05) -> Platform:
    """Run the short measurement on this machine and return the fitted costs."""
    link = link_mbit if link_mbit is not None else (1000.0 if netns else None)
    measured: list[Measured] = []
    for size in SIZES:
        cell = Cell(nodes, size, "none")
        cfg = cell_config(cell, ["ring", "tree", "coded-tree", "gc"], iters=iters,
                          compute=compute, netns=netns, link_mbit=link,
                          vs_gloo=gloo_available())
        measured += [Measured(row["scheme"], replace(cfg, schemes=[row["scheme"]],
                                                     vs_gloo=False), row["median_s"])
                     for row in run_allreduce(cfg)]
    # every rank of this machine shares its cores, emulated hosts or not
    start = emulation_start(link if link is not None else 1e5, cores=os.cpu_count() or 1)
    return fit(measured, start)
