"""A benchmark run's configuration, shared by the bench that runs it and the simulator that
replays it: the schemes and their options, the sizes, the emulated compute and stragglers.
Pure (no sockets, no node), so the simulator never imports the bench."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..codes import cyclic_mds, default_code, frc, gaussian_mds, random_cyclic
from ..schemes import CodedTree, GradientCoding, Scheme, by_name
from ..schemes.base import StepOptions


@dataclass
class Config:
    """Everything the rank processes need to know (passed as JSON on the command line)."""

    schemes: list[str]
    nodes: int
    size_bytes: int
    iters: int = 20
    warmup: int = 2
    dtype: str = "float32"
    fanout: int = 3
    levels: int = 2
    stragglers: int = 1
    code: str = "default"
    compute: float = 0.0
    straggle: str = ""
    verify: bool = False
    vs_gloo: bool = False
    chunk_bytes: int | None = None  # None: by whether the ranks span hosts (netns)
    deadline: float = 60.0
    model_alpha: float = 200e-6
    model_bandwidth: float = 1e9
    netns: bool = False  # every rank on its own emulated host (network namespace)
    link_mbit: float | None = None  # shape each host's link, both directions
    background: int = 0  # bulk TCP flows between hosts (emulated cluster only)
    # Mean seconds of those flows' bursts and pauses ([on, off]); None: steady flows
    background_burst: list[float] | None = None
    cpus_per_host: float | None = None  # each emulated host's CPU quota (cgroup); None: none
    latency: float = 0.0  # emulated one-way latency per frame, s (our transport only:
    # Gloo's sockets are its own, so it runs without it)
    in_place: bool = False  # uncoded schemes sum in place into a fresh copy, as Gloo does
    # Python's collector after every N-th step on every rank (0: its own)
    gc_every: int = 0
    # Cores the ranks share when they all run on this machine (local or emulated hosts; the
    # bench sets it): a step cannot take less than their CPU over these. None: hosts of
    # their own.
    shared_cores: float | None = None
    seed: int = field(default=0)
    # The run's straggler draws (AIOREDUCE_STRAGGLE_SEED): the simulator replays them.
    straggle_seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # more scheme options (by name)


def variant(name: str) -> tuple[str, dict[str, Any]]:
    """A bench scheme name and the options it adds: ``tree+lanes`` is the tree with
    ``lanes=True``, ``ring+lanes=false`` the ring without (a value is JSON), so one run can
    put two settings of one scheme side by side."""
    base, *extras = name.split("+")
    options: dict[str, Any] = {}
    for extra in extras:
        key, eq, value = extra.partition("=")
        options[key] = json.loads(value) if eq else True
    return base, options


def build_scheme(name: str, cfg: Config) -> Scheme:
    name, extra = variant(name)
    code = None
    if name == "gc":
        n, s = cfg.nodes - 1, cfg.stragglers
        make = {"default": lambda: default_code(n, s), "frc": lambda: frc(n, s),
                "cyclic": lambda: cyclic_mds(n, s), "random": lambda: random_cyclic(n, s),
                "gaussian": lambda: gaussian_mds(n, s, 2)}
        # gc+code="gaussian": a variant with its own code, beside another in one launch.
        named = extra.pop("code", cfg.code)
        if named not in make:
            raise ValueError(f"unknown code {named!r} for gc (one of {sorted(make)})")
        code = make[named]()
    options = {"fanout": cfg.fanout, "levels": cfg.levels, "stragglers": cfg.stragglers,
               "deadline": None if name == "transpose" else cfg.deadline,
               "chunk_bytes": cfg.chunk_bytes, "code": code, **cfg.options, **extra}
    return by_name(name, strict=False, **options)


def chunking(cfg: Config) -> tuple[int, int]:
    """``(chunk_bytes, max_chunks)`` the trees take in this run (as ``StepOptions.chunking``:
    every rank on its own emulated host spans hosts)."""
    most = cfg.options.get("max_chunks")
    return StepOptions(chunk_bytes=cfg.options.get("chunk_bytes", cfg.chunk_bytes),
                       max_chunks=most if isinstance(most, int) else None).chunking(cfg.netns)


def warmup_iterations(cfg: Config) -> int:
    """Iterations before timing starts: at least the transpose's warm-up steps."""
    for name in cfg.schemes:
        if variant(name)[0] != "transpose":
            continue
        scheme = build_scheme(name, cfg)
        if getattr(scheme, "deadline", None) is None:
            return max(cfg.warmup, getattr(scheme, "warmup", 0) + 1)
    return cfg.warmup


def load_fraction(scheme: Scheme | None, nodes: int) -> float:
    """Share of the data set one rank computes on under ``scheme`` (None: Gloo)."""
    if isinstance(scheme, CodedTree):
        return scheme.plan(scheme.min_samples).load / scheme.min_samples
    if isinstance(scheme, GradientCoding):
        return (scheme.code.s + scheme.code.m) / scheme.code.n
    return 1.0 / nodes
