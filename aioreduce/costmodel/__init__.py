"""The cost model: a discrete-event simulation of every scheme's step, for clusters we
cannot run and for ``Node(scheme="auto")`` (:mod:`.auto`), which ranks schemes by it.

Part of the runtime (a trainer's process may load it); the tools over it (fitting its costs to
measured runs, reports: :mod:`aioreduce.sim`; the benchmarks: :mod:`aioreduce.bench`) are not.
It runs the step graph of a scheme (:mod:`.steps`: the runtime's topologies, first-sufficient
decode rules, chunk pipelining) on an engine with serialised links and CPUs (:mod:`.engine`),
with the same emulated compute and the same straggler draws as ``aioreduce-bench allreduce``
(a :class:`.config.Config` describes a run for both), and reports the same
makespan: until the last rank that is not an injected straggler at that step has the result.
Per-message and per-byte costs come from :mod:`aioreduce.sim.calibrate`, fitted to measured
runs, saved and loaded here (:func:`save_platforms`, :func:`load_platforms`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..codes import TreeTopology
from ..schemes import CodedTree, GradientCoding, Scheme
from ..straggle import parse_straggle
from ..topology import heap_children
from .config import Config, build_scheme, chunking, load_fraction, warmup_iterations
from .engine import run
from .steps import Costs, ring, tree

__all__ = ["SIMULATED", "Costs", "Platform", "load_platforms", "save_platforms", "simulate"]

SIMULATED = ("ring", "tree", "coded-tree", "gc", "gloo")


@dataclass(frozen=True)
class Platform:
    """The costs of our runtime and of Gloo on one kind of cluster.

    Our runtime moves bulk data two ways, and their costs differ: the tree schemes and
    gradient coding send frames through the event loop (``ours``), the ring moves its
    segments over lanes, blocking sockets on threads of their own (``lanes``; see
    :mod:`aioreduce.transport.lane`). ``lanes`` None: the ring costs what ``ours`` does
    (costs saved before the two were fitted apart)."""

    ours: Costs
    gloo: Costs
    lanes: Costs | None = None

    @property
    def ring(self) -> Costs:
        """What our ring's messages cost: ``lanes``, or ``ours`` without them."""
        return self.ours if self.lanes is None else self.lanes

    def on_cluster(self, mbit: float | None = None, alpha: float | None = None,
                   cores: int | None = None) -> Platform:
        """The same software costs on other links (Mbit/s), wire latency (s) and cores
        (``None``: a host per rank); ``None`` for links or latency keeps the fitted ones."""
        def move(c: Costs) -> Costs:
            return replace(c, bandwidth=c.bandwidth if mbit is None else mbit * 1e6 / 8,
                           alpha=c.alpha if alpha is None else alpha, cores=cores)
        return Platform(move(self.ours), move(self.gloo),
                        None if self.lanes is None else move(self.lanes))


def simulate(name: str, cfg: Config, platform: Platform, steps: int | None = None
             ) -> np.ndarray:
    """Makespans (s) of ``steps`` (default ``cfg.iters``) steps of scheme ``name`` ("gloo":
    Gloo's ring) on ``cfg``'s cluster, with ``cfg``'s compute and straggler draws."""
    if name not in SIMULATED:
        raise ValueError(f"no simulation of {name!r}; simulated: {', '.join(SIMULATED)}")
    world = cfg.nodes
    if name == "coded-tree" and TreeTopology(cfg.fanout, cfg.levels).size != world:
        raise ValueError(f"CodedReduce with fan-out {cfg.fanout} and {cfg.levels} levels has "
                         f"{TreeTopology(cfg.fanout, cfg.levels).size} ranks, not {world}")
    scheme, load = _scheme(name, world, cfg.fanout, cfg.levels, cfg.stragglers, cfg.code)
    # Latency the run injected into our transport (not Gloo's) is wire latency on top of what
    # the fit found.
    ours = platform.ring if name == "ring" else platform.ours
    chunk, most = chunking(cfg)
    costs = platform.gloo if name == "gloo" else replace(
        ours, chunk_bytes=chunk, max_chunks=most, alpha=ours.alpha + cfg.latency)
    share = load * cfg.compute
    model = parse_straggle(cfg.straggle, cfg.straggle_seed)
    first = warmup_iterations(cfg)
    count = cfg.iters if steps is None else steps
    if not any(r.rate or r.spike_prob or r.pause for r in model.rules):
        count = min(count, 1)  # nothing random: every step is the same, simulate one
    # the tree each tree-shaped scheme runs on, and what a coded parent can do without
    children: list[list[int]] | None = None
    tolerance, root_computes, m = 0, True, 1
    if isinstance(scheme, CodedTree):
        topo = TreeTopology(cfg.fanout, cfg.levels)
        children = [topo.children(r) for r in range(world)]
        tolerance, root_computes = cfg.stragglers, False
    elif isinstance(scheme, GradientCoding):  # the runtime runs it as a one-level tree
        children = [list(range(1, world))] + [[] for _ in range(1, world)]
        tolerance, root_computes, m = scheme.code.s, False, scheme.code.m
    elif name == "tree":  # the runtime's uncoded tree: heap order, any number of ranks
        children = [heap_children(r, cfg.fanout, world) for r in range(world)]
    out = np.empty(count)
    for i in range(count):
        it = first + i
        compute = [share + model.extra_delay(r, it, share, world) for r in range(world)]
        if children is None:
            graph, done = ring(costs, compute, cfg.size_bytes, lockstep=name == "gloo")
        else:
            graph, done = tree(costs, compute, cfg.size_bytes, children, tolerance,
                               root_computes, m)
        run(graph, world, costs.cores, costs.shared_port)
        slow = model.stragglers(it, world)
        fast = [r for r in range(world) if r not in slow] or list(range(world))
        ends = [done[r].done for r in fast]
        out[i] = max(math.inf if e is None else e for e in ends)
    return out


@lru_cache(maxsize=64)
def _scheme(name: str, nodes: int, fanout: int, levels: int, stragglers: int, code: str
            ) -> tuple[Scheme | None, float]:
    """The scheme the bench would build, and a rank's load (planning codes is slow)."""
    if name == "gloo":
        return None, 1.0 / nodes
    cfg = Config(schemes=[name], nodes=nodes, size_bytes=0, fanout=fanout, levels=levels,
                 stragglers=stragglers, code=code)
    scheme = build_scheme(name, cfg)
    return scheme, load_fraction(scheme, nodes)


def save_platforms(platforms: dict[int, Platform], path: Path) -> None:
    """``{ranks: {"ours": costs, "lanes": costs, "gloo": costs}}`` as JSON (a ``costs.json``)."""
    path.write_text(json.dumps({str(n): {"ours": asdict(p.ours), "lanes": asdict(p.ring),
                                         "gloo": asdict(p.gloo)}
                                for n, p in platforms.items()}, indent=1) + "\n")


def load_platforms(path: Path) -> dict[int, Platform]:
    """What :func:`save_platforms` wrote (a file without ``lanes``: the ring costs ``ours``)."""
    raw = json.loads(path.read_text())
    return {int(n): Platform(Costs(**p["ours"]), Costs(**p["gloo"]),
                             Costs(**p["lanes"]) if "lanes" in p else None)
            for n, p in raw.items()}
