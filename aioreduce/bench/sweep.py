"""``aioreduce-bench sweep``: every scheme (and Gloo) over a grid of cluster sizes, vector sizes
and straggler models, on the emulated cluster; resumable JSON lines and plots.

A *cell* is one (ranks, vector size, straggler model); its schemes run alternated in one launch
(``aioreduce-bench allreduce``), so they share the machine's noise. Each finished cell appends
its rows to ``results.jsonl`` in the output directory (one row per scheme, with the cell's
key); a sweep started again skips the cells already there, so an interrupted sweep resumes.
``--plot`` (or the end of a sweep) draws from that file:

* ``median_p99.png``: median (solid) and p99 (dashed) step time against ranks, one panel per
  (straggler model, vector size);
* ``speedup_vs_ring.png``: ring's median over each scheme's, per cell;
* ``cdf_<ranks>.png``: the step-time CDF of every scheme, one panel per (model, size);
* ``table.md``: every cell's median and p99 per scheme, and the fastest scheme.

Straggler models (``--stragglers``, by name): ``none``; ``slow3`` (the last rank, a leaf of
the tree, computes 3x slower); ``pause`` (each step one random rank pauses 100-500 ms, as a GC
pause or a preempted VM); ``shifted-exp`` (every rank, every step: 5 ms + Exp with mean 20 ms,
the model of the gradient-coding papers); ``heavy-tail`` (every rank, every step: 2 % chance of
300 ms more); and, outside the default grid, the same kinds with other parameters: ``slow2``
(2x), ``pause-b`` (50 ms to 1 s), ``shifted-exp-b`` (10 ms + Exp with mean 50 ms),
``heavy-tail-b`` (5 % chance of 150 ms). Draws follow ``AIOREDUCE_STRAGGLE_SEED`` (0 where it
is not set; each row records it). A cell's makespan leaves out that step's injected stragglers (see
:func:`~.allreduce.makespans`).

The default grid is what fits in an hour on a 2-core machine: 64 MiB cells time 10 steps
instead of 20 (``--iters 20,64M=10``), and 40 ranks at 64 MiB are left out (``--skip 40x64M``;
``--skip ''`` runs them). One such cell takes about 8 minutes there (three steps of each
scheme: ring 7.8 s, Gloo 8.7 s and gradient coding's star 31 s a step, plus starting 40
processes per launch), so its five models alone would take most of the hour. A cell whose
schemes would not fit in memory together (each rank holds a vector and buffers per scheme:
40 ranks at 64 MiB went past 24 GiB) runs one launch per scheme instead of alternating them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..codes import TreeTopology
from ..costmodel.config import Config, chunking
from ..schemes.base import CHUNK_BYTES, MAX_CHUNKS
from .allreduce import run_allreduce
from .sizes import fmt_size, parse_size

STRAGGLERS = {
    "none": "",
    "slow3": "rank={last}:slow=3",
    "pause": "all:pause=0.1,0.5",
    "shifted-exp": "all:shifted-exp=0.005,50",
    "heavy-tail": "all:spike=0.02,0.3",
    # The same kinds with other parameters, never in the default grid: cells to check the
    # simulator on after its models were tuned on the five above (docs/sweep/heldout-params).
    "slow2": "rank={last}:slow=2",
    "pause-b": "all:pause=0.05,1.0",
    "shifted-exp-b": "all:shifted-exp=0.01,20",
    "heavy-tail-b": "all:spike=0.05,0.15",
}
RESULTS = "results.jsonl"
DEFAULT_ITERS = "20,64M=10"
DEFAULT_SKIP = "40x64M"
# Bytes a rank holds per scheme of a launch, in vectors (its own, a result, a pool's spare).
VECTORS_PER_SCHEME = 2
MEMORY_SHARE = 0.6  # of the machine's memory, for one launch's ranks


@dataclass(frozen=True)
class Iterations:
    """Timed steps per cell: ``default``, or by vector size (``"20,64M=10"``)."""

    default: int
    by_size: tuple[tuple[int, int], ...] = ()

    @classmethod
    def parse(cls, text: str) -> Iterations:
        default, by_size = None, []
        for part in (p.strip() for p in text.split(",") if p.strip()):
            if "=" in part:
                size, count = part.split("=", 1)
                by_size.append((parse_size(size), int(count)))
            else:
                default = int(part)
        if default is None:
            raise ValueError(f"{text!r}: give a default count of steps (e.g. '20,64M=10')")
        if any(n < 1 for _, n in by_size) or default < 1:
            raise ValueError(f"{text!r}: every count of steps must be at least 1")
        return cls(default, tuple(by_size))

    def for_size(self, size_bytes: int) -> int:
        return dict(self.by_size).get(size_bytes, self.default)


def parse_skip(text: str) -> set[tuple[int, int]]:
    """``"40x64M,13x4M"`` -> {(ranks, bytes)}: cells of the grid not to run."""

    skip = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        ranks, _, size = part.partition("x")
        if not size:
            raise ValueError(f"{part!r}: write a cell to skip as RANKSxSIZE (e.g. 40x64M)")
        skip.add((int(ranks), parse_size(size)))
    return skip


@dataclass(frozen=True)
class Cell:
    """One point of the grid."""

    nodes: int
    size_bytes: int
    straggler: str  # a key of STRAGGLERS

    @property
    def key(self) -> str:
        return f"{self.nodes}/{self.size_bytes}/{self.straggler}"

    def straggle_spec(self) -> str:
        return STRAGGLERS[self.straggler].format(last=self.nodes - 1)


def tree_shape(nodes: int, fanout: int = 3) -> tuple[int, int] | None:
    """(fanout, levels) of a full tree of exactly ``nodes`` ranks, if there is one."""
    for f in dict.fromkeys((fanout, 2, 3, 4, 5, 6)):  # the preferred fan-out first, once
        levels, size = 0, 1
        while size < nodes:
            levels += 1
            size = TreeTopology(f, levels).size
        if size == nodes and levels > 0:
            return f, levels
    return None


def grid(nodes: Iterable[int], sizes: Iterable[int], stragglers: Iterable[str],
         skip: set[tuple[int, int]] | None = None) -> list[Cell]:
    bad = [s for s in stragglers if s not in STRAGGLERS]
    if bad:
        raise ValueError(f"unknown straggler model(s) {bad}; known: {sorted(STRAGGLERS)}")
    return [Cell(n, b, s) for n in nodes for b in sizes for s in stragglers
            if (n, b) not in (skip or set())]


def done_keys(out: Path) -> set[str]:
    path = out / RESULTS
    if not path.exists():
        return set()
    return {json.loads(line)["cell"] for line in path.read_text().splitlines() if line.strip()}


def cell_config(cell: Cell, schemes: list[str], *, iters: int, compute: float, netns: bool,
                link_mbit: float | None, vs_gloo: bool, latency: float = 0.0,
                chunks: tuple[int, int] | None = None) -> Config:
    """The allreduce run of ``cell``: every scheme that fits ``cell.nodes`` (and Gloo); the
    trees' ``(chunk_bytes, max_chunks)`` as given, else the runtime's choice."""
    shape = tree_shape(cell.nodes)
    names = [s for s in schemes if s != "coded-tree" or shape is not None]
    fanout, levels = shape if shape is not None else (3, 2)
    return Config(schemes=names, nodes=cell.nodes, size_bytes=cell.size_bytes, iters=iters,
                  fanout=fanout, levels=levels, compute=compute,
                  straggle=cell.straggle_spec(), vs_gloo=vs_gloo, netns=netns,
                  link_mbit=link_mbit, latency=latency,
                  dtype="float64" if cell.size_bytes < 1 << 20 else "float32",
                  chunk_bytes=None if chunks is None else chunks[0],
                  options={} if chunks is None else {"max_chunks": chunks[1]})


def row_config(row: dict[str, Any]) -> Config:
    """The configuration a row of ``results.jsonl`` was measured with (its straggler draws
    too, so the simulator replays them)."""
    cfg = cell_config(Cell(row["nodes"], row["size_bytes"], row["straggler"]), [row["scheme"]],
                       iters=row["iters"], compute=row["compute_s"], netns=row["netns"],
                       link_mbit=row["link_mbit"], vs_gloo=False,
                       latency=row.get("latency_s", 0.0),
                       # (rows from before the chunking followed the hosts: one host's)
                       chunks=(row.get("chunk_bytes", CHUNK_BYTES),
                               row.get("max_chunks", MAX_CHUNKS)))
    cfg.straggle_seed = row.get("seed", 0)
    return cfg


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def launches(cell: Cell, schemes: list[str], vs_gloo: bool,
             memory: int | None = None) -> list[tuple[list[str], bool]]:
    """(schemes, with Gloo) per launch of ``cell``: one launch alternating them all, or one
    launch per scheme (Gloo beside the first) when together they would not fit in memory."""
    vectors = VECTORS_PER_SCHEME * (len(schemes) + vs_gloo)
    if cell.nodes * cell.size_bytes * vectors <= MEMORY_SHARE * (memory or memory_bytes()):
        return [(schemes, vs_gloo)]
    return [([s], vs_gloo and i == 0) for i, s in enumerate(schemes)]


def run_cell(cell: Cell, schemes: list[str], *, iters: Iterations, vs_gloo: bool,
             **kw: Any) -> list[dict[str, Any]]:
    """Every scheme that fits ``cell.nodes`` (and Gloo), in as few launches as memory allows;
    rows to append."""
    rows = []
    for names, gloo in launches(cell, schemes, vs_gloo):
        cfg = cell_config(cell, names, iters=iters.for_size(cell.size_bytes), vs_gloo=gloo,
                          **kw)
        chunk, most = chunking(cfg)
        rows += [{**row, "cell": cell.key, "straggler": cell.straggler,
                  "compute_s": cfg.compute, "link_mbit": cfg.link_mbit, "netns": cfg.netns,
                  "latency_s": cfg.latency, "chunk_bytes": chunk, "max_chunks": most,
                  "seed": int(os.environ.get("AIOREDUCE_STRAGGLE_SEED", 0))}
                 for row in run_allreduce(cfg)]
    return rows


def sweep(cells: list[Cell], schemes: list[str], out: Path, **kw: Any) -> int:
    """Run the cells not yet in ``out``; return how many ran."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    out.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if c.key not in done_keys(out)]
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
               "{task.total} cells"), TimeElapsedColumn())
    with Progress(*columns) as progress:
        task = progress.add_task("sweep", total=len(cells), completed=len(cells) - len(todo))
        for cell in todo:
            progress.update(task, description=f"{cell.nodes} ranks, {fmt_size(cell.size_bytes)}, "
                                              f"{cell.straggler}")
            rows = run_cell(cell, schemes, **kw)
            with (out / RESULTS).open("a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
            progress.advance(task)
    return len(todo)


def load(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / RESULTS).read_text().splitlines()
            if line.strip()]


def plot(out: Path) -> list[Path]:
    """Draw the sweep's PNGs from ``results.jsonl``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = load(out)
    models = [m for m in STRAGGLERS if any(r["straggler"] == m for r in rows)]
    sizes = sorted({r["size_bytes"] for r in rows})
    schemes = sorted({r["scheme"] for r in rows})
    colours = {s: f"C{i}" for i, s in enumerate(schemes)}
    written = []

    def panels(title: str) -> tuple[Any, Any]:
        fig, axes = plt.subplots(len(models), len(sizes), squeeze=False,
                                 figsize=(4.2 * len(sizes), 3.0 * len(models)))
        fig.suptitle(title, fontsize=10)
        return fig, axes

    def label(ax: Any, model: str, size: int) -> None:
        ax.set_title(f"{model}, {fmt_size(size)}", fontsize=9)

    fig, axes = panels("step time against ranks: median (solid), p99 (dashed)")
    for i, model in enumerate(models):
        for j, size in enumerate(sizes):
            ax = axes[i][j]
            for s in schemes:
                pts = sorted((r["nodes"], r["median_s"], r["p99_s"]) for r in rows
                             if r["scheme"] == s and r["straggler"] == model
                             and r["size_bytes"] == size)
                if pts:
                    n, med, p99 = zip(*pts, strict=True)
                    ax.plot(n, np.array(med) * 1e3, "o-", color=colours[s], label=s)
                    ax.plot(n, np.array(p99) * 1e3, "o--", color=colours[s])
            label(ax, model, size)
            ax.set_xticks(sorted({r["nodes"] for r in rows if r["size_bytes"] == size}))
            ax.set_xlabel("ranks")
            ax.set_ylabel("ms")
    written.append(_save(fig, out / "median_p99.png"))

    fig, axes = panels("speedup over ring (ring's median / the scheme's), per ranks")
    for i, model in enumerate(models):
        for j, size in enumerate(sizes):
            ax = axes[i][j]
            cell_rows = [r for r in rows if r["straggler"] == model and r["size_bytes"] == size]
            nodes = sorted({r["nodes"] for r in cell_rows})
            width = 0.8 / max(1, len(schemes))
            for k, s in enumerate(schemes):
                ys = []
                for n in nodes:
                    ring = [r["median_s"] for r in cell_rows if r["nodes"] == n
                            and r["scheme"] == "ring"]
                    mine = [r["median_s"] for r in cell_rows if r["nodes"] == n
                            and r["scheme"] == s]
                    ys.append(ring[0] / mine[0] if ring and mine else math.nan)
                ax.bar(np.arange(len(nodes)) + k * width, ys, width, color=colours[s],
                       label=s)
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xticks(np.arange(len(nodes)) + 0.4 - width / 2, [str(n) for n in nodes])
            label(ax, model, size)
            ax.set_xlabel("ranks")
    written.append(_save(fig, out / "speedup_vs_ring.png"))

    for n in sorted({r["nodes"] for r in rows}):
        fig, axes = panels(f"step-time CDF, {n} ranks")
        for i, model in enumerate(models):
            for j, size in enumerate(sizes):
                ax = axes[i][j]
                here = [r for r in rows
                        if (r["nodes"], r["straggler"], r["size_bytes"]) == (n, model, size)]
                for r in here:
                    xs = np.sort(np.array(r["steps_s"])) * 1e3
                    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post",
                            color=colours[r["scheme"]], label=r["scheme"])
                if not here:  # a cell left out of the sweep (--skip): say so, not a blank
                    ax.text(0.5, 0.5, "not run", ha="center", va="center",
                            transform=ax.transAxes, color="grey")
                    ax.set_xticks([])
                    ax.set_yticks([])
                label(ax, model, size)
                ax.set_xlabel("ms")
        written.append(_save(fig, out / f"cdf_{n}.png"))
    written.append(table(out, rows))
    return written


def table(out: Path, rows: list[dict[str, Any]]) -> Path:
    """``table.md``: every cell's median (and p99) per scheme, in ms, and the fastest."""
    schemes = sorted({r["scheme"] for r in rows})
    cells: dict[tuple[int, int, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["nodes"], r["size_bytes"], r["straggler"]), {})[r["scheme"]] = r
    order = list(STRAGGLERS)
    lines = ["| ranks | size | stragglers | " + " | ".join(schemes) + " | fastest |",
             "|---" * (len(schemes) + 4) + "|"]
    for (n, size, model), by in sorted(cells.items(),
                                       key=lambda kv: (kv[0][0], kv[0][1],
                                                       order.index(kv[0][2]))):
        cols = [f"{by[s]['median_s'] * 1e3:.0f} ({by[s]['p99_s'] * 1e3:.0f})" if s in by
                else "-" for s in schemes]
        best = min(by, key=lambda s: by[s]["median_s"])
        lines.append(f"| {n} | {fmt_size(size)} | {model} | " + " | ".join(cols) + f" | {best} |")
    path = out / "table.md"
    path.write_text("Median (p99) step time in ms per cell.\n\n" + "\n".join(lines) + "\n")
    return path


def _save(fig: Any, path: Path) -> Path:
    """One legend for the figure, below the panels (inside one it hides bars)."""
    labelled = {lab: h for ax in fig.axes for h, lab in zip(*ax.get_legend_handles_labels(),
                                                               strict=True)}
    fig.legend(list(labelled.values()), list(labelled), loc="lower center",
               ncol=len(labelled), fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def gloo_available() -> bool:
    return importlib.util.find_spec("torch") is not None
