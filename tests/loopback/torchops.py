"""One rank exercising the "aioreduce" torch backend's collectives; prints ``OP name value``.

    torchops.py [--mismatch]

``--mismatch``: rank 1 builds another model and wraps it with aioreduce's DDP, which must
raise the same error on every rank.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import aioreduce as ar
import aioreduce.torch as art


def say(name: str, value: object) -> None:
    print(f"OP {name} {json.dumps(value)}", flush=True)


def ops() -> None:
    dist.init_process_group(backend="aioreduce")
    r, n = dist.get_rank(), dist.get_world_size()
    say("backend", dist.get_backend())
    for op in ("SUM", "AVG", "MIN", "MAX", "PRODUCT"):
        t = torch.tensor([float(r + 1), float(2 * r)])
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        say(op, t.tolist())
    strided = torch.zeros(3, 2)[:, 0]  # not contiguous: the result must still land in it
    strided += r + 1
    dist.all_reduce(strided)
    say("strided", strided.tolist())
    t = torch.tensor([r, 1], dtype=torch.int64)
    dist.all_reduce(t)
    say("int_sum", t.tolist())
    works = [dist.all_reduce(torch.full((3,), float(i)), async_op=True) for i in range(3)]
    for w in works:
        w.wait()
    held = [torch.full((1000 * (i + 1),), float(r)) for i in range(3)]  # shapes change per call
    works = [dist.all_reduce(h, async_op=True) for h in held]
    for w in works:
        w.wait()
    say("async", [float(h[0]) for h in held])
    b = torch.full((2,), float(r))
    dist.broadcast(b, src=n - 1)
    say("broadcast", b.tolist())
    outs = [torch.zeros(2) for _ in range(n)]
    dist.all_gather(outs, torch.full((2,), float(r)))
    say("all_gather", [o.tolist() for o in outs])
    flat = torch.zeros(2 * n)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(r)))
    say("all_gather_into_tensor", flat.tolist())
    rs = torch.zeros(2)
    dist.reduce_scatter(rs, [torch.full((2,), float(i + r)) for i in range(n)])
    say("reduce_scatter", rs.tolist())
    rs = torch.zeros(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * n))
    say("reduce_scatter_tensor", rs.tolist())
    red = torch.tensor([float(r + 1)])
    dist.reduce(red, dst=0)
    say("reduce", red.tolist())
    dist.barrier()
    dist.destroy_process_group()


def mismatch() -> None:
    with ar.connect(scheme=ar.Ring()) as node:
        width = 7 if node.rank == 1 else 8
        try:
            art.DistributedDataParallel(torch.nn.Linear(4, width), node)
        except ValueError as exc:
            say("mismatch", str(exc))


def optim() -> None:
    """DistributedOptimizer: accumulation over 2 passes, a refused commit, zero_grad while
    reductions are in flight, skip_synchronize around clipping."""
    with ar.connect(scheme=ar.Ring()) as node:
        res = node.allreduce(torch.tensor([float(node.rank + 1), 2.0]), op="mean")
        say("tensor_mean", [type(res.value).__name__, res.value.tolist()])
        w = torch.nn.Parameter(torch.ones(1))
        c = float(node.rank + 1)
        opt = art.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), node,
                                       backward_passes_per_step=2)
        (w * c).sum().backward()
        (w * 10 * c).sum().backward()  # the second pass starts the reduction
        try:
            opt.zero_grad()
        except RuntimeError as exc:
            say("zero_grad_in_flight", str(exc))
        opt.synchronize()
        say("accumulated", float(w.grad[0]))  # mean over ranks of 11 * (rank + 1)
        torch.nn.utils.clip_grad_norm_([w], 1.0)
        with opt.skip_synchronize():
            opt.step()
        say("after_clipped_step", float(w[0]))
        refuse = art.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), node,
                                          should_commit=lambda results: False)
        refuse.zero_grad()
        (w * c).sum().backward()
        refuse.step()
        say("refused", [refuse.committed, float(w[0]), len(refuse.results)])
        # Sums through the process group land in the tensor itself (the ring sums in place:
        # no result buffer is taken from its pool, only its scratch: on two ranks one half of
        # the vector per sum, reused), and the group keeps their reports, not their values.
        pg = art.ProcessGroupAioreduce(node)
        pool = node.node.session.pool  # type: ignore[union-attr]
        before = pool.reused
        grad = torch.full((4096,), float(node.rank))
        for _ in range(6):
            pg.future_sum(grad, average=True).wait()
        kept = pg.take_results()
        largest = max(a.size for a in pool._arrays)
        say("pooled", [pool.reused - before, largest, len(kept),
                       max(r.value.size for r in kept), float(grad[0])])
        pg.shutdown()


def hook_error() -> None:
    """A sum that fails inside our DDP hook (Transpose losing more than max_loss, on purpose)
    must reach backward() with our message, not torch's "Unable to cast"."""
    scheme = ar.Transpose(inject_loss=0.5, max_loss=0.01, warmup=1, hadamard=False,
                          slice_bytes=256)
    with ar.connect(scheme=scheme) as node:
        torch.manual_seed(0)
        ddp = art.DistributedDataParallel(torch.nn.Linear(64, 64), node)
        for step in range(2):  # the warm-up step waits for everything; the next one fails
            try:
                ddp(torch.randn(8, 64)).sum().backward()
                say(f"hook{step}", "ok")
            except RuntimeError as exc:
                say(f"hook{step}", f"{type(exc).__name__}: {exc}"[:300])
                break


def resync() -> None:
    """aioreduce's DDP over a lossy Transpose: replicas drift, then every resync_every steps
    the parameters are re-synced from rank 0 before the next forward. The loss is injected
    (slices dropped after they arrived); the bounds are kept long (``min_deadline``): a rank
    descheduled for two short bounds on a loaded machine fell two steps behind its peers
    (``FellBehind``, once in a CI run), which is not what this test is about."""
    scheme = ar.Transpose(resync_every=3, inject_loss=0.3, max_loss=1.0, hadamard=False,
                          warmup=2, slice_bytes=256, min_deadline=0.25)
    with ar.connect(scheme=scheme) as node:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        ddp = art.DistributedDataParallel(model, node)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pg = ddp.process_group
        gen = torch.Generator().manual_seed(node.rank)
        for step in range(12):
            opt.zero_grad()
            out = ddp(torch.randn(8, 64, generator=gen))
            at_forward = torch.nn.utils.parameters_to_vector(model.parameters()).tolist()
            out.sum().backward()
            opt.step()
            results = pg.take_results()
            say(f"step{step}", {"resync": any(r.resync for r in results),
                                "received": min(r.received for r in results),
                                "params": at_forward})


if __name__ == "__main__":
    if "--resync" in sys.argv:
        resync()
    elif "--hook-error" in sys.argv:
        hook_error()
    elif "--mismatch" in sys.argv:
        mismatch()
    elif "--optim" in sys.argv:
        optim()
    else:
        ops()
