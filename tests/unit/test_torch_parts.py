"""The torch integration's pure parts: optional import, tensor conversion, the coded sampler."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import aioreduce as ar

torch = pytest.importorskip("torch")

from aioreduce.tensors import tensor_result, to_numpy  # noqa: E402
from aioreduce.torch.coded import CodedSampler, weighted_loss  # noqa: E402


def test_aioreduce_imports_and_runs_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"  # any 'import torch' now fails
            "import numpy as np, aioreduce as ar\n"
            "from aioreduce.inputs import is_tensor as _is_tensor\n"
            "assert not _is_tensor(np.zeros(3)) and not _is_tensor([1])\n"
            "try:\n    import aioreduce.torch\nexcept ImportError:\n    print('no torch ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "no torch ok" in out.stdout, out.stderr


def test_cpu_tensors_are_shared_not_copied_and_others_are_named() -> None:
    t = torch.arange(6.0).reshape(2, 3)
    a = to_numpy(t, 3)
    a[0, 0] = 42.0
    assert t[0, 0] == 42.0  # the same memory
    half = to_numpy(torch.tensor([1.5, -2.0], dtype=torch.bfloat16), 3)
    assert half.dtype == np.float32 and half.tolist() == [1.5, -2.0]  # summed in float32
    with pytest.raises(TypeError, match=r"rank 3: tensors of torch\.float8_e4m3fn cannot"):
        to_numpy(torch.zeros(2, dtype=torch.float8_e4m3fn), 3)
    with pytest.raises(TypeError, match="rank 3: expected a torch tensor, not list"):
        to_numpy([1.0], 3)
    ro = np.arange(4.0)
    ro.setflags(write=False)
    res = tensor_result(ar.Result(ro, 0, [0, 1]))
    res.value.add_(1)  # a writable copy: the in-flight value is untouched
    assert ro.tolist() == [0.0, 1.0, 2.0, 3.0] and res.used == [0, 1]


@pytest.mark.parametrize("n, batch", [(1797, 128), (20, 7), (15, 15), (3, 128)])
def test_coded_sampler_covers_each_global_batch_with_its_placement(n: int, batch: int) -> None:
    scheme = ar.CodedTree(3, 2, 1)
    samplers = [CodedSampler(n, batch, scheme=scheme, rank=r, seed=5) for r in range(13)]
    for s in samplers:
        s.set_epoch(2)
    per_rank = [list(s) for s in samplers]
    assert all(len(p) == -(-n // batch) for p in per_rank)
    seen: list[int] = []
    for step in range(len(per_rank[0])):
        # every rank derived the same global batch
        batches = {tuple(s.batch) for s in samplers}  # the last one of the epoch
        assert len(batches) == 1
        want = set()
        for r in range(13):
            idx, w = per_rank[r][step]
            assert w.dtype == torch.float32 and len(idx) == len(w)
            want |= set(idx.tolist())
        seen += sorted(want)
    assert sorted(seen) == list(range(n))  # each sample in exactly one global batch


def test_coded_sampler_weights_decode_to_the_batch_mean() -> None:
    """Per-sample values through the placement and the tree's own reference decode."""
    scheme = ar.CodedTree(3, 2, 1)
    n, batch = 37, 20
    values = np.random.default_rng(0).normal(size=(n, 4))
    s0 = CodedSampler(n, batch, scheme=scheme, rank=0, shuffle=False)
    for step, _ in enumerate(s0):
        b = s0.batch
        padded = -(-len(b) // scheme.min_samples) * scheme.min_samples
        vals = np.zeros((padded, 4))
        vals[: len(b)] = values[b] / len(b)
        got = scheme.plan(padded).reference_aggregate(vals, missing=[5])
        assert np.allclose(got, values[b].mean(axis=0)), step


def test_gradient_coding_master_gets_no_samples_and_weighted_loss_is_linear() -> None:
    scheme = ar.GradientCoding(ar.codes.frc(4, 1))
    s = CodedSampler(10, 4, scheme=scheme, rank=0)
    assert len(s) == 3 and all(len(idx) == 0 for idx, _w in s)
    assert sum(len(idx) for idx, _w in CodedSampler(10, 4, scheme=scheme, rank=1)) > 0
    out = torch.randn(3, 5, requires_grad=True)
    y = torch.tensor([0, 1, 2])
    w = torch.tensor([1.0, 0.0, 2.0])
    loss = weighted_loss(torch.nn.functional.cross_entropy, out, y, w)
    per = torch.nn.functional.cross_entropy(out, y, reduction="none")
    assert torch.allclose(loss, per[0] + 2 * per[2])


def test_a_trainer_exiting_while_a_future_completes_exits_cleanly() -> None:
    # The completer thread is still inside torch's set_result (a callback chained on the
    # future runs) when the trainer's main thread returns: CPython would end that daemon
    # thread with a forced unwind through torch's C++ and abort (exit 134); the completer is
    # joined at exit instead.
    code = ("import concurrent.futures, threading, torch\n"
            "from aioreduce.torch.completer import Completer\n"
            "running = threading.Event()\n"
            "def chained(_f):\n"
            "    running.set()\n"
            "    threading.Event().wait(0.3)  # the callback's own work\n"
            "    return 1\n"
            "fut = torch.futures.Future()\n"
            "after = fut.then(chained)\n"
            "done = concurrent.futures.Future()\n"
            "Completer(0).add(done, fut, lambda r: r)\n"
            "done.set_result(7)\n"
            "running.wait()\n"
            "print('left', flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "left" in out.stdout, (out.returncode, out.stderr)
    assert "terminate called" not in out.stderr


class _SumsInPlaceThenFails:
    """A group whose first sums land in the tensor at once (as the ring's, on a CPU tensor,
    chunk by chunk) and then fail (a rank died); its rerun records what it was handed."""

    def __init__(self) -> None:
        self.reran: list[torch.Tensor] = []
        self.node = self  # pg.node (SyncNode) and pg.node.node (Node) in one

    world_size, rank = 4, 0

    class mesh:
        class incarnations:
            rejoined = False

    def replace_lost(self) -> bool:
        return True

    def future_sum(self, t: torch.Tensor, *, average: bool, rerun: bool,
                   last: bool = False) -> object:
        fut: torch.futures.Future[object] = torch.futures.Future()
        if self.reran or t.numel() > 3:  # the rerun: one vector of the whole gradient
            self.reran.append(t.clone())
            fut.set_result(t)
        else:
            t.mul_(4)  # a partial sum is already in
            fut.set_exception(RuntimeError("rank 2: lane from rank 2 closed"))
        return fut


class _Bucket:
    def __init__(self, params: list[torch.Tensor], last: bool) -> None:
        self.params, self.last = params, last
        self.buf = torch.cat([p.grad.reshape(-1) for p in params])

    def buffer(self) -> torch.Tensor:
        return self.buf

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def is_last(self) -> bool:
        return self.last


def test_a_ddp_iteration_runs_again_with_this_ranks_own_gradient_not_a_partial_sum() -> None:
    from aioreduce.torch.ddp_heal import Iterations

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    a.grad, b.grad = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])
    pg = _SumsInPlaceThenFails()
    it = Iterations(torch.nn.ParameterList([a, b]), pg)  # type: ignore[arg-type]
    first, last = _Bucket([b], last=False), _Bucket([a], last=True)
    outs = [it.hook(first), it.hook(last)]  # type: ignore[arg-type]
    for out in outs:
        out.wait()
    assert len(pg.reran) == 1  # the rerun path was taken, once
    assert pg.reran[0].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]  # own gradients, params' order


class _JoinerWhoseRerunFails(_SumsInPlaceThenFails):
    """A replacement's group (its first iteration sums only the whole gradient) whose sum
    fails, and whose next wait for a replacement gives up."""

    class mesh:
        class incarnations:
            rejoined = True

    def replace_lost(self) -> bool:
        return False

    def future_sum(self, t: torch.Tensor, *, average: bool, rerun: bool,
                   last: bool = False) -> object:
        self.reran.append(t.clone())
        fut: torch.futures.Future[object] = torch.futures.Future()
        fut.set_exception(RuntimeError("rank 3: lane from rank 3 closed"))
        return fut


def test_a_failed_rerun_with_no_replacement_names_its_own_error() -> None:
    """The buckets' own sums held no error (a joiner's, or ones that succeeded before the
    rerun failed): the error DDP gets is the rerun's, not an empty StopIteration."""
    from aioreduce.torch.ddp_heal import Iterations

    a = torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([1.0, 2.0])
    pg = _JoinerWhoseRerunFails()
    it = Iterations(torch.nn.ParameterList([a]), pg)  # type: ignore[arg-type]
    out = it.hook(_Bucket([a], last=True))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"lane from rank 3 closed; the iteration was "
                                           r"not run again: no replacement came"):
        out.wait()
    assert len(pg.reran) == 1  # the joiner's rerun was tried, once
