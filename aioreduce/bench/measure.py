"""Measure this machine's costs for the simulator: a short run of every scheme, fitted.

What ``aioreduce-bench advise --measure`` runs before it advises: every simulated scheme
(and Gloo, when torch is installed) on ``nodes`` ranks, at a latency-bound and a
bandwidth-bound vector size, without injected stragglers, a few steps each; the simulator's
costs are then fitted to the medians (:func:`aioreduce.sim.calibrate.fit`).

The ranks run on emulated hosts of this machine, on 127.0.0.1, or on the user's own hosts
(``hosts``: a hostfile, started over SSH by aioreduce-launch). On the user's hosts nothing is
shared that the simulator must model: every rank has its host's CPU (``cores`` None) and the
links run at the rate the user gives (the fit moves the software's costs and the wire's
latency, not the links' rate).
"""

from __future__ import annotations

import os
from dataclasses import replace

from ..costmodel import Platform
from ..sim.calibrate import Measured, emulation_start, fit
from .allreduce import Hosts, run_allreduce
from .sweep import Cell, cell_config, gloo_available

SIZES = (40 << 10, 4 << 20)


def measure_costs(nodes: int, *, netns: bool = True, link_mbit: float | None = None,
                  iters: int = 6, compute: float = 0.05, hosts: Hosts | None = None
                  ) -> Platform:
    """Run the short measurement (on ``hosts`` if given, else on this machine) and return
    the fitted costs."""
    if hosts is not None and link_mbit is None:
        raise ValueError("measuring real hosts needs their links' rate (link_mbit)")
    link = link_mbit if link_mbit is not None else (1000.0 if netns else None)
    measured: list[Measured] = []
    for size in SIZES:
        cell = Cell(nodes, size, "none")
        # (netns: the ranks span hosts, as on the user's; run_allreduce starts them there)
        cfg = cell_config(cell, ["ring", "tree", "coded-tree", "gc"], iters=iters,
                          compute=compute, netns=netns or hosts is not None, link_mbit=link,
                          vs_gloo=gloo_available())
        measured += [Measured(row["scheme"], replace(cfg, schemes=[row["scheme"]],
                                                     vs_gloo=False), row["median_s"])
                     for row in run_allreduce(cfg, hosts=hosts)]
    # Every rank of this machine shares its cores, emulated hosts or not; on the user's
    # hosts nobody's are shared.
    cores = None if hosts is not None else os.cpu_count() or 1
    return fit(measured, emulation_start(link if link is not None else 1e5, cores=cores))
