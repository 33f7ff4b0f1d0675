"""Fit the simulator's costs to measured runs, and compare it with them.

The costs the simulator needs are not datasheet numbers: what a message costs our runtime
(framing, syscalls, an event loop's wake-up on a host whose cores every rank shares) and what
a byte costs (the add, the copy) are properties of this code on this machine. They are fitted
to measured medians, the rows of a sweep (:mod:`aioreduce.bench.sweep`): by default to the
cells without injected stragglers only, so that every cell with stragglers checks the model
on conditions it was not fitted to. The fit is a coordinate search in log space on the
squared log error of the medians; small, deterministic, no solver needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from ..costmodel import SIMULATED, Platform, simulate
from ..costmodel.config import Config
from ..costmodel.steps import Costs


@dataclass(frozen=True)
class Measured:
    """One scheme's measured median in one configuration."""

    scheme: str
    cfg: Config
    median: float
    straggler: str = "none"

    @property
    def cell(self) -> str:
        """The sweep cell: ranks/size/straggler model."""
        return f"{self.cfg.nodes}/{self.cfg.size_bytes}/{self.straggler}"

    @property
    def label(self) -> str:
        return f"{self.cell}/{self.scheme}"


@dataclass(frozen=True)
class Check:
    """The simulator's median next to a measured one."""

    measured: Measured
    predicted: float

    @property
    def error(self) -> float:
        """Relative error of the prediction: predicted / measured - 1."""
        return self.predicted / self.measured.median - 1.0


def from_sweep(rows: Iterable[dict[str, Any]],
               config_of: Callable[[dict[str, Any]], Config]) -> list[Measured]:
    """The simulated schemes' rows of a sweep's ``results.jsonl``; ``config_of`` gives the
    configuration a row was measured with (:func:`aioreduce.bench.sweep.row_config`: the
    simulator never imports the bench)."""
    return [Measured(r["scheme"], config_of(r), r["median_s"], r["straggler"]) for r in rows
            if r["scheme"] in SIMULATED]


def emulation_start(link_mbit: float = 1000.0, cores: int | None = 2) -> Platform:
    """Where the fit starts: a plausible Python runtime and a C++ one on shaped links
    (``cores`` shared by every rank; None: a host per rank)."""
    bandwidth = link_mbit * 1e6 / 8
    ours = Costs(50e-6, bandwidth, msg_cpu=100e-6, byte_cpu=1e-9, decode_cpu=50e-6,
                 step_cpu=200e-6, cores=cores)
    return Platform(ours,
                    Costs(50e-6, bandwidth, msg_cpu=30e-6, byte_cpu=0.5e-9, step_cpu=200e-6,
                          cores=cores),
                    replace(ours, msg_cpu=30e-6, decode_cpu=0.0))


# (which side, field) the fit moves; bandwidth stays the shaped rate, cores the machine's.
# "both": the wire's, shared by every side. The lanes' side keeps the node's own step cost
# (``ours``): it is the same node, only the ring's messages take another path.
FREE = (("ours", "msg_cpu"), ("ours", "byte_cpu"), ("lanes", "msg_cpu"), ("lanes", "byte_cpu"),
        ("gloo", "msg_cpu"), ("gloo", "byte_cpu"), ("ours", "decode_cpu"), ("ours", "step_cpu"),
        ("gloo", "step_cpu"), ("both", "alpha"), ("both", "shared_port"))
CEILING = {"shared_port": 1.0}  # a fraction of the link: never more than all of it
_SCHEMES_OF = {"ours": ("tree", "coded-tree", "gc"), "lanes": ("ring",), "gloo": ("gloo",)}


def _get(p: Platform, side: str, name: str) -> float:
    costs = {"ours": p.ours, "both": p.ours, "lanes": p.ring, "gloo": p.gloo}[side]
    value: float = getattr(costs, name)
    return value


def _set(p: Platform, side: str, name: str, value: float) -> Platform:
    changes: dict[str, Any] = {name: min(value, CEILING.get(name, math.inf))}
    ours = replace(p.ours, **changes) if side in ("ours", "both") else p.ours
    gloo = replace(p.gloo, **changes) if side in ("gloo", "both") else p.gloo
    lanes = p.ring
    if side in ("lanes", "both"):
        lanes = replace(lanes, **changes)
    if name == "step_cpu" and side == "ours":
        lanes = replace(lanes, step_cpu=ours.step_cpu)
    return Platform(ours, gloo, lanes)


def compare(measured: Iterable[Measured], platform: Platform, steps: int | None = None
            ) -> list[Check]:
    """The simulator's median for every measurement."""
    return [Check(m, float(np.median(simulate(m.scheme, m.cfg, platform, steps))))
            for m in measured]


def loss(checks: Iterable[Check]) -> float:
    """Mean squared log error of the medians."""
    errs = [math.log(c.predicted / c.measured.median) ** 2 for c in checks]
    return float(np.mean(errs)) if errs else 0.0


def fit(measured: list[Measured], start: Platform, rounds: int = 6,
        progress: Callable[[int, float], None] | None = None) -> Platform:
    """Costs that make the simulator's medians match ``measured`` (see the module doc)."""
    best = start
    best_loss = loss(compare(measured, best))
    factor = 4.0
    free = [(side, name) for side, name in FREE  # a side that nothing measured stays put
            if side == "both" or any(m.scheme in _SCHEMES_OF[side] for m in measured)]
    for r in range(rounds):
        for side, name in free:
            for f in (factor, 1 / factor):
                while True:
                    cand = _set(best, side, name, _get(best, side, name) * f)
                    cand_loss = loss(compare(measured, cand))
                    if cand_loss >= best_loss:
                        break
                    best, best_loss = cand, cand_loss
        factor = math.sqrt(factor)
        if progress is not None:
            progress(r, best_loss)
    return best


def costs_table(platform: Platform) -> list[tuple[str, str, str, str]]:
    """(field, ours, ours over lanes, Gloo) rows to print the fitted costs."""
    units = {"alpha": 1e6, "msg_cpu": 1e6, "byte_cpu": 1e9, "decode_cpu": 1e6,
             "step_cpu": 1e6, "bandwidth": 8e-6, "shared_port": 1.0}
    names = {"alpha": "alpha (us)", "msg_cpu": "CPU per message (us)",
             "byte_cpu": "CPU per byte (ns)", "decode_cpu": "decode, per child (us)",
             "step_cpu": "CPU per rank and step (us)",
             "bandwidth": "link (Mbit/s)",
             "shared_port": "port shared by several streams (fraction of its rate)"}
    out = []
    for f in fields(Costs):
        if f.name in units:
            ours, lanes, gloo = (f"{getattr(c, f.name) * units[f.name]:.3g}"
                                 for c in (platform.ours, platform.ring, platform.gloo))
            out.append((names[f.name], ours, lanes, gloo))
    return out
