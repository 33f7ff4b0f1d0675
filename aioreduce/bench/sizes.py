"""Sizes as the bench's options take them: ``64K``, ``16M``, ``1G`` (binary units)."""

from __future__ import annotations

import argparse

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


def fmt_size(n: int) -> str:
    """``16M``, ``40K``: as the bench's size options read them (exact multiples only)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)
