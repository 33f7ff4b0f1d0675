"""The simulator scored out of sample: fitted on some of the sweep's cells, checked on cells
of another cluster size or vector size that the fit never saw, beside the in-sample fit that
``docs/sweep/sim.md`` reports (fitted per cluster size on its calm cells).

Splits, for a sweep's cluster sizes (``docs/sweep``: 13 and 40 emulated hosts; 40 KB and 4
MiB at both, 64 MiB at 13; five straggler models):

- ranks: fitted on the ``--fit-nodes`` (13) calm cells, checked on every cell of each other
  cluster size in the sweep (beside that size's own in-sample fit);
- size: fitted on those calm cells at 40 KB and 4 MiB, checked on every 64 MiB cell of that
  size, where the sweep has one;
- parameters: fitted on those calm cells, checked on that size's straggler cells whose model
  or seed the simulator's models were not tuned on (``docs/sweep/heldout-params``).

Writes a Markdown report (errors per split, the advisor's picks from the out-of-sample
predictions, every cell) to ``--out``, each split's figures as JSON beside it (``.json``), and
prints its summary.

    python benchmarks/sim_out_of_sample.py [--sweep docs/sweep] [--out docs/sweep/out_of_sample.md]
        [--fit-nodes 13]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aioreduce.bench.sizes import fmt_size
from aioreduce.bench.sweep import row_config
from aioreduce.sim.calibrate import Check, Measured, compare, emulation_start, fit, from_sweep
from aioreduce.sim.report import WITHIN, advisor_hits

ROOT = Path(__file__).resolve().parent.parent
# The straggler models (at seed 0) that the simulator's models were kept or dropped by.
TUNED = {"slow3", "pause", "shifted-exp", "heavy-tail"}


# Simple rules the advisor is scored against: each picks a scheme for a cell from its
# straggler model and the scheme measured fastest in the same ranks and size without
# stragglers (the rules know the calm cells).
RULES: dict[str, Callable[[str, str], str]] = {
    "coded tree under pause, else the calm winner":
        lambda straggler, calm: "coded-tree" if straggler.startswith("pause") else calm,
    "coded tree under any straggler, else the calm winner":
        lambda straggler, calm: "coded-tree" if straggler != "none" else calm,
    "the calm winner": lambda straggler, calm: calm,
    "always the coded tree": lambda straggler, calm: "coded-tree",
    "always the ring": lambda straggler, calm: "ring",
}


def rule_hits(checks: list[Check], measured: list[Measured]) -> dict[str, int]:
    """How many cells each simple rule gets right (within 10 % of the fastest measured, as
    the advisor)."""
    calm: dict[tuple[int, int], Measured] = {}
    for m in measured:
        key = (m.cfg.nodes, m.cfg.size_bytes)
        if m.straggler == "none" and (key not in calm or m.median < calm[key].median):
            calm[key] = m
    cells: dict[str, list[Measured]] = {}
    for c in checks:
        cells.setdefault(c.measured.cell, []).append(c.measured)
    right = dict.fromkeys(RULES, 0)
    for ms in cells.values():
        first = ms[0]
        best = min(m.median for m in ms)
        for name, rule in RULES.items():
            pick = rule(first.straggler, calm[(first.cfg.nodes, first.cfg.size_bytes)].scheme)
            right[name] += any(m.scheme == pick and m.median <= (1 + WITHIN) * best
                               for m in ms)
    return right


def scores(name: str, checks: list[Check], measured: list[Measured]) -> dict[str, Any]:
    """One split's figures (what the report's summary row shows, and ``--out``'s JSON
    beside it holds for other reports: ``benchmarks/reproduction.py``)."""
    errs = [abs(c.error) for c in checks]
    worst = max(checks, key=lambda c: abs(c.error))
    hits = advisor_hits(checks)
    rules = rule_hits(checks, measured)
    return {"split": name, "axis": name.split(":")[0], "cells": len(checks),
            "median_abs_error": statistics.median(errs),
            "within_25": sum(e <= 0.25 for e in errs), "worst": worst.measured.label,
            "worst_error": worst.error, "advisor_right": sum(h[3] for h in hits),
            "rule_right": rules[FIRST_RULE], "rules": rules, "picks": len(hits)}


FIRST_RULE = next(iter(RULES))


def summary(score: dict[str, Any]) -> str:
    best = max(score["rules"].values())
    return (f"| {score['split']} | {score['cells']} | {score['median_abs_error']:.0%} | "
            f"{score['within_25']} of {score['cells']} | {score['worst']} "
            f"{score['worst_error']:+.0%} | {score['advisor_right']} of {score['picks']} | "
            f"{score['rule_right']} of {score['picks']} | {best} of {score['picks']} |")


def pooled(scored: list[dict[str, Any]]) -> list[str]:
    """Out of sample, every split together (a split that only draws its cells again is
    counted once): the advisor's picks against each simple rule's."""
    held = [s for s in scored if s["axis"] not in ("in sample", "parameters, other draws")]
    if not held:
        return []
    picks = sum(s["picks"] for s in held)
    adv = sum(s["advisor_right"] for s in held)
    out = ["", f"Out of sample, all splits together ({picks} picks; the other draws of the same "
           f"cells not counted twice): the advisor right in {adv}.", "",
           "| simple rule | right | the advisor's margin |", "|---|---|---|"]
    for name in RULES:
        right = sum(s["rules"][name] for s in held)
        out.append(f"| {name} | {right} of {picks} | {adv - right:+d} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", type=Path, default=ROOT / "docs" / "sweep")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "sweep" / "out_of_sample.md")
    ap.add_argument("--fit-nodes", type=int, default=13,
                    help="the cluster size fitted on; every other one in the sweep is checked")
    opts = ap.parse_args()
    rows = [json.loads(line) for line in (opts.sweep / "results.jsonl").open()]
    measured = from_sweep(rows, row_config)
    link = next((r["link_mbit"] for r in rows if r.get("link_mbit")), 1000.0)

    def cells(nodes: int, sizes: set[int] | None = None, calm: bool = False) -> list[Measured]:
        return [m for m in measured if m.cfg.nodes == nodes
                and (sizes is None or m.cfg.size_bytes in sizes)
                and (not calm or m.straggler == "none")]

    small = {40 << 10, 4 << 20}
    big = {m.cfg.size_bytes for m in measured} - small
    sizes_of = sorted({m.cfg.nodes for m in measured})
    base = opts.fit_nodes
    t0 = time.perf_counter()
    fitted = {n: fit(cells(n, calm=True), emulation_start(link)) for n in sizes_of}
    splits = []
    for n in sizes_of:
        if n == base:
            continue
        splits += [(f"in sample: {n} ranks, fitted on {n}'s calm cells",
                    compare(cells(n), fitted[n])),
                   (f"ranks: {n} ranks, fitted on {base}'s calm cells",
                    compare(cells(n), fitted[base]))]
    # Straggler cells the simulator's models were never tuned on: other parameters of the same
    # kinds, or other seeds (docs/sweep/heldout-params).
    fresh = [m for m in cells(base) if m.straggler != "none" and (
        m.straggler not in TUNED or m.cfg.straggle_seed != 0)]
    if fresh:
        # Once replaying the run's draws (as every split does), once with other draws of the
        # same models (seed + 1000): the median of 10-20 steps is itself a draw.
        other = [dataclasses.replace(m, cfg=dataclasses.replace(
            m.cfg, straggle_seed=m.cfg.straggle_seed + 1000)) for m in fresh]
        splits += [(f"parameters: {base} ranks, straggler parameters and seeds not tuned "
                    f"on, fitted on {base}'s calm cells", compare(fresh, fitted[base])),
                   ("parameters, other draws: the same, simulated with other draws of each "
                    "model", compare(other, fitted[base]))]
    if cells(base, big):  # a size the small ones never saw
        splits += [(f"in sample: {base} ranks 64M, fitted on {base}'s calm cells",
                    compare(cells(base, big), fitted[base])),
                   (f"size: {base} ranks 64M, fitted on {base}'s calm 40K and 4M",
                    compare(cells(base, big), fit(cells(base, small, calm=True),
                                                  emulation_start(link))))]
    lines = ["# The simulator out of sample", "",
             f"Made by `python benchmarks/sim_out_of_sample.py --sweep {opts.sweep.name}` from its "
             "`results.jsonl`. Error = simulated / measured - 1 of each "
             "cell's median; the advisor's pick is right when its measured median is within "
             "10 % of the fastest measured (as in `sim.md`). The in-sample rows are the fit "
             "`sim.md` reports (one per cluster size, on its calm cells).", "",
             "The simple rule beside the advisor: the coded tree under a pause model, else "
             "the scheme measured fastest in the same ranks and size without stragglers; the "
             "best simple rule: the best in that split of the rules below (each knows the "
             "calm cells).", "",
             "| split | cells | median abs error | within 25 % | worst | advisor right | "
             "simple rule right | best simple rule right |", "|---|---|---|---|---|---|---|---|"]
    scored = [scores(name, checks, measured) for name, checks in splits]
    lines += [summary(score) for score in scored]
    lines += pooled(scored)
    lines += ["", "## Every cell", "", "| split | ranks | size | stragglers | scheme | measured "
              "ms | simulated ms | error |", "|---|---|---|---|---|---|---|---|"]
    for name, checks in splits:
        for c in checks:
            m = c.measured
            lines.append(f"| {name.split(':')[0]} | {m.cfg.nodes} | {fmt_size(m.cfg.size_bytes)}"
                         f" | {m.straggler} | {m.scheme} | {m.median * 1e3:.1f} | "
                         f"{c.predicted * 1e3:.1f} | {c.error:+.0%} |")
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text("\n".join(lines) + "\n")
    opts.out.with_suffix(".json").write_text(json.dumps(scored, indent=1) + "\n")
    print("\n".join(lines[8:lines.index("## Every cell")]))
    print(f"({time.perf_counter() - t0:.0f} s; report in {opts.out})")


if __name__ == "__main__":
    main()
