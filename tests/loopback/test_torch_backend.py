"""The torch backend "aioreduce" on 3 real processes: every collective's values, async
handles, changing shapes, a model mismatch named on every
rank; the optimizer wrapper's accumulation, skip_synchronize and commit policy; the DDP
wrapper re-syncing replicas under a lossy bounded-time scheme."""

from __future__ import annotations

import json

import pytest

from .harness import HERE, Ranks

pytest.importorskip("torch")
pytestmark = pytest.mark.loopback

PROG = str(HERE / "torchops.py")


def _run(*args: str, n: int = 3) -> dict[int, dict[str, object]]:
    job = Ranks(n)
    try:
        job.start_all(*args, prog=PROG)
        done = job.wait(120)
    finally:
        job.kill()
    assert all(d.returncode == 0 for d in done.values()), {r: d.err[-2000:]
                                                            for r, d in done.items()}
    out: dict[int, dict[str, object]] = {}
    for r, d in done.items():
        out[r] = {}
        for line in d.out.splitlines():
            if line.startswith("OP "):
                name, value = line[3:].split(" ", 1)
                out[r][name] = json.loads(value)
    return out


def test_every_collective_gives_the_exact_value_on_every_rank() -> None:
    got = _run()
    for r in range(3):
        g = got[r]
        assert g["backend"] == "aioreduce"
        assert g["SUM"] == [6.0, 6.0] and g["AVG"] == [2.0, 2.0]
        assert g["MIN"] == [1.0, 0.0] and g["MAX"] == [3.0, 4.0] and g["PRODUCT"] == [6.0, 0.0]
        assert g["int_sum"] == [3, 3]
        assert g["strided"] == [6.0, 6.0, 6.0]
        assert g["async"] == [3.0, 3.0, 3.0]
        assert g["broadcast"] == [2.0, 2.0]
        assert g["all_gather"] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
        assert g["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        assert g["reduce_scatter"] == [3.0 * r + 3.0] * 2
        assert g["reduce_scatter_tensor"] == [6.0 * r, 6.0 * r + 3.0]
        assert g["reduce"] == ([6.0] if r == 0 else [float(r + 1)])


def test_a_different_model_on_one_rank_is_named_on_every_rank() -> None:
    got = _run("--mismatch")
    for r in range(3):
        assert "ranks [1]" in str(got[r]["mismatch"]) and f"rank {r}:" in str(got[r]["mismatch"])


def test_optimizer_wrapper_accumulates_clips_and_refuses_a_commit() -> None:
    got = _run("--optim", n=2)
    for r in range(2):
        g = got[r]
        assert g["tensor_mean"] == ["Tensor", [1.5, 2.0]]  # tensors in, tensors out
        assert "in flight" in str(g["zero_grad_in_flight"]) and f"rank {r}" in str(
            g["zero_grad_in_flight"])
        assert g["accumulated"] == 16.5  # (11 * 1 + 11 * 2) / 2
        stepped = float(g["after_clipped_step"])  # type: ignore[arg-type]
        assert abs(stepped) < 1e-5  # 1 - lr * (the gradient clipped to norm 1)
        committed, value, results = g["refused"]  # type: ignore[misc]
        assert committed is False and value == stepped and results == 1  # not updated
        reused, pooled, kept, largest, mean = g["pooled"]  # type: ignore[misc]
        assert mean == 0.5  # the mean of ranks 0 and 1, in the tensor itself
        assert pooled == 2048 and reused == 5  # one scratch half per sum, reused from the 2nd
        assert kept == 6 and largest == 0  # reports kept, values not


def test_ddp_over_a_lossy_transpose_resyncs_replicas_from_rank_0() -> None:
    got = _run("--resync")
    steps = [f"step{i}" for i in range(12)]
    resyncs = [i for i, s in enumerate(steps) if got[0][s]["resync"]]  # type: ignore[index]
    assert resyncs and resyncs == [i for i, s in enumerate(steps)
                                   if got[1][s]["resync"]]  # type: ignore[index]
    # The path we mean: results were lossy, so replicas drifted apart before a re-sync ...
    assert min(got[r][s]["received"] for r in range(3) for s in steps) < 1.0  # type: ignore[index]
    drifted = [i for i in range(1, 12) if i - 1 not in resyncs
               and got[0][steps[i]]["params"] != got[1][steps[i]]["params"]]  # type: ignore[index]
    assert drifted
    # ... and after every re-sync step, every rank holds rank 0's parameters at the next forward.
    for i in resyncs:
        if i + 1 < 12:
            ref = got[0][steps[i + 1]]["params"]  # type: ignore[index]
            assert all(got[r][steps[i + 1]]["params"] == ref for r in range(3)), i  # type: ignore[index]


def test_a_failed_sum_in_the_ddp_hook_reaches_backward_with_our_message() -> None:
    got = _run("--hook-error", n=2)
    for r in range(2):
        assert got[r]["hook0"] == "ok"
        failed = str(got[r]["hook1"])
        assert failed.startswith("RuntimeError") and "max_loss" in failed, (r, failed)
        assert "Unable to cast" not in failed
