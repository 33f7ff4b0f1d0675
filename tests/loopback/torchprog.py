"""One rank of a small torch DDP job, for the parity and fault tests (run by the harness).

    torchprog.py MODE --steps N --out DIR

MODE: ``gloo`` (stock DDP over Gloo), ``hook`` (stock DDP, buckets through aioreduce's
communication hook on ``aioreduce.connect(scheme=Ring())``), ``backend``
(``init_process_group(backend="aioreduce")`` and stock DDP, no hook) or ``optimizer`` (no DDP:
``aioreduce.torch.DistributedOptimizer`` with small buckets, so several are in flight).
Every rank trains the same MLP on its own seeded batches and writes its final parameters to
``DIR/MODE.RANK.npy``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import aioreduce as ar
import aioreduce.torch as art


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


MODES = ("gloo", "hook", "backend", "optimizer")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("modes", help="one of gloo, backend; or hook, optimizer or both "
                                  "(comma-separated: one after the other on one node)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (ranks share one GPU)")
    a = ap.parse_args()
    modes = a.modes.split(",")
    if not set(modes) <= set(MODES) or (len(modes) > 1
                                        and not set(modes) <= {"hook", "optimizer"}):
        ap.error(f"modes {a.modes!r}: one of gloo, backend; or hook, optimizer or both")
    rank = int(os.environ["RANK"])
    dev = torch.device(a.device)
    node = None
    if modes[0] in ("gloo", "backend"):
        dist.init_process_group("aioreduce" if modes[0] == "backend" else "gloo")
    else:
        node = ar.connect(scheme=ar.Ring())
        if a.device == "cuda":  # the node's own call takes a GPU tensor too
            res = node.allreduce(torch.full((3,), float(rank), device=dev), op="mean")
            print(f"NODE_TENSOR {res.value.device.type} {res.value.tolist()}", flush=True)
    for mode in modes:
        train(mode, node, rank, dev, a.steps, a.out)
    if node is not None:
        node.close()
    else:
        dist.destroy_process_group()
    if modes == ["gloo"]:
        # Gloo's threads sometimes abort the interpreter's exit under torch 2.13 ("terminate
        # called without an active exception", 1 run in 4 here): the reference run is over.
        sys.stdout.flush()
        os._exit(0)


def train(mode: str, node: ar.Node | None, rank: int, dev: torch.device, steps: int,
          out: str) -> None:
    """``steps`` steps of ``mode`` from its own seeds (as in a process of its own)."""
    if mode == "hook":
        assert node is not None
        model = art.DistributedDataParallel(mlp().to(dev), node)
    elif mode == "optimizer":
        model = mlp().to(dev)
    else:
        model = DistributedDataParallel(mlp().to(dev))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if mode == "optimizer":
        assert node is not None
        opt = art.DistributedOptimizer(opt, node, bucket_bytes=64 << 10)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(steps):
        x = torch.randn(32, 64, generator=gen).to(dev)
        y = torch.randint(0, 10, (32,), generator=gen).to(dev)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        print(f"STEP {step} loss {loss.item():.6f}", flush=True)
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu().numpy()
    np.save(os.path.join(out, f"{mode}.{rank}.npy"), flat)
    if mode == "hook":  # the path: every bucket went through our hook
        print(f"HOOKED {len(model.process_group.last_results)}", flush=True)
    elif mode == "optimizer":  # the path: several buckets summed per step
        print(f"BUCKETS {len(opt.results)}", flush=True)
    else:
        print(f"BACKEND {dist.get_backend()}", flush=True)


if __name__ == "__main__":
    main()
