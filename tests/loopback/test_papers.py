"""``benchmarks/papers.py --quick``: the papers' experiments from one command, at CI's size:
every step runs, leaves its results file, and ``reproduction.md`` is made from them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.loopback
ROOT = Path(__file__).resolve().parents[2]


def test_the_papers_experiments_run_from_one_command_and_make_the_report(
        tmp_path: Path) -> None:
    out = tmp_path / "papers"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "papers.py"), "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    # Every step's results file, named beside its command.
    commands = (out / "commands.md").read_text()
    for name in ("dose/delay.jsonl", "dose/slow.jsonl", "dose/codes-40k.jsonl",
                 "optireduce/tail.jsonl", "reproduction.md"):
        assert (out / name).stat().st_size > 0, name
        assert f"`{name}`" in commands, name
    rows = [json.loads(x) for x in (out / "dose" / "delay.jsonl").read_text().splitlines()]
    assert {r["scheme"] for r in rows} == {"coded-tree", "tree", "ring"}
    assert {r["repeat"] for r in rows} == {0, 1}  # two launches: intervals
    report = (out / "reproduction.md").read_text()
    for claim in ("CodedReduce vs Ring-AllReduce", "CodedReduce vs gradient coding",
                  "Communication-efficient codes", "OptiReduce"):
        assert f"| {claim}" in report, claim
    # The report's figures are the quick run's files, not the stored ones.
    assert f"{out / 'dose'}" in report and f"{out / 'optireduce' / 'tail.jsonl'}" in report
    assert "dose-response cells (" in report
