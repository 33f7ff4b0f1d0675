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


DTYPES = ("float32", "bfloat16")


def _calls(backend: str, dtypes: tuple[str, ...], out: Path
           ) -> dict[str, dict[int, dict[str, np.ndarray]]]:
    """Every call's results per dtype and rank, from one launch that runs ``dtypes`` one
    after the other."""
    job = Ranks(N)
    try:
        job.start_all(backend, ",".join(dtypes), str(out), prog=PROG)
        done = job.wait(240)
    finally:
        job.kill()
    for d in done.values():
        assert d.returncode == 0, (backend, dtypes, d.rank, d.err[-3000:])
        # the backend we mean ran every call, once per dtype
        assert d.out.count(f"BACKEND {backend}") == len(dtypes), d.out
    return {dtype: {r: dict(np.load(out / f"{backend}.{dtype}.{r}.npz")) for r in range(N)}
            for dtype in dtypes}


@pytest.fixture(scope="module")
def called(tmp_path_factory: pytest.TempPathFactory
           ) -> dict[tuple[str, str], dict[int, dict[str, np.ndarray]]]:
    # One launch per backend, both dtypes in it (a launch is 4 torch start-ups).
    out = tmp_path_factory.mktemp("calls")
    return {(backend, dtype): got for backend in ("gloo", "aioreduce")
            for dtype, got in _calls(backend, DTYPES, out).items()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_call_gives_gloos_values(dtype: str, called) -> None:
    gloo, ours = called["gloo", dtype], called["aioreduce", dtype]
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
