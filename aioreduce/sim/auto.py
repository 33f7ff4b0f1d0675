"""``Node(scheme="auto")``: the uncoded scheme the simulator predicts fastest for this job.

At the first ``allreduce`` the node knows what it could not at construction: the vector's size.
Rank 0 then ranks ring and the uncoded tree (fan-outs 2 to 8, and the star) by simulated step
time on the costs in ``AIOREDUCE_COSTS`` (a ``costs.json`` from ``aioreduce-bench advise
--measure`` or ``sim --sweep``; the entry for the nearest cluster size) or, without one, on
generic costs of a 10 Gbit/s cloud cluster; every rank takes rank 0's choice. Coded schemes
are not chosen automatically: they change what each rank computes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ..schemes import Ring, Scheme, Tree
from . import Platform
from .advise import Option, advise
from .config import Config
from .steps import Costs

# A host per rank, 10 Gbit/s, a cloud hop's latency, our runtime's per-message cost as fitted
# on the emulated cluster (a few hundred microseconds at most; 100 us on a core of its own).
GENERIC = Platform(Costs(alpha=25e-6, bandwidth=1.25e9, msg_cpu=100e-6, byte_cpu=1e-9),
                   Costs(alpha=25e-6, bandwidth=1.25e9, msg_cpu=30e-6, byte_cpu=0.5e-9))


def platform_for(world: int, environ: Mapping[str, str] | None = None) -> Platform:
    """The costs ``AIOREDUCE_COSTS`` names (nearest cluster size), else :data:`GENERIC`."""
    from .report import load_platforms

    path = (os.environ if environ is None else environ).get("AIOREDUCE_COSTS")
    if not path:
        return GENERIC
    platforms = load_platforms(Path(path))
    return platforms[min(platforms, key=lambda n: abs(n - world))]


def options(world: int) -> list[Option]:
    """What ``auto`` chooses from: ring, and the uncoded tree by fan-out (the star too)."""
    fanouts = sorted({f for f in range(2, 9) if f < world} | {max(1, world - 1)})
    return [Option("ring")] + [Option("tree", {"fanout": f}) for f in fanouts]


def choose(world: int, nbytes: int, platform: Platform) -> list[Option]:
    """``options(world)`` ranked by simulated step time for a vector of ``nbytes``."""
    cfg = Config(schemes=[], nodes=world, size_bytes=max(1, nbytes), iters=1)
    return advise(cfg, platform, options(world))


def build(option: Option) -> Scheme:
    """The scheme an option stands for."""
    if option.scheme == "ring":
        return Ring()
    return Tree(fanout=option.settings["fanout"])
