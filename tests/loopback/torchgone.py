"""Stock DDP (``torch.nn.parallel.DistributedDataParallel``) over ``backend="aioreduce"``, a
small model, every rank's batches a function of its rank; ``KILL_RANK`` SIGKILLs itself at
``KILL_AT``. Prints ``FINAL {...}`` with the parameters' digest and the last loss."""

from __future__ import annotations

import hashlib
import json
import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import aioreduce.torch  # noqa: F401  (registers the backend)


def main() -> None:
    dist.init_process_group("aioreduce")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    kill_rank, kill_at = int(os.environ.get("KILL_RANK", "-1")), int(os.environ["KILL_AT"])
    for it in range(int(os.environ.get("ITERS", "40"))):
        if rank == kill_rank and it == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(16, 32, generator=gen)
        y = torch.randint(0, 4, (16,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in net.parameters())).hexdigest()
    print("FINAL " + json.dumps({"rank": rank, "digest": digest, "loss": loss.item()}),
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
