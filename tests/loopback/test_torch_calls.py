"""Every torch.distributed call a trainer makes, on 4 real processes, over Gloo and over
"aioreduce": the same values on every rank, in float32 and bfloat16 (CPU tensors).

Where Gloo's own result is undefined or wrong the test checks ours against the true value
instead: ``reduce`` leaves partial sums in the non-root ranks' tensors (torch documents only
the root's), and Gloo sums a non-contiguous tensor's underlying memory, not its elements.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from .harness import HERE, Ranks

pytest.importorskip("torch")
pytestmark = pytest.mark.loopback

PROG = str(HERE / "torchcalls.py")
N = 4


def _calls(backend: str, dtype: str, out: Path) -> dict[int, dict[str, np.ndarray]]:
    job = Ranks(N)
    try:
        job.start_all(backend, dtype, str(out), prog=PROG)
        done = job.wait(240)
    finally:
        job.kill()
    for d in done.values():
        assert d.returncode == 0, (backend, dtype, d.rank, d.err[-3000:])
        assert f"BACKEND {backend}" in d.out  # the backend we mean ran every call
    return {r: dict(np.load(out / f"{backend}.{dtype}.{r}.npz")) for r in range(N)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_call_gives_gloos_values(dtype: str, tmp_path: Path) -> None:
    gloo = _calls("gloo", dtype, tmp_path)
    ours = _calls("aioreduce", dtype, tmp_path)
    for r in range(N):
        assert len(ours[r]) >= len(gloo[r]) >= 34  # Gloo of torch 2.11: no list all_to_all
        want = [[10.0 * j + r, float(j)] for j in range(N)]  # rank j's part for us
        assert ours[r]["all_to_all"].reshape(N, 2).tolist() == want
        for name, want in gloo[r].items():
            if name == "all_reduce_strided" or (name == "reduce" and r != 1):
                continue
            np.testing.assert_array_equal(ours[r][name], want, err_msg=f"{name} rank {r}")
        assert ours[r]["all_reduce_strided"].tolist() == [10.0] * 3  # 1 + 2 + 3 + 4
        assert ours[r]["reduce"].tolist() == ([10.0, 8.0] if r == 1 else [r + 1.0, 2.0])
