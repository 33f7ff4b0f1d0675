"""``aioreduce-trace DIR [--png FILE]``: summarize a job's step traces, draw the timeline."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .report import load, plot, summarize, table

PLOT_HINT = ("needs matplotlib: pip install 'aioreduce[plot]', or in a checkout of aioreduce "
             "pip install '.[plot]'")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``aioreduce-trace``."""
    p = argparse.ArgumentParser(prog="aioreduce-trace", description=__doc__.splitlines()[0]
                                .split(": ", 1)[1])
    p.add_argument("traces", help="the AIOREDUCE_TRACE directory (or one rank's .jsonl file)")
    p.add_argument("--png", metavar="FILE", help=f"write the timeline here ({PLOT_HINT})")
    p.add_argument("--title", default="", help="title of the timeline")
    a = p.parse_args(argv)
    try:
        records = load(a.traces)
    except (OSError, ValueError) as exc:
        print(f"aioreduce-trace: {exc}", file=sys.stderr)
        return 2
    print(table(summarize(records)))
    if a.png:
        try:
            plot(records, a.png, a.title)
        except ImportError:
            print(f"aioreduce-trace: --png {PLOT_HINT}", file=sys.stderr)
            return 2
        print(f"timeline: {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
