"""Command line of ``aioreduce-bench``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``64K``, ``16M``, ``1G`` or plain bytes (binary units)."""
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
    if not num or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 64K, 16M, 1G)")
    try:
        value = float(num) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte: {text!r}")
    return int(value)


def _sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s]


def _fmt_size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aioreduce-bench",
                                description="aioreduce benchmarks (comparisons in one run)")
    sub = p.add_subparsers(dest="command", required=True)
    p2p = sub.add_parser("p2p", help="two processes on 127.0.0.1: aioreduce vs a raw socket")
    p2p.add_argument("--sizes", type=_sizes, default=_sizes("64K,1M,16M,64M"),
                     help="message sizes (default 64K,1M,16M,64M)")
    p2p.add_argument("--trials", type=int, default=12,
                     help="alternating trials per transport and size (default 12)")
    p2p.add_argument("--min-bytes", type=parse_size, default=parse_size("64M"),
                     help="bytes streamed per trial (default 64M)")
    p2p.add_argument("--rtt-rounds", type=int, default=300,
                     help="round trips per latency measurement (default 300)")
    p2p.add_argument("--json", action="store_true", help="one JSON object per line")
    return p


def _print_p2p(results: list[dict[str, Any]]) -> None:
    print(f"{'size':>6} {'aioreduce GB/s':>15} {'raw GB/s':>10} {'ratio':>7}")
    for r in results:
        if r["kind"] == "throughput":
            print(f"{_fmt_size(r['size_bytes']):>6} {r['aioreduce_gbps']:>15.2f} "
                  f"{r['raw_gbps']:>10.2f} {r['ratio']:>7.2f}")
        else:
            print(f"round trip of {r['message_bytes']} B: aioreduce {r['aioreduce_rtt_us']:.0f} "
                  f"us, raw {r['raw_rtt_us']:.0f} us (median of {r['rounds']})")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``aioreduce-bench``."""
    opts = build_parser().parse_args(argv)
    if opts.command == "p2p":
        from .p2p import run_p2p

        results = run_p2p(opts.sizes, opts.trials, opts.min_bytes, opts.rtt_rounds)
        if opts.json:
            for r in results:
                print(json.dumps(r))
        else:
            _print_p2p(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
