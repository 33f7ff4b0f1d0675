"""Stock torch DDP over aioreduce, against Gloo DDP: 4 real processes, 20 steps of one MLP.

Acceptance: DDP with our communication hook (ring) and stock DDP over
``init_process_group(backend="aioreduce")`` end with parameters equal to Gloo DDP's within
1e-5 relative (float32); so does the Horovod-style optimizer wrapper (no DDP).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from .harness import HERE, Ranks

pytest.importorskip("torch")
pytestmark = pytest.mark.loopback

TORCHPROG = str(HERE / "torchprog.py")


def _train(mode: str, out: Path, n: int = 4, steps: int = 20) -> dict[int, str]:
    job = Ranks(n)
    try:
        job.start_all(mode, "--steps", str(steps), "--out", str(out), prog=TORCHPROG)
        done = job.wait(180)
    finally:
        job.kill()
    for d in done.values():
        assert d.returncode == 0, (mode, d.rank, d.err[-3000:])
    return {r: d.out for r, d in done.items()}


def test_hook_backend_and_optimizer_wrapper_match_gloo_ddp(tmp_path: Path) -> None:
    # The hook and the optimizer wrapper one after the other on one node: a launch less
    # (each is 4 torch start-ups).
    outs = {mode: _train(mode, tmp_path) for mode in ("gloo", "backend")}
    outs["hook"] = outs["optimizer"] = _train("hook,optimizer", tmp_path)
    # The paths we mean: every bucket through our hook; the backend really is ours.
    for out in outs["hook"].values():
        hooked = int(out.split("HOOKED ")[1].split()[0])
        assert hooked >= 20, out
    assert all("BACKEND aioreduce" in out for out in outs["backend"].values())
    ref = np.load(tmp_path / "gloo.0.npy")
    scale = np.abs(ref).max()
    for out in outs["optimizer"].values():
        assert int(out.split("BUCKETS ")[1].split()[0]) >= 3, out
    for mode in ("gloo", "hook", "backend", "optimizer"):
        for rank in range(4):
            got = np.load(tmp_path / f"{mode}.{rank}.npy")
            assert np.abs(got - ref).max() / scale < 1e-5, (mode, rank)
