"""``Node(scheme="auto")``: the uncoded scheme the simulator predicts fastest for this job.

At the first ``allreduce`` the node knows what it could not at construction: the vector's size.
Rank 0 then ranks ring and the uncoded tree (fan-outs 2 to 8, and the star) by simulated step
time on the costs in ``AIOREDUCE_COSTS`` (a ``costs.json`` from ``aioreduce-bench advise
--measure`` or ``sim --sweep``; the entry for the nearest cluster size) or, without one, on
generic costs of a 10 Gbit/s cloud cluster; every rank takes rank 0's choice. Coded schemes
are not chosen automatically: they change what each rank computes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..schemes import Ring, Scheme, Tree
from . import Platform, load_platforms
from .advise import Option, advise
from .config import Config
from .steps import Costs

if TYPE_CHECKING:
    from ..node import Node

log = logging.getLogger("aioreduce")

# A host per rank, 10 Gbit/s, a cloud hop's latency, our runtime's per-message cost as fitted
# on the emulated cluster (a few hundred microseconds at most; 100 us on a core of its own).
GENERIC = Platform(Costs(alpha=25e-6, bandwidth=1.25e9, msg_cpu=100e-6, byte_cpu=1e-9),
                   Costs(alpha=25e-6, bandwidth=1.25e9, msg_cpu=30e-6, byte_cpu=0.5e-9))


def platform_for(world: int, environ: Mapping[str, str] | None = None) -> Platform:
    """The costs ``AIOREDUCE_COSTS`` names (nearest cluster size), else :data:`GENERIC`."""
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


async def pick(node: Node, array: Any) -> Any:
    """``scheme="auto"`` at the node's first ``allreduce``: rank 0 ranks the uncoded schemes
    by simulated step time for this vector and every rank uses its pick (one broadcast step).
    A compute function is called here, once, to learn the vector's size; what it returns is
    what the step sums, and is returned."""
    from ..inputs import is_tensor, nbytes

    value: Any = array() if callable(array) and not is_tensor(array) else array
    size = nbytes(value)
    opts = options(node.world_size)
    choice = np.zeros(1, np.int64)
    ranked: list[Option] = []
    if node.rank == 0:
        ranked = choose(node.world_size, size, platform_for(node.world_size))
        best = ranked[0]
        choice[0] = next(i for i, o in enumerate(opts)
                         if (o.scheme, o.settings) == (best.scheme, best.settings))
    picked = (await node.broadcast(choice, root=0)).value
    option = opts[int(picked[0])]
    if node.rank == 0:
        log.info("rank 0: scheme='auto' chose %s for %d bytes on %d ranks (predicted %s)",
                 option.label, size, node.world_size,
                 ", ".join(f"{o.label} {o.median * 1e3:.1f} ms" for o in ranked[:3]))
    await node.use(build(option))
    return value
