"""A torch training run whose ranks may die and come back, for the heal tests.

    torchheal.py [--mode optimizer|ddp|stock] [--model mlp|transformer|bn] [--steps N]
                 [--bucket-bytes B] [--kill RANK:ITER] [--pace SECONDS] [--device cpu|cuda]
                 [--init connect|pg]

Each iteration's gradient goes through :class:`aioreduce.torch.DistributedOptimizer`
(``optimizer``) or DDP (``aioreduce.torch.DistributedDataParallel``, ``ddp``; torch's own
class built here over the default group, ``stock``) over the ring, in several buckets (one
sum each). The state hooks carry the model, the optimizer and
the iteration, and every rank's batch is a function of (rank, iteration), so a replacement
that healed computes what the dead process would have: the run ends as an undisturbed one.
``--kill R:I``: rank R's first process SIGKILLs itself in iteration I, in the middle of its
backward pass (once the middle layer's gradient is in: the last layer's bucket is summing).
``--kill-in forward|step`` moves the kill to the forward pass or the optimizer's step.
``--model transformer``: a small transformer encoder (two layers) classifying token
sequences, instead of the MLP. Prints ``FINAL {"rank": R, "params": DIGEST, "iterations": N,
"loss": L}`` per rank, L the model's loss at the end on a batch every rank holds alike.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import aioreduce as ar
import aioreduce.torch as art
from aioreduce.sync import SyncNode


class Transformer(torch.nn.Module):
    """Token sequences to one of 10 classes: an embedding, two encoder layers (no dropout:
    the ranks' replicas stay alike), the mean over the sequence, a linear head."""

    def __init__(self, vocab: int = 50, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def _batch(model: str, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch that depends only on ``seed`` (a rank's iteration, or the final check)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randint(0, 50, (64, 16), generator=gen) if model == "transformer"
         else torch.randn(64, 32, generator=gen))
    # Labels the transformer can learn (how many of the sequence's tokens are below 5: its
    # mean pooling sees that), so its loss falls.
    y = ((x < 5).sum(dim=1).clamp(max=9) if model == "transformer"
         else torch.randint(0, 10, (64,), generator=gen))
    return x.to(device), y.to(device)


@contextlib.contextmanager
def _joined(init: str, hooks: ar.StateHooks) -> Iterator[SyncNode]:
    """The job's node: from :func:`aioreduce.torch.connect`, or the default process group's."""
    if init == "connect":
        with art.connect(ar.Ring(), state=hooks) as node:
            yield node
        return
    art.configure(ar.Ring(), state=hooks)
    dist.init_process_group("aioreduce")
    try:
        yield dist.distributed_c10d._get_default_group().node  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("optimizer", "ddp", "stock"), default="optimizer",
                    help="stock: torch's own DistributedDataParallel class, built here over "
                    "the default group (needs --init pg)")
    ap.add_argument("--model", choices=("mlp", "transformer", "bn"), default="mlp",
                    help="bn: the MLP with a BatchNorm1d (buffers DDP syncs from rank 0)")
    ap.add_argument("--steps", type=int, default=60, help="training iterations")
    ap.add_argument("--bucket-bytes", type=int, default=8_000)
    ap.add_argument("--kill", default="", help="RANK:ITERATION")
    ap.add_argument("--kill-in", choices=("backward", "forward", "step"), default="backward",
                    help="where the kill lands: the backward pass (a bucket summing), the "
                    "forward pass, or the optimizer's step (every sum of the iteration done)")
    ap.add_argument("--trace", action="store_true",
                    help="print IT ITERATION INCARNATION [rank 0's parameters, every 97th] to "
                    "stderr after every iteration (the soak's per-heal check)")
    ap.add_argument("--save", default="", help="PREFIX: write PREFIX.RANK.npy")
    ap.add_argument("--pace", type=float, default=0.0, help="seconds of sleep an iteration "
                    "(the soak's: a longer run)")
    ap.add_argument("--init", choices=("connect", "pg"), default="connect",
                    help="how the ranks meet: aioreduce.torch.connect, or "
                    "init_process_group(backend='aioreduce') with the state hooks given to "
                    "aioreduce.torch.configure (DDP and the optimizer over the default group)")
    ap.add_argument("--device", default="cpu", help="where the model and batches live "
                    "(cuda: the sums staged through host memory, as our users' GPUs)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model: torch.nn.Module
    if a.model == "transformer":
        model = Transformer().to(a.device)
        middle: torch.nn.Module = model.encoder.layers[1].linear1  # where a kill lands
    else:
        norm = [torch.nn.BatchNorm1d(64)] if a.model == "bn" else []
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), *norm, torch.nn.ReLU(),
                                    torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 10)).to(a.device)
        middle = model[2 + len(norm)]
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    it = 0

    def get_it() -> int:
        return it

    def set_it(value: int) -> None:
        nonlocal it
        it = value

    hooks = art.state_hooks(model, sgd, extra=(get_it, set_it))
    with _joined(a.init, hooks) as node:
        given = node if a.init == "connect" else None  # the default group's otherwise
        if a.kill and not node.node.mesh.incarnations.rejoined:
            victim, at = (int(x) for x in a.kill.split(":"))

            def die(*_args: object) -> None:
                if node.rank == victim and it == at:
                    os.kill(os.getpid(), signal.SIGKILL)

            if a.kill_in == "backward":
                middle.weight.register_post_accumulate_grad_hook(die)  # type: ignore[operator]
            elif a.kill_in == "forward":
                middle.register_forward_pre_hook(die)
            else:
                sgd.register_step_pre_hook(die)
        opt: art.DistributedOptimizer | torch.optim.Optimizer = sgd
        if a.mode == "ddp":
            net = art.DistributedDataParallel(model, given, bucket_cap_mb=a.bucket_bytes / 2**20)
        elif a.mode == "stock":  # as a program written for any backend builds it
            net = torch.nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=a.bucket_bytes / 2**20)
        else:
            net = model
            opt = art.DistributedOptimizer(sgd, given, bucket_bytes=a.bucket_bytes)
        while it < a.steps:
            x, y = _batch(a.model, 1000 * node.rank + it, a.device)
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            if a.pace:
                time.sleep(a.pace)
            loss.backward()
            opt.step()
            it += 1
            if a.trace:  # every iteration: who ran it, and rank 0's parameters (a sample)
                sample = "" if node.rank else " ".join(
                    f"{v:.17g}" for v in torch.cat([p.detach().reshape(-1).double().cpu()
                                                    for p in model.parameters()])[::97].tolist())
                print(f"IT {it} {node.node.mesh.incarnations.mine} {sample}", file=sys.stderr,
                      flush=True)
            if it == 1 and node.rank == 0:  # the soak's cue: the job runs
                print("TRAINING", file=sys.stderr, flush=True)
        buckets = (len(net.reducer._get_zeros_like_grad_buckets()) if a.mode != "optimizer"
                   else len(opt._buckets))  # type: ignore[union-attr]
        digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                         for p in model.parameters())).hexdigest()
        with torch.no_grad():  # the same batch on every rank, none trained on
            x, y = _batch(a.model, 10**9, a.device)
            final_loss = float(F.cross_entropy(model(x), y))
        if a.save:  # the parameters, for comparisons within rounding
            np.save(f"{a.save}.{node.rank}.npy", torch.cat(
                [p.detach().reshape(-1).double().cpu() for p in model.parameters()]).numpy())
        sys.stdout.write("FINAL " + json.dumps({"rank": node.rank, "params": digest[:16],
                                                "iterations": it, "buckets": buckets,
                                                "loss": final_loss})
                         + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
