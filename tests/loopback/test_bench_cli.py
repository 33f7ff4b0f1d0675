"""aioreduce-bench runs end to end and reports the fields it promises (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aioreduce.bench.cli import parse_size

pytestmark = pytest.mark.loopback


def test_parse_size() -> None:
    assert parse_size("64K") == 65536 and parse_size("16M") == 16 << 20
    assert parse_size("1G") == 1 << 30 and parse_size("100") == 100
    for bad in ("", "M", "12Q", "0"):
        with pytest.raises(Exception, match="size"):
            parse_size(bad)


def test_p2p_json_has_every_field() -> None:
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "p2p", "--sizes",
                          "64K,2M", "--trials", "1", "--min-bytes", "4M", "--rtt-rounds", "5",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    sizes = [r["size_bytes"] for r in rows if r["kind"] == "throughput"]
    assert sizes == [65536, 2 << 20]
    for r in rows[:2]:
        assert r["aioreduce_gbps"] > 0 and r["raw_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["aioreduce_gbps"] / r["raw_gbps"])
    assert rows[2]["kind"] == "latency" and rows[2]["aioreduce_rtt_us"] > 0
