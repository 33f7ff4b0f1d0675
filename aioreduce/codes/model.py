"""Expected step time of each scheme: shifted-exponential compute, alpha-beta links.

The model of the reference (codedreduce_gc.md §3.9, §5), used by the benchmarks to print a
prediction next to each measurement:

* **Compute.** A rank with load fraction ``l`` (share of the data set it computes on) needs
  ``l * full_time * (1 + E / rate) * slowdown`` seconds, ``E ~ Exp(1)``: the shifted exponential
  of the papers. ``slowdown`` models a persistently slow rank ("rank r is k x slower").
* **Links.** One vector of ``vector_bytes`` costs ``alpha + vector_bytes / bandwidth``; a rank's
  ingress serialises, so k vectors into one rank arrive one after the other.
* Every rank starts the step with the model (allreduce semantics) and ends with the result, so
  the schemes that aggregate at a root pay the broadcast back down.

Monte-Carlo over ``trials`` draws gives mean, median and p99.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .topology import TreeTopology


@dataclass(frozen=True)
class LinkModel:
    """Per-message latency ``alpha`` (s) and per-link ``bandwidth`` (bytes/s)."""

    alpha: float = 50e-6
    bandwidth: float = 1.25e8  # 1 Gbit/s


@dataclass(frozen=True)
class ComputeModel:
    """Shifted exponential: the whole data set takes ``full_time`` s on one rank, plus noise."""

    full_time: float = 1.0
    rate: float = 10.0  # mu; larger means less variable

    def draw(self, load: np.ndarray, rng: np.random.Generator, trials: int) -> np.ndarray:
        """Compute times, shape (trials, ranks), for per-rank load fractions ``load``."""
        e = rng.exponential(1.0, size=(trials, len(load)))
        out: np.ndarray = load * self.full_time * (1.0 + e / self.rate)
        return out


@dataclass(frozen=True)
class Prediction:
    """Predicted step time statistics, seconds."""

    scheme: str
    mean: float
    median: float
    p99: float


def _stats(scheme: str, t: np.ndarray) -> Prediction:
    return Prediction(scheme, float(np.mean(t)), float(np.median(t)),
                      float(np.quantile(t, 0.99)))


def _ingest(arrivals: np.ndarray, count: int, alpha: float, tau: float) -> np.ndarray:
    """Time the ``count``-th of the earliest messages is fully in, one after the other.

    ``arrivals`` (children, trials): when each child's message is ready to send.
    """
    ordered = np.sort(arrivals, axis=0)
    done = np.zeros(arrivals.shape[1])
    for k in range(count):
        done = np.maximum(done, ordered[k] + alpha) + tau
    return done


def _slowdowns(ranks: int, slow: Mapping[int, float]) -> np.ndarray:
    f = np.ones(ranks)
    for r, factor in slow.items():
        if 0 <= r < ranks:
            f[r] = factor
    return f


def predict_tree(fanout: int, levels: int, stragglers: int, *, vector_bytes: float,
                 link: LinkModel, compute: ComputeModel, slow: Mapping[int, float] | None = None,
                 chunks: int = 1, trials: int = 2000, seed: int = 0) -> Prediction:
    """CodedReduce (``stragglers > 0``) or the uncoded tree (``stragglers == 0``).

    Rank 0 is the root and does not compute; every other rank computes ``c/M`` of the data. A
    parent waits for its own compute and the first ``n - s`` children. With ``chunks > 1`` the
    levels overlap: only the root's ingest is paid in full, the others one chunk's worth.
    """
    topo = TreeTopology(fanout, levels)
    rho = fanout / (stragglers + 1)
    load = 1.0 / sum(rho ** lv for lv in range(1, levels + 1))
    rng = np.random.default_rng(seed)
    loads = np.full(topo.size, load)
    loads[0] = 0.0
    t_compute = compute.draw(loads, rng, trials) * _slowdowns(topo.size, slow or {})
    tau = vector_bytes / link.bandwidth
    ready = t_compute.T.copy()  # (ranks, trials): when each rank's message is ready
    for lv in range(levels - 1, -1, -1):
        per_level_tau = tau if (lv == 0 or chunks <= 1) else tau / chunks
        for parent in topo.ranks_at(lv):
            kids = topo.children(parent)
            got = _ingest(ready[kids], fanout - stragglers, link.alpha, per_level_tau)
            ready[parent] = np.maximum(ready[parent], got)
    down = levels * (link.alpha + fanout * (tau / max(chunks, 1) if chunks > 1 else tau))
    name = "coded-tree" if stragglers else "tree"
    return _stats(name, ready[0] + down)


def predict_star(workers: int, stragglers: int, *, vector_bytes: float, link: LinkModel,
                 compute: ComputeModel, m: int = 1, slow: Mapping[int, float] | None = None,
                 trials: int = 2000, seed: int = 0) -> Prediction:
    """Gradient coding on a star (``stragglers > 0``) or uncoded gather (``stragglers == 0``).

    Rank 0 is the master; ranks 1..N compute ``(s + m)/N`` of the data each and send vectors
    ``m`` times shorter; the master ingests the first ``N - s`` and broadcasts the result.
    """
    rng = np.random.default_rng(seed)
    loads = np.full(workers + 1, (stragglers + m) / workers)
    loads[0] = 0.0
    t = compute.draw(loads, rng, trials) * _slowdowns(workers + 1, slow or {})
    tau = vector_bytes / link.bandwidth
    got = _ingest(t.T[1:], workers - stragglers, link.alpha, tau / m)
    down = link.alpha + workers * tau
    return _stats("gc" if stragglers else "star", got + down)


def predict_ring(ranks: int, *, vector_bytes: float, link: LinkModel, compute: ComputeModel,
                 slow: Mapping[int, float] | None = None, trials: int = 2000,
                 seed: int = 0) -> Prediction:
    """Ring-AllReduce: every rank computes 1/N and the ring waits for the slowest."""
    rng = np.random.default_rng(seed)
    t = compute.draw(np.full(ranks, 1.0 / ranks), rng, trials) * _slowdowns(ranks, slow or {})
    comm = 2 * (ranks - 1) * (link.alpha + vector_bytes / ranks / link.bandwidth)
    return _stats("ring", np.max(t, axis=1) + comm)
