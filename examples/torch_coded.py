"""Coded mini-batches in PyTorch: an MLP on scikit-learn's digits with CodedReduce.

    aioreduce-launch -n 13 -- python examples/torch_coded.py --straggle 'rank=4:slow=3'
    torchrun --nproc_per_node 13 examples/torch_coded.py --straggle 'rank=7:delay=0.2'

``CodedTree(3, 2, 1)`` (13 ranks; ``--fanout``/``--levels``/``--stragglers`` for others): every
step, every rank derives the same global mini-batch (``CodedSampler``, from ``seed + epoch``),
computes one backward of its weighted share (``weighted_loss``) and the tree decodes the exact
gradient of the whole mini-batch from whichever ranks are fast enough. The last partial batch
of an epoch is used too. Rank 0 prints every step's time and the ranks that were skipped, and
every epoch's loss and test accuracy. Works under ``aioreduce-launch`` and ``torchrun`` alike
(the ranks meet through torch's store: ``aioreduce.torch.connect``). Under
``aioreduce-launch --restart N`` a rank that dies is started again and heals the model and the
optimizer from a live peer (``aioreduce.torch.state_hooks``), then goes on from the job's step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits import accuracy, digits, mlp

import aioreduce as ar
import aioreduce.torch as art


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fanout", type=int, default=3)
    ap.add_argument("--levels", type=int, default=2)
    ap.add_argument("--stragglers", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch", type=int, default=128, help="global mini-batch size")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--straggle", default="", help="e.g. 'rank=4:slow=3' (see README)")
    ap.add_argument("--quiet", action="store_true", help="epoch lines only")
    a = ap.parse_args()
    if a.straggle:
        os.environ["AIOREDUCE_STRAGGLE"] = a.straggle
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = digits()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    scheme = ar.CodedTree(a.fanout, a.levels, a.stragglers)
    with art.connect(scheme, state=art.state_hooks(model, opt)) as node:
        sampler = art.CodedSampler(len(ytr), a.batch, node=node, seed=1)
        step, times = 0, []
        for epoch in range(a.epochs):
            sampler.set_epoch(epoch)
            for idx, w in sampler:
                if step < node.step:  # this process replaced a dead one: healed to node.step
                    step += 1
                    continue
                t0 = time.perf_counter()
                opt.zero_grad()
                art.weighted_loss(F.cross_entropy, model(xtr[idx]), ytr[idx], w).backward()
                res = node.aggregate(lambda: art.flat_grad(model))
                art.apply_flat(model, res.value)
                opt.step()
                times.append(time.perf_counter() - t0)
                if node.rank == 0 and not a.quiet:
                    print(f"step {step:4d}  {times[-1] * 1e3:7.2f} ms  batch "
                          f"{len(sampler.batch):3d}  skipped {res.late}", flush=True)
                step += 1
            if node.rank == 0 and times:
                with torch.no_grad():
                    loss = F.cross_entropy(model(xtr), ytr).item()
                print(f"epoch {epoch:2d}  median step {statistics.median(times) * 1e3:7.2f} ms"
                      f"  train loss {loss:.4f}  test accuracy "
                      f"{accuracy(model, xte, yte):.3f}", flush=True)
                times = []
        # The last lines, each in one write: under torchrun every rank shares one stdout, and
        # print() writes a line and its newline apart (another rank's line came between).
        if node.rank == 0:
            _line("SUMMARY", {"scheme": "coded-tree", "ranks": node.world_size, "steps": step,
                              "test_accuracy": accuracy(model, xte, yte)})
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                         for p in model.parameters())).hexdigest()
        _line("FINAL", {"rank": node.rank, "params": digest[:16]})


def _line(tag: str, record: dict[str, object]) -> None:
    sys.stdout.write(f"{tag} {json.dumps(record)}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
