"""A job's traces as a summary table (who straggled, how often, by how much) and a timeline.

*Late*: the rank was in the step's ``late`` list (its contribution was skipped). *Lag*: how
much later than the step's median rank this rank's own vector was ready (``t0 + ready_s``,
wall clock), so a rank that was paused, slow to compute or slow to start the step shows up.
"""

from __future__ import annotations

import glob
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from .record import StepRecord


def load(where: str) -> list[StepRecord]:
    """Every record of a trace directory (or of one file), sorted by step and rank."""
    files = [where] if os.path.isfile(where) else sorted(glob.glob(os.path.join(where,
                                                                               "*.jsonl")))
    if not files:
        raise FileNotFoundError(f"{where}: no trace files (*.jsonl)")
    records = []
    for path in files:
        with open(path) as fh:
            records += [StepRecord.from_json(line) for line in fh if line.strip()]
    return sorted(records, key=lambda r: (r.step, r.rank))


def lags(records: Iterable[StepRecord]) -> dict[tuple[int, int], float]:
    """(step, rank) -> seconds after the step's median rank that this rank's vector was ready."""
    by_step: dict[int, dict[int, float]] = defaultdict(dict)
    for r in records:
        if r.ready_s is not None:
            by_step[r.step][r.rank] = r.t0 + r.ready_s
    out = {}
    for step, ready in by_step.items():
        median = statistics.median(ready.values())
        for rank, t in ready.items():
            out[(step, rank)] = t - median
    return out


@dataclass(frozen=True)
class RankRow:
    """One rank's line of the summary."""

    rank: int
    steps: int
    late: int
    errors: int
    median_step_ms: float
    median_lag_ms: float
    max_lag_ms: float
    sent_mb: float
    recv_mb: float

    def cells(self) -> list[str]:
        pct = 100.0 * self.late / self.steps if self.steps else 0.0
        return [str(self.rank), str(self.steps), f"{self.late} ({pct:.0f}%)", str(self.errors),
                f"{self.median_step_ms:.1f}", f"{self.median_lag_ms:+.1f}",
                f"{self.max_lag_ms:+.1f}", f"{self.sent_mb:.1f}", f"{self.recv_mb:.1f}"]


HEADER = ["rank", "steps", "late", "errors", "step ms", "lag* ms (median)", "lag* ms (max)",
          "sent MB", "recv MB"]


def summarize(records: list[StepRecord]) -> list[RankRow]:
    """A row per rank. ``late`` counts the steps whose result skipped it (any rank's record of
    the step says so; a dead rank writes none), ``errors`` the steps that failed on it."""
    lag = lags(records)
    late_in: dict[int, set[int]] = defaultdict(set)
    for r in records:
        for skipped in r.late:
            late_in[skipped].add(r.step)
    by_rank: dict[int, list[StepRecord]] = defaultdict(list)
    for r in records:
        by_rank[r.rank].append(r)
    ranks = sorted(set(by_rank) | set(late_in))
    rows = []
    for rank in ranks:
        recs = by_rank.get(rank, [])
        own_lags = [v * 1e3 for (s, k), v in lag.items() if k == rank]
        rows.append(RankRow(
            rank=rank, steps=len({r.step for r in records}), late=len(late_in[rank]),
            errors=sum(r.error is not None for r in recs),
            median_step_ms=statistics.median(r.seconds for r in recs) * 1e3 if recs else 0.0,
            median_lag_ms=statistics.median(own_lags) if own_lags else 0.0,
            max_lag_ms=max(own_lags, default=0.0),
            sent_mb=sum(r.sent_bytes for r in recs) / 1e6,
            recv_mb=sum(r.recv_bytes for r in recs) / 1e6))
    return rows


def table(rows: list[RankRow]) -> str:
    """The summary as an aligned text table."""
    cells = [HEADER] + [row.cells() for row in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True))
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("* lag: how long after the step's median rank this rank's vector was ready "
                 "(negative: before it); late: steps that went on without this rank")
    return "\n".join(lines)


# Every colour of the timeline, with what its legend says.
COLOURS = {
    "computing": ("#1f4e79", "computing, until its own vector was ready"),
    "waiting": ("#9dc3e6", "waiting for the step's result"),
    "computing, skipped": ("#b22222", "computing, in a step that went on without it or "
                                      "failed on it"),
    "waiting, skipped": ("#f4a6a6", "waiting, in such a step"),
}


def plot(records: list[StepRecord], path: str, title: str = "") -> None:
    """A timeline PNG: one row per rank, one bar per step (dark: computing until its own
    vector was ready; light: waiting for the result), red where the step skipped the rank or
    failed on it; below, every step's duration on each rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min(r.t0 for r in records)
    ranks = sorted({r.rank for r in records})
    late = {(r.step, k) for r in records for k in r.late}
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(12, 2.0 + 0.35 * len(ranks) + 2.5),
                                  gridspec_kw={"height_ratios": [max(2, len(ranks)), 4]})
    for r in records:
        y = ranks.index(r.rank)
        x0 = r.t0 - start
        ready = r.ready_s if r.ready_s is not None else r.seconds
        bad = (r.step, r.rank) in late or r.error is not None
        ax.broken_barh([(x0, max(ready, 1e-5))], (y - 0.4, 0.8),
                       facecolors=COLOURS["computing, skipped" if bad else "computing"][0])
        if r.seconds > ready:
            ax.broken_barh([(x0 + ready, r.seconds - ready)], (y - 0.4, 0.8),
                           facecolors=COLOURS["waiting, skipped" if bad else "waiting"][0])
    ax.set_yticks(range(len(ranks)), [f"rank {k}" for k in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the job's first step")
    ax.set_title(title or "aioreduce step timeline", pad=36)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=c, label=label) for c, label in COLOURS.values()],
              loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize="small",
              frameon=False)
    for k in ranks:
        mine = [r for r in records if r.rank == k]
        ax2.plot([r.step for r in mine], [r.seconds * 1e3 for r in mine], lw=0.8, alpha=0.7)
    ax2.set_xlabel("step")
    ax2.set_ylabel("step time (ms), one line per rank")
    ax2.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
