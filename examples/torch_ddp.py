"""Stock PyTorch DDP on aioreduce: an MLP on scikit-learn's digits.

    aioreduce-launch -n 4 -- python examples/torch_ddp.py                    # the backend
    torchrun --nproc_per_node 4 examples/torch_ddp.py --scheme transpose
    aioreduce-launch -n 4 -- python examples/torch_ddp.py --via hook --straggle 'rank=2:delay=0.05'

``--via backend`` (default): ``dist.init_process_group(backend="aioreduce")`` and torch's own
``DistributedDataParallel``, unchanged. ``--via hook``: the same process group, with
``aioreduce.torch.DistributedDataParallel``, which routes the gradient buckets through our
communication hook (and re-syncs replicas when a bounded-time scheme asks for it). ``--scheme``
picks the allreduce (ring, tree, star, transpose; under transpose a step that lost more than 5 %
of the gradients waits for the rest). Each rank trains on its own share of every
epoch's shuffled training set; rank 0 prints every epoch's median step time, the loss, the
test accuracy and, under ``transpose``, how much of the gradients arrived in time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits import accuracy, digits, mlp

import aioreduce as ar
import aioreduce.torch as art


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--via", choices=["backend", "hook"], default="backend")
    ap.add_argument("--scheme", default="ring", help="ring, tree, star or transpose")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--straggle", default="", help="e.g. 'rank=2:delay=0.05' (see README)")
    ap.add_argument("--backend", choices=["aioreduce", "gloo"], default="aioreduce",
                    help="gloo: the same program over torch's Gloo (to compare)")
    ap.add_argument("--hidden", type=int, default=128, help="the MLP's hidden width")
    ap.add_argument("--options", default="{}",
                    help='the scheme\'s options as JSON, e.g. \'{"hadamard": false}\'')
    a = ap.parse_args()
    delays = None
    if a.straggle and a.backend == "gloo":
        # Gloo has no injection of its own: the same model's delay before each backward pass
        # (where our node waits before its contribution)
        delays = ar.straggle.parse_seeded(a.straggle)
    elif a.straggle:
        os.environ["AIOREDUCE_STRAGGLE"] = a.straggle
    # Under transpose, a step that lost more than max_loss (5 %) waits for the rest instead of
    # raising inside backward(): training goes on, never on a worse sum.
    options = {"on_excess_loss": "wait", **json.loads(a.options)}
    art.configure(ar.schemes.by_name(a.scheme, strict=False, **options))
    torch.set_num_threads(1)
    dist.init_process_group(backend=a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    if a.via == "hook":
        assert isinstance(pg, art.ProcessGroupAioreduce), "--via hook needs --backend aioreduce"
        model = art.DistributedDataParallel(mlp(a.hidden), pg)
    else:
        model = torch.nn.parallel.DistributedDataParallel(mlp(a.hidden))
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    xtr, ytr, xte, yte = digits()
    dist.barrier()
    start = time.perf_counter()  # the training's wall time, as rank 0 sees it
    for epoch in range(a.epochs):
        order = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(epoch))
        mine = order[rank::world]
        times, losses = [], []
        steps = len(order) // (world * a.batch)  # the same number of steps on every rank
        for s in range(steps):
            idx = mine[s * a.batch:(s + 1) * a.batch]
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            if delays is not None:
                time.sleep(delays.extra_delay(rank, epoch * steps + s, 0.0, world))
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        results = pg.take_results() if isinstance(pg, art.ProcessGroupAioreduce) else []
        if rank == 0:
            got = min((r.received for r in results), default=1.0)
            elapsed = time.perf_counter() - start
            test = accuracy(model.module, xte, yte)
            print(f"epoch {epoch:2d}  step {statistics.median(times) * 1e3:7.2f} ms  "
                  f"loss {statistics.mean(losses):.4f}  test accuracy "
                  f"{test:.3f}  least received {got:.3f}", flush=True)
            print("EPOCH " + json.dumps({"epoch": epoch, "elapsed_s": elapsed,
                                         "loss": statistics.mean(losses), "test": test,
                                         "median_step_s": statistics.median(times),
                                         "steps_s": times,
                                         "received": got}), flush=True)
            start += time.perf_counter() - start - elapsed  # (the test is not training time)
    if rank == 0:
        print("SUMMARY " + json.dumps({"via": a.via, "scheme": a.scheme, "ranks": world,
                                       "backend": a.backend,
                                       "test_accuracy": accuracy(model.module, xte, yte)}))
    # Every rank done before any tears down: Gloo's teardown on one rank while another still
    # finishes aborted the process (SIGABRT, about 1 run in 7 here without this barrier).
    dist.barrier()
    # DDP's reducer holds the process group, and modules hold cycles: left to the collector,
    # Gloo's group (and its worker threads) would be destroyed at interpreter exit, where a
    # joinable thread's destructor aborts the process ("terminate called without an active
    # exception", about 1 run in 8 over Gloo with the barrier alone).
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
