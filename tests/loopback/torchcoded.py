"""One rank of a coded mini-batch torch job (``CodedTree(3, 2, 1)``, 13 ranks), for tests.

    torchcoded.py --epochs E --batch B --out DIR [--samples 1797]

Synthetic data (seeded, the same on every rank), an MLP, SGD on the decoded gradient. Rank 0
also computes the single-process gradient of every step's global batch and prints the relative
error of the decoded one; every rank prints its steps and writes its final parameters to
``DIR/coded.RANK.npy``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

import aioreduce as ar
from aioreduce.torch.coded import CodedSampler, apply_flat, flat_grad, weighted_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--samples", type=int, default=1797)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (ranks share one GPU)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(a.device)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(a.samples, 64, generator=gen)
    teacher = torch.randn(64, 10, generator=gen)
    y = (x @ teacher).argmax(1)
    x, y = x.to(dev), y.to(dev)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(),
                                torch.nn.Linear(128, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with ar.connect(scheme=ar.CodedTree(3, 2, 1)) as node:
        sampler = CodedSampler(a.samples, a.batch, node=node, seed=3)
        step = 0
        for epoch in range(a.epochs):
            sampler.set_epoch(epoch)
            for idx, w in sampler:
                t0 = time.time()
                opt.zero_grad()
                idx = torch.from_numpy(idx).to(dev)
                weighted_loss(F.cross_entropy, model(x[idx]), y[idx], w.to(dev)).backward()
                res = node.aggregate(flat_grad(model))
                line: dict[str, object] = {"step": step, "epoch": epoch,
                                           "batch": len(sampler.batch), "late": res.late,
                                           "exact": res.exact, "t0": t0, "t1": time.time()}
                if node.rank == 0:  # the single-process gradient of the same global batch
                    ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(),
                                              torch.nn.Linear(128, 10)).to(dev)
                    ref.load_state_dict(model.state_dict())
                    batch = torch.from_numpy(sampler.batch).to(dev)
                    loss = F.cross_entropy(ref(x[batch]), y[batch])
                    loss.backward()
                    want = flat_grad(ref)
                    err = (res.value - want).norm() / want.norm()
                    line.update(loss=loss.item(), rel_err=err.item(),
                                device=res.value.device.type)
                print("STEP " + json.dumps(line), flush=True)
                apply_flat(model, res.value)
                opt.step()
                step += 1
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu().numpy()
    np.save(os.path.join(a.out, f"coded.{node.rank}.npy"), flat)


if __name__ == "__main__":
    main()
