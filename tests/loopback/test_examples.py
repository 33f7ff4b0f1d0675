"""The examples run end to end and compute what a single process computes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.loopback

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "aioreduce_launch.cli"]
LOGREG = [sys.executable, str(ROOT / "examples" / "logreg.py"), "--dim", "400", "--steps", "12"]


def _summary(stdout: str, prefix: str = "") -> dict:
    line = next(x for x in stdout.splitlines() if x.startswith(prefix + "SUMMARY "))
    return json.loads(line[len(prefix) + 8:])


@pytest.fixture(scope="module")
def reference() -> list[float]:
    res = subprocess.run([*LOGREG, "--reference"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return _summary(res.stdout)["losses"]


@pytest.mark.parametrize("ranks, args", [
    (13, ["--scheme", "coded-tree", "--fanout", "3", "--levels", "2", "--stragglers", "1",
          "--straggle", "rank=4:slow=3"]),
    (7, ["--scheme", "gc", "--stragglers", "1", "--straggle", "rank=2:delay=0.05"]),
    (4, ["--scheme", "ring"]),
    (7, ["--scheme", "tree", "--fanout", "2"]),
])
def test_logreg_matches_the_single_process_run(reference: list[float], ranks: int,
                                               args: list[str]) -> None:
    res = subprocess.run([*LAUNCH, "-n", str(ranks), "--", *LOGREG, *args],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    losses = _summary(res.stdout, "[0] ")["losses"]
    assert len(losses) == len(reference)
    for got, want in zip(losses, reference, strict=True):
        assert abs(got - want) <= 1e-6 * abs(want), (got, want)
    assert losses[-1] < 0.8 * losses[0]  # and it does learn
    assert "skipped" in res.stdout


def test_allreduce_demo_runs() -> None:
    res = subprocess.run([*LAUNCH, "-n", "3", "--", sys.executable,
                          str(ROOT / "examples" / "allreduce_demo.py"), "--size", "64K",
                          "--steps", "2"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("exact") == 6


def test_blocking_facade_for_trainers_without_asyncio() -> None:
    res = subprocess.run([*LAUNCH, "-n", "7", "--", sys.executable,
                          str(ROOT / "tests" / "loopback" / "syncprog.py")],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("SYNC OK") == 7


def test_caller_mistakes_are_refused_without_taking_a_step(ranks) -> None:
    job = ranks(3)
    job.start_all(prog=str(Path(__file__).parent / "callerprog.py"))
    done = job.wait(120)
    for rank in range(3):
        assert "STEP 2 OK" in done[rank].out, (rank, done[rank].err[-2000:])
    rejected = [x for x in done[1].out.splitlines()
                if x.startswith("REJECTED ") and "IN PLACE" not in x]
    assert len(rejected) == 2, done[1].out
    assert "TypeError: rank 1: pass a numpy array" in rejected[0]
    assert "ValueError: rank 1, step 1:" in rejected[1] and "[7]" in rejected[1]
    # A vector of another length on rank 1: the same error naming it on every rank, under
    # the ring and the tree, and the corrected retry works.
    for name in ("Ring", "Tree"):
        seen = []
        for rank in range(3):
            line = [x for x in done[rank].out.splitlines() if x.startswith(f"MISMATCH {name}")]
            assert line and "rank 1" in line[0] and "every rank must pass the same shape" in (
                line[0]), (rank, done[rank].out)
            assert f"RETRY {name} OK" in done[rank].out
            assert f"IN PLACE {name} OK" in done[rank].out
            seen.append(line[0])
        assert (f"REJECTED IN PLACE {name}: rank 1: in_place=True needs a writable "
                "C-contiguous floating-point array or CPU tensor, not int64 array") in (
                    done[1].out)
        if name == "Tree":  # decided at the root, so word for word the same everywhere
            assert len(set(seen)) == 1, seen
    # The failing trainer's own error surfaces, and its node did not wait out the barrier.
    assert done[2].returncode == 1 and "the trainer failed" in done[2].err
    assert "closing without a clean barrier" not in done[2].err
    for rank in (0, 1):
        assert done[rank].returncode == 0 and "CLOSED" in done[rank].out, done[rank].err
