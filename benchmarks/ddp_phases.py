"""Where a DDP training step goes, Gloo's DDP against ours, phase by phase.

Run under the launcher, e.g. 4 ranks sharing one GPU (or the CPU where there is none)::

    AIOREDUCE_TRACE=/tmp/trc python -m aioreduce_launch.cli -n 4 -- \\
        python benchmarks/ddp_phases.py [float32|bfloat16]

Each rank trains the MLP of ``aioreduce-bench ddp --hidden 1750`` (6.6M parameters) with
Gloo's DDP and with ours, alternating step by step after a barrier, and prints the median
milliseconds of: forward, ``backward()`` until it returns (DDP has the buckets summed by
then), the GPU work still queued after it, and the optimizer step. It also prints when DDP
handed each bucket of the last step to our hook, from the first one. With
``AIOREDUCE_TRACE`` set, ``aioreduce-trace`` or the JSON lines give each of our ring steps'
duration.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import aioreduce as ar
import aioreduce.torch as art
from aioreduce.bench.ddp import _device, _model


def main() -> None:
    torch.set_num_threads(1)
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
    cuda = torch.cuda.is_available()
    dev = _device("cuda" if cuda else "cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    node = ar.connect(scheme=ar.Ring())
    rank, world = node.rank, node.world_size
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def model() -> Any:
        return _model(1750).to(dev, dtype)

    pg = art.ProcessGroupAioreduce(node)
    ids = [dev] if cuda else None
    models = {"gloo": DistributedDataParallel(model(), device_ids=ids),
              "ours": art.DistributedDataParallel(model(), pg, device_ids=ids)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    x = torch.randn(32, 256, device=dev, dtype=dtype)
    y = torch.randint(0, 10, (32,), device=dev)
    phases: dict[str, list[np.ndarray]] = {k: [] for k in models}
    handed: list[tuple[float, int]] = []  # (when, elements) of the buckets of our last step
    future_sum = art.ProcessGroupAioreduce.future_sum

    def spy(self: art.ProcessGroupAioreduce, tensor: torch.Tensor, **kw: Any) -> Any:
        handed.append((time.monotonic(), tensor.numel()))
        return future_sum(self, tensor, **kw)

    art.ProcessGroupAioreduce.future_sum = spy  # type: ignore[method-assign]
    for it in range(25):
        for name in (list(models) if it % 2 == 0 else list(models)[::-1]):
            node.barrier(timeout=60)
            sync()
            if name == "ours":
                handed.clear()
            t = [time.monotonic()]
            opts[name].zero_grad()
            out = models[name](x)
            t.append(time.monotonic())
            F.cross_entropy(out.float(), y).backward()  # type: ignore[no-untyped-call]
            t.append(time.monotonic())
            sync()
            t.append(time.monotonic())
            opts[name].step()
            sync()
            t.append(time.monotonic())
            if it >= 5:
                phases[name].append(np.diff(t) * 1e3)
    print(f"rank {rank} {str(dtype).removeprefix('torch.')}, median ms of forward, "
          "backward() until it returns, GPU work after it, optimizer step:",
          json.dumps({k: np.median(np.array(v), 0).round(2).tolist() for k, v in phases.items()}),
          "; buckets (elements, ms after the first):",
          [(n, round((when - handed[0][0]) * 1e3, 2)) for when, n in handed], flush=True)
    pg.shutdown()
    dist.destroy_process_group()
    node.close()


if __name__ == "__main__":
    main()
