"""Training over "aioreduce" against Gloo, 4 real processes: FSDP2 (float32 and a bfloat16
mixed-precision policy), DDP of a bfloat16 model, the precision of one bfloat16 sum; and the
same on CUDA tensors where a GPU is present (ranks share it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from .harness import HERE, Ranks

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.loopback

PROG = str(HERE / "torchtrain.py")
CALLS = str(HERE / "torchcalls.py")
N = 4
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def _run(prog: str, *args: str) -> dict[int, str]:
    job = Ranks(N)
    try:
        job.start_all(*args, prog=prog)
        done = job.wait(300)
    finally:
        job.kill()
    for d in done.values():
        assert d.returncode == 0, (args, d.rank, d.err[-3000:])
    return {r: d.out for r, d in done.items()}


def _launch(modes: tuple[str, ...], backend: str, out: Path, *extra: str) -> None:
    """One launch that runs ``modes`` one after the other, each rank saving to ``out``."""
    outs = _run(PROG, ",".join(modes), backend, str(out), *extra)
    assert all(o.count(f"BACKEND {backend}") == len(modes) for o in outs.values())


def _saved(mode: str, backend: str, out: Path) -> list[np.ndarray]:
    """Each rank's saved parameters (or error) of ``mode``."""
    return [np.load(out / f"{mode}.{backend}.{r}.npy") for r in range(N)]


def _train(mode: str, backend: str, out: Path, *extra: str) -> list[np.ndarray]:
    _launch((mode,), backend, out, *extra)
    return _saved(mode, backend, out)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


# The CPU runs of the three tests below: one launch per backend, every mode in it (each as it
# runs alone: its own seeds), as each launch costs 4 torch start-ups.
GLOO = ("fsdp", "ddp", "ddp-bf16", "sum-bf16")
OURS = ("fsdp", "fsdp-bf16", "ddp-bf16", "sum-bf16")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], list[np.ndarray]]:
    out = tmp_path_factory.mktemp("trained")
    _launch(GLOO, "gloo", out)
    _launch(OURS, "aioreduce", out)
    return lambda mode, backend: _saved(mode, backend, out)


def test_fsdp2_matches_gloo_and_runs_a_bf16_policy(trained) -> None:
    gloo, ours = trained("fsdp", "gloo"), trained("fsdp", "aioreduce")
    for r in range(N):  # each rank's own shards
        assert _rel(ours[r], gloo[r]) < 1e-5, r
    half = trained("fsdp-bf16", "aioreduce")
    for r in range(N):  # trained in bf16, near the float32 run
        assert np.isfinite(half[r]).all() and np.abs(half[r] - ours[r]).max() < 0.2


def test_ddp_of_a_bf16_model_is_within_bf16_rounding_of_gloo(trained) -> None:
    f32 = trained("ddp", "gloo")[0]
    gloo, ours = trained("ddp-bf16", "gloo"), trained("ddp-bf16", "aioreduce")
    for r in range(N):
        assert _rel(ours[r], gloo[r]) <= 2.0 ** -7  # one bf16 step of the largest value
        np.testing.assert_array_equal(ours[r], ours[0])  # the replicas agree
    # As close to the float32 run as Gloo's (the parameters and the optimizer's state are
    # rounded to bf16 every step: that rounding, not the sums', dominates here).
    ours_off, gloo_off = np.abs(ours[0] - f32).mean(), np.abs(gloo[0] - f32).mean()
    assert ours_off <= gloo_off * 1.001, (ours_off, gloo_off)


def test_a_bf16_sum_is_rounded_once(trained) -> None:
    """Gloo rounds every partial sum to bf16; we accumulate in float32 and round once."""
    gloo, ours = trained("sum-bf16", "gloo"), trained("sum-bf16", "aioreduce")
    assert ours[0].mean() < 0.75 * gloo[0].mean()
    for r in range(N):
        np.testing.assert_array_equal(ours[r], ours[0])


@cuda
def test_every_call_on_cuda_tensors_gives_gloos_cpu_values(tmp_path: Path) -> None:
    _run(CALLS, "gloo", "float32", str(tmp_path))
    gloo = {r: dict(np.load(tmp_path / f"gloo.float32.{r}.npz")) for r in range(N)}
    (tmp_path / "cuda").mkdir()
    _run(CALLS, "aioreduce", "float32", str(tmp_path / "cuda"), "--device", "cuda")
    for r in range(N):
        ours = dict(np.load(tmp_path / "cuda" / f"aioreduce.float32.{r}.npz"))
        for name, want in gloo[r].items():
            if name in ("all_reduce_strided", "reduce"):
                continue
            np.testing.assert_array_equal(ours[name], want, err_msg=f"{name} rank {r}")
        assert ours["stream_order"].tolist() == [10.0] * 4  # 1 + 2 + 3 + 4, after wait()
        assert ours["coalesced_stream_order"].tolist() == [[1.0, 2.0, 3.0, 4.0],
                                                            [0.0, 2.0, 4.0, 6.0]]
        assert ours["all_to_all"].reshape(N, 2).tolist() == [[10.0 * j + r, float(j)]
                                                             for j in range(N)]


@cuda
def test_a_large_bf16_sum_on_cuda_is_the_same_as_on_cpu(tmp_path: Path) -> None:
    """Staged through a pinned buffer and summed by the owners over lanes: the same values
    as the CPU tensors' sum."""
    cpu = _train("sum-bf16", "aioreduce", tmp_path)
    (tmp_path / "cuda").mkdir()
    gpu = _train("sum-bf16", "aioreduce", tmp_path / "cuda", "--device", "cuda")
    for r in range(N):
        np.testing.assert_array_equal(gpu[r], cpu[r])


@cuda
def test_ddp_with_the_model_on_cuda_matches_gloo(tmp_path: Path) -> None:
    gloo = _train("ddp", "gloo", tmp_path, "--device", "cuda", "--steps", "20")
    ours = _train("ddp", "aioreduce", tmp_path, "--device", "cuda", "--steps", "20")
    for r in range(N):
        assert _rel(ours[r], gloo[r]) < 1e-5, r


@cuda
def test_hook_optimizer_and_node_calls_on_cuda_match_gloo(tmp_path: Path) -> None:
    """aioreduce's DDP hook, DistributedOptimizer and node.allreduce with the model on the
    GPU: the same parameters as Gloo's DDP on the GPU (torchprog.py, 4 ranks)."""
    prog = str(HERE / "torchprog.py")
    outs = {mode: _run(prog, mode, "--steps", "10", "--out", str(tmp_path), "--device", "cuda")
            for mode in ("gloo", "hook", "optimizer")}
    for out in outs["hook"].values():  # the node's own call: a tensor back on the GPU
        assert "NODE_TENSOR cuda [1.5, 1.5, 1.5]" in out
    ref = np.load(tmp_path / "gloo.0.npy")
    for mode in ("hook", "optimizer"):
        for r in range(N):
            assert _rel(np.load(tmp_path / f"{mode}.{r}.npy"), ref) < 1e-5, (mode, r)


@cuda
def test_coded_minibatches_on_cuda_decode_the_exact_gradient(tmp_path: Path) -> None:
    job = Ranks(13)
    try:
        job.start_all("--epochs", "1", "--batch", "128", "--out", str(tmp_path), "--device",
                      "cuda", prog=str(HERE / "torchcoded.py"))
        done = job.wait(300)
    finally:
        job.kill()
    assert all(d.returncode == 0 for d in done.values()), done[0].err[-3000:]
    steps = [json.loads(line[5:]) for line in done[0].out.splitlines()
             if line.startswith("STEP ")]
    assert len(steps) == 15 and all(s["device"] == "cuda" for s in steps)
    assert max(s["rel_err"] for s in steps) < 1e-4
