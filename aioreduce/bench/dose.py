"""``aioreduce-bench dose``: how a step's time grows with one rank's slowness (dose-response),
the coded tree against the uncoded tree and the ring, with repeats and confidence intervals.

The dose is one leaf's (the last rank's) fixed delay per step (``--delays``, seconds), or its
compute slowdown (``--slow K``: it computes K times longer; give ``--compute``, each rank's
compute in seconds, large enough that K x shows). The coded tree's parents decode from the
first sufficient set of their children, so its step should stay flat as the dose grows, while
the uncoded tree and the ring wait for the slow rank. What the coding buys is the coded tree
against the *uncoded* tree (same topology, same messages); the ring shows the baseline.

Every (ranks, dose) cell runs its schemes alternated in one launch (they share the machine's
noise), ``--repeats`` times with other seeds; the table gives, per cell and scheme, the mean
of the runs' median steps with a 95 % confidence interval (Student's t over the repeats) and
the first scheme's ratio to each other one (the coded tree's, by default). ``--straggle``
adds a model for every rank beside the dose, and ``--scheme`` takes any schemes: with
``--slow 1 --compute C --straggle 'all:load-exp=2' --scheme 'gc+code="cyclic",gc+code="gaussian"'``
it compares gradient codes (m = 1 against the communication-efficient m = 2) under compute
that grows with each rank's load. Tree shapes as the sweep's: 7 ranks (fan-out 2),
13 (3), 21 (4), 31 (2, four levels), 40 (3, three levels). Rows go to ``OUT/results.jsonl``
as they are measured, the table to ``OUT/table.md`` and its plot, with the intervals, to
``OUT/dose.png`` (``--plot`` redraws it from the rows).

    aioreduce-bench dose --nodes 7,13 --delays 0,0.05,0.2,0.5 --repeats 3 --netns \\
        --latency 0.0001 --out dose
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..costmodel.config import Config
from .allreduce import run_allreduce
from .sizes import fmt_size
from .sweep import tree_shape

SCHEMES = ["coded-tree", "tree", "ring"]
# Student's t, two-sided 95 %, by degrees of freedom (beyond the table: the normal's 1.96).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t95(dof: int) -> float:
    """Student's t for a two-sided 95 % interval with ``dof`` degrees of freedom (the table's
    next smaller entry between its rows: a slightly wider interval, never a narrower one)."""
    if dof < 1:
        raise ValueError("a confidence interval needs at least two runs")
    return _T95[max(k for k in _T95 if k <= dof)] if dof <= 30 else 1.96


@dataclass(frozen=True)
class Estimate:
    """The mean of ``n`` runs' medians and its 95 % half-width (``nan`` for one run)."""

    mean: float
    half_width: float
    n: int

    def __str__(self) -> str:
        if math.isnan(self.half_width):
            return f"{1e3 * self.mean:.2f}"
        return f"{1e3 * self.mean:.2f} ± {1e3 * self.half_width:.2f}"


def estimate(values: Sequence[float]) -> Estimate:
    """Mean and 95 % confidence half-width of ``values`` (seconds)."""
    if not values:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Estimate(mean, math.nan, 1)
    sd = statistics.stdev(values)
    return Estimate(mean, t95(len(values) - 1) * sd / math.sqrt(len(values)), len(values))


def straggle_spec(nodes: int, dose: float, kind: str) -> str:
    """The straggler spec that gives the last rank (a leaf of every tree) ``dose``."""
    last = nodes - 1
    if kind == "delay":
        return f"rank={last}:delay={dose:g}" if dose > 0 else ""
    if kind == "slow":
        return f"rank={last}:slow={dose:g}" if dose > 1 else ""
    raise ValueError(f"unknown dose {kind!r} (delay or slow)")


def cell_config(nodes: int, dose: float, kind: str, repeat: int, *, schemes: Sequence[str],
                size_bytes: int, iters: int, warmup: int, compute: float, netns: bool,
                link_mbit: float | None, latency: float, straggle: str = "",
                cpus_per_host: float | None = None) -> Config:
    """One launch: every scheme of the cell alternated, this repeat's seed; ``straggle``, a
    model for every rank beside the dose (``all:load-exp=2``: compute that grows with the
    load, as in the papers)."""
    shape = tree_shape(nodes)
    if shape is None:
        raise ValueError(f"no full tree has {nodes} ranks (7, 13, 21, 31, 40 do)")
    fanout, levels = shape
    return Config(schemes=list(schemes), nodes=nodes, size_bytes=size_bytes, iters=iters,
                  warmup=warmup, fanout=fanout, levels=levels, compute=compute,
                  straggle=";".join(x for x in (straggle_spec(nodes, dose, kind), straggle)
                                    if x), netns=netns,
                  link_mbit=link_mbit, latency=latency, seed=repeat,
                  cpus_per_host=cpus_per_host)


def summarize(rows: Iterable[dict[str, Any]]) -> dict[tuple[int, float, str], Estimate]:
    """Per (ranks, dose, scheme): the estimate over the repeats' median steps."""
    runs: dict[tuple[int, float, str], list[float]] = {}
    for row in rows:
        runs.setdefault((row["nodes"], row["dose"], row["scheme"]), []).append(row["median_s"])
    return {key: estimate(v) for key, v in sorted(runs.items())}


def table(summary: dict[tuple[int, float, str], Estimate], kind: str,
          schemes: Sequence[str] = SCHEMES) -> str:
    """A markdown table: one row per (ranks, dose), each scheme's mean ± 95 % CI in ms, and
    the first scheme's mean over each other one's."""
    first, others = schemes[0], list(schemes[1:])
    unit = "s delay" if kind == "delay" else "x slower"
    head = (["ranks", f"dose ({unit})", *(f"{s} ms" for s in schemes)]
            + [f"{first} / {s}" for s in others])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for nodes, dose in dict.fromkeys((n, d) for n, d, _s in summary):
        cells = [str(summary[(nodes, dose, s)]) if (nodes, dose, s) in summary else "-"
                 for s in schemes]
        base = summary.get((nodes, dose, first))
        ratios = []
        for s in others:
            other = summary.get((nodes, dose, s))
            ratios.append(f"{base.mean / other.mean:.2f}"
                          if base is not None and other is not None else "-")
        lines.append("| " + " | ".join([str(nodes), f"{dose:g}", *cells, *ratios]) + " |")
    return "\n".join(lines) + "\n"


def ratios(rows: Iterable[dict[str, Any]], first: str
           ) -> dict[tuple[int, float, str], Estimate]:
    """Per (ranks, dose, other scheme): ``first``'s median over the other's, paired within
    each launch (the schemes of a launch ran alternated, so they share its noise), and the
    95 % interval over the launches."""
    by_launch: dict[tuple[int, float, int], dict[str, float]] = {}
    for row in rows:
        key = (row["nodes"], row["dose"], row.get("repeat", 0))
        by_launch.setdefault(key, {})[row["scheme"]] = row["median_s"]
    runs: dict[tuple[int, float, str], list[float]] = {}
    for (nodes, dose, _repeat), medians in sorted(by_launch.items()):
        if first not in medians:
            continue
        for other, median in medians.items():
            if other != first and median > 0:
                runs.setdefault((nodes, dose, other), []).append(medians[first] / median)
    return {key: estimate(v) for key, v in runs.items()}


def plot(rows: Sequence[dict[str, Any]], path: Path,
         schemes: Sequence[str] | None = None) -> Path:
    """Draw ``rows`` (one kind of dose) to ``path``: per cluster size, each scheme's step
    against the dose (mean of the launches' medians, 95 % interval as error bars, log
    scale), and under it the first scheme's step over each other's, paired per launch,
    with its interval (below 1: the first is faster). Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("no rows to plot")
    kind = rows[0].get("kind", "delay")
    if schemes is None:
        schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    first = schemes[0]
    summary, paired = summarize(rows), ratios(rows, first)
    sizes = sorted({r["nodes"] for r in rows})
    fig, axes = plt.subplots(2, len(sizes), squeeze=False, sharex="col",
                             figsize=(4.2 * len(sizes), 6.4))
    unit = "delay of the last rank per step (s)" if kind == "delay" else \
        "the last rank's compute (x its own)"
    fig.suptitle(f"dose-response, {fmt_size(rows[0]['size_bytes'])} vectors:\nmean of "
                 f"{max(e.n for e in summary.values())} launches' median steps, 95 % "
                 "intervals", fontsize=10)
    for j, nodes in enumerate(sizes):
        top, bottom = axes[0][j], axes[1][j]
        for k, scheme in enumerate(schemes):
            cells = sorted((d, e) for (n, d, s), e in summary.items()
                           if n == nodes and s == scheme)
            if not cells:
                continue
            xs = [d for d, _e in cells]
            top.errorbar(xs, [1e3 * e.mean for _d, e in cells],
                         yerr=[0.0 if math.isnan(e.half_width) else 1e3 * e.half_width
                               for _d, e in cells],
                         fmt="o-", color=f"C{k}", capsize=3, label=scheme)
            if scheme == first:
                continue
            pairs = sorted((d, e) for (n, d, s), e in paired.items()
                           if n == nodes and s == scheme)
            if pairs:
                bottom.errorbar([d for d, _e in pairs], [e.mean for _d, e in pairs],
                                yerr=[0.0 if math.isnan(e.half_width) else e.half_width
                                      for _d, e in pairs],
                                fmt="o-", color=f"C{k}", capsize=3,
                                label=f"{first} / {scheme}")
        top.set_yscale("log")
        top.set_title(f"{nodes} ranks", fontsize=9)
        top.set_ylabel("step (ms, log scale)")
        top.legend(fontsize=7)
        bottom.axhline(1.0, color="grey", lw=0.8, ls=":")
        bottom.set_yscale("log")
        bottom.set_ylabel(f"{first}'s step / the other's")
        bottom.set_xlabel(unit)
        bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a dose run's JSON lines file (``OUT/results.jsonl``)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_dose(nodes: Sequence[int], doses: Sequence[float], kind: str, repeats: int,
             out: Path, **kw: Any) -> Path:
    """Measure every cell ``repeats`` times (rows appended to ``out/results.jsonl`` as they
    come); write and return ``out/table.md``."""
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    for repeat in range(repeats):  # repeats outermost: a drifting machine spreads evenly
        for n in nodes:
            for dose in doses:
                cfg = cell_config(n, dose, kind, repeat, **kw)
                for row in run_allreduce(cfg):
                    row = {**row, "dose": dose, "kind": kind, "repeat": repeat,
                           "cpus_per_host": cfg.cpus_per_host}
                    row.pop("steps_s", None)
                    with results.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    mine = [r for r in read_rows(results) if r.get("kind") == kind]
    path = out / "table.md"
    path.write_text(table(summarize(mine), kind, kw.get("schemes", SCHEMES)))
    if any(r.get("repeat", 0) for r in mine):  # (an interval needs two launches)
        plot(mine, out / "dose.png", kw.get("schemes", SCHEMES))
    return path
