"""``sim.md`` for a sweep: the fitted costs, every cell's measured and simulated medians, the
worst cell, and how often the advisor picks a scheme within 10 % of the fastest measured."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..bench.sizes import fmt_size
from ..costmodel import Platform, save_platforms
from ..costmodel.config import Config
from .calibrate import Check, compare, costs_table, emulation_start, fit, from_sweep

COSTS = "costs.json"
# The costs fitted to the sweep in docs/sweep, shipped with the package (a copy of
# docs/sweep/costs.json; tests/unit/test_sim.py checks that they stay the same).
SHIPPED_COSTS = Path(__file__).with_name("sweep_costs.json")
REPORT = "sim.md"
WITHIN = 0.10  # the advisor is right if its pick is within this of the fastest measured


def advisor_hits(checks: list[Check]) -> list[tuple[str, str, str, bool]]:
    """Per cell: (cell, advised, fastest measured, advised within 10 % of it). The advisor
    (:func:`~.advise.advise`) ranks by simulated median; here it ranks the schemes measured
    in the cell, with the settings they were measured with, whose simulated medians the
    checks hold already."""
    cells: dict[str, list[Check]] = {}
    for c in checks:
        cells.setdefault(c.measured.cell, []).append(c)
    out = []
    for key, cs in cells.items():
        pick = min(cs, key=lambda c: c.predicted).measured
        best = min((c.measured for c in cs), key=lambda m: m.median)
        out.append((key, pick.scheme, best.scheme, pick.median <= (1 + WITHIN) * best.median))
    return out


def write(out: Path, rows: list[dict[str, Any]], config_of: Callable[[dict[str, Any]], Config],
          progress: Callable[[int, float], None] | None = None
          ) -> tuple[Path, dict[int, Platform]]:
    """Fit on the sweep's cells without stragglers, check on all; write ``sim.md`` and
    ``costs.json`` into ``out``.

    Each cluster size gets its own fit: on the emulation host the ranks share two cores, so
    what a message costs (wake-ups, scheduling) depends on how many ranks there are, as it
    depends on the hardware of a real cluster; the advisor measures the cluster it advises.
    ``config_of`` gives a row's run configuration (the sweep's ``row_config``)."""
    measured = from_sweep(rows, config_of)
    link = next((r["link_mbit"] for r in rows if r.get("link_mbit")), 1000.0)
    platforms: dict[int, Platform] = {}
    checks: list[Check] = []
    for n in sorted({m.cfg.nodes for m in measured}):
        mine = [m for m in measured if m.cfg.nodes == n]
        calm = [m for m in mine if m.straggler == "none"]
        platforms[n] = fit(calm, emulation_start(link), progress=progress)
        checks += compare(mine, platforms[n])
    hits = advisor_hits(checks)
    save_platforms(platforms, out / COSTS)
    lines = ["# Simulator against the sweep", "",
             "Made by `aioreduce-bench sim --sweep " + str(out) + "`. Costs fitted, per "
             "cluster size, to the cells without stragglers (`none`); every other cell is a "
             "check on conditions the fit did not see. Medians in ms; error = simulated / "
             "measured - 1.", "", "## Fitted costs", ""]
    for n, platform in platforms.items():
        lines += [f"{n} ranks:", "", "| cost | ours (event loop: trees, gc) | ours over "
                  "lanes (ring) | Gloo |", "|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in costs_table(platform)]
        lines.append("")
    lines += ["## Worst cells", ""]
    held = [c for c in checks if c.measured.straggler != "none"]
    for name, group in (("fitted (no stragglers)", [c for c in checks if c not in held]),
                        ("held out (stragglers)", held), ("all", checks)):
        if group:
            w = max(group, key=lambda c: abs(c.error))
            inside = sum(abs(c.error) <= 0.25 for c in group)
            lines.append(f"- {name}: worst {_label(w)} {w.error:+.1%}; {inside} of "
                         f"{len(group)} within 25 %")
    right = sum(h[3] for h in hits)
    lines += ["", f"Advisor: right in **{right} of {len(hits)}** cells ({right / len(hits):.0%})"
              f" (its pick's measured median within {WITHIN:.0%} of the fastest measured).",
              "", "## Every cell", "",
              "| ranks | size | stragglers | scheme | measured | simulated | error |",
              "|---|---|---|---|---|---|---|"]
    for c in checks:
        m = c.measured
        lines.append(f"| {m.cfg.nodes} | {fmt_size(m.cfg.size_bytes)} | {m.straggler} | "
                     f"{m.scheme} | {m.median * 1e3:.1f} | {c.predicted * 1e3:.1f} | "
                     f"{c.error:+.0%} |")
    lines += ["", "## Advisor per cell", "", "| cell | advised | fastest measured | right |",
              "|---|---|---|---|"]
    lines += [f"| {k} | {p} | {b} | {'yes' if ok else 'no'} |" for k, p, b, ok in hits]
    path = out / REPORT
    path.write_text("\n".join(lines) + "\n")
    return path, platforms


def _label(c: Check) -> str:
    m = c.measured
    return f"{m.cfg.nodes} ranks, {fmt_size(m.cfg.size_bytes)}, {m.straggler}, {m.scheme}"
