"""One rank of a small training run over a torch.distributed backend, for parity tests.

    torchtrain.py MODE[,MODE...] BACKEND OUT [--device cpu|cuda] [--steps N]

MODE (several, comma-separated, run one after the other in the same process group, each as
it would run alone: torch's start-up, about 2.3 s of CPU a rank, is paid once):
* ``fsdp``: a 2-layer transformer under FSDP2 (``fully_shard`` per layer and at the root,
  over ``init_device_mesh(DEVICE, (WORLD,))``), AdamW, float32.
* ``fsdp-bf16``: the same with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``.
* ``ddp``: stock DDP of an MLP, SGD with momentum, float32.
* ``ddp-bf16``: the same MLP cast to bfloat16 (``model.to(torch.bfloat16)``).
* ``sum-bf16``: no training: one ``all_reduce`` (sum) of 2^20 random bfloat16 values per
  rank; saves the result's error against the exact sum (float64) of the same values.

Every rank trains on its own seeded batches and saves its parameters (its own shards under
FSDP2) as float64 to ``OUT/MODE.BACKEND.RANK.npy``; it prints ``LOSS`` per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torchprog import mlp  # the same MLP as the DDP parity test (this script's folder)

import aioreduce.torch  # noqa: F401  (registers "aioreduce")


def transformer() -> torch.nn.Module:
    # Without biases: an attention key's bias has a gradient that is zero in exact arithmetic
    # (softmax ignores it), so what the sums leave of it is rounding noise, and AdamW turns
    # noise of either sign into a full step of either sign. Any two summation orders (Gloo's
    # ring against our owners' rank order, or Gloo against itself with another algorithm)
    # then end 1e-3 apart in those parameters alone.
    torch.manual_seed(0)
    layers = [torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True,
                                               bias=False)
              for _ in range(2)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(32, 8))


MODES = ("fsdp", "fsdp-bf16", "ddp", "ddp-bf16", "sum-bf16")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("modes", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("backend")
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=0)
    a = ap.parse_args()
    modes = a.modes.split(",")
    if not set(modes) <= set(MODES):
        ap.error(f"unknown mode in {a.modes!r} (of {', '.join(MODES)})")
    device = torch.device(a.device)
    if a.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))
                              % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(a.backend, timeout=timedelta(seconds=120))
    for mode in modes:
        run(mode, a.backend, a.out, a.device, device, a.steps)
    dist.destroy_process_group()
    if a.backend == "gloo":  # see torchprog.py: Gloo's threads may abort the exit
        sys.stdout.flush()
        os._exit(0)


def run(mode: str, backend: str, out: str, kind: str, device: torch.device, steps: int
        ) -> None:
    """One MODE, from its own seeds (as in a process of its own)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1000 + rank)
    if mode == "sum-bf16":
        # 2 MiB of bf16: more than one lane chunk, at least PIECES_FROM.
        every = [torch.randn(1 << 20, generator=torch.Generator().manual_seed(1000 + r))
                 .to(torch.bfloat16) for r in range(world)]
        exact = torch.stack([v.double() for v in every]).sum(0)
        mine = every[rank].to(device)
        dist.all_reduce(mine)
        error = (mine.to("cpu", torch.float64) - exact).abs()
        np.save(os.path.join(out, f"{mode}.{backend}.{rank}.npy"), error.numpy())
        print(f"BACKEND {dist.get_backend()} MEAN_ERROR {float(error.mean()):.6g}", flush=True)
        return
    if mode.startswith("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        model = transformer().to(device)
        mesh = init_device_mesh(kind, (world,))
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
              if mode == "fsdp-bf16" else MixedPrecisionPolicy())
        for layer in list(model)[:2]:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        steps = steps or 8

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.randn(4, 6, 32, generator=gen).to(device),
                    torch.randint(0, 8, (4, 6), generator=gen).to(device))

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(model(x).float().reshape(-1, 8),
                                                     y.reshape(-1))
    else:
        from torch.nn.parallel import DistributedDataParallel
        net = mlp().to(device)
        if mode == "ddp-bf16":
            net = net.to(torch.bfloat16)
        model = DistributedDataParallel(net, device_ids=[device] if kind == "cuda" else None)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        steps = steps or 10
        dtype = next(net.parameters()).dtype

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.randn(32, 64, generator=gen).to(device, dtype),
                    torch.randint(0, 10, (32,), generator=gen).to(device))

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(model(x).float(), y)
    times = []
    for step in range(steps):
        x, y = batch()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(x, y)
        loss.backward()
        opt.step()
        if kind == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        print(f"LOSS {step} {loss.item():.6f}", flush=True)
    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1).to("cpu", torch.float64) for p in params])
    np.save(os.path.join(out, f"{mode}.{backend}.{rank}.npy"), flat.numpy())
    print(f"BACKEND {dist.get_backend()} STEP_MS {1e3 * float(np.median(times[1:])):.3f}",
          flush=True)

if __name__ == "__main__":
    main()
