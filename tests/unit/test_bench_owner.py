"""Bench resources named after the process that made them: which ones a killed run left."""

from __future__ import annotations

import os
import subprocess
import sys

from aioreduce.bench.owner import orphaned, owner


def test_the_owner_is_the_process_id_after_the_prefix_before_a_dash() -> None:
    assert owner("arns123-h1", "arns") == 123
    assert owner("123-abc") == 123
    assert owner("arns123", "arns") is None  # no dash: not one of ours
    assert owner("other123-h1", "arns") is None
    assert owner("arnsprobe-1", "arns") is None
    assert owner("before") is None


def test_only_a_name_whose_process_is_gone_is_orphaned() -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert orphaned(f"arns{done.pid}-h1", "arns")
    assert not orphaned(f"arns{os.getpid()}-h1", "arns")
    assert not orphaned("arnsprobe-h1", "arns")  # names no process: left alone
