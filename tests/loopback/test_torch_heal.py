"""A torch trainer whose rank is SIGKILLed in the middle of an iteration comes back under
``aioreduce-launch --restart`` and heals; the run ends exactly as an undisturbed one.

``torchheal.py``: an iteration's gradient is several buckets, one sum each; every rank's
batch is a function of (rank, iteration). The kill lands inside an iteration (some of its
buckets summed, some not): the live ranks run the iteration's buckets again with the
replacement, which healed the model, the optimizer and the iteration from a live peer. Since
the ring sums in a fixed order, the parameters match the undisturbed run's bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.loopback

PROG = Path(__file__).resolve().parent / "torchheal.py"


def _run(mode: str, *launch: str, straggle: str = "") -> tuple[list[dict], str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("AIOREDUCE_STRAGGLE", None)
    if straggle:
        env["AIOREDUCE_STRAGGLE"] = straggle
    cmd = [sys.executable, "-m", "aioreduce_launch.cli", "-n", "4", *launch, "--",
           sys.executable, str(PROG), "--mode", mode]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    finals = [json.loads(x.split("FINAL ", 1)[1]) for x in out.stdout.splitlines()
              if "FINAL " in x]
    assert sorted(f["rank"] for f in finals) == [0, 1, 2, 3], out.stdout[-3000:]
    return finals, out.stderr


@pytest.mark.parametrize("mode", ["optimizer"])
def test_a_rank_killed_inside_an_iteration_heals_to_the_undisturbed_run(mode: str) -> None:
    calm, _ = _run(mode)
    buckets = calm[0]["buckets"]
    assert buckets >= 3  # an iteration is several sums: the kill lands between two of them
    # The kill fires at rank 2's node step 10 * buckets + 1: its second bucket of iteration 10.
    finals, err = _run(mode, "--restart", "2", straggle=f"rank=2:kill={10 * buckets + 1}")
    assert "rank 2 on localhost killed by SIGKILL; restarting it" in err
    assert "[2] rank 2 (incarnation 1) healed from rank" in err, err[-3000:]
    # Every live rank ran the iteration again with the replacement.
    for rank in (0, 1, 3):
        assert f"[{rank}] rank {rank}: ranks [2] were replaced; the group of steps runs again" \
            in err, err[-3000:]
    assert {f["params"] for f in finals} == {calm[0]["params"]}, (finals, calm)
    assert all(f["iterations"] == 60 for f in finals)
