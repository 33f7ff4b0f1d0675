"""One rank of the torch error test: ``torcherrors.py BACKEND ABSENT``.

Every rank but ABSENT calls ``dist.monitored_barrier`` with a 2 s timeout and prints how it
ended (``MB {...}``); then a blocking ``dist.all_reduce`` where rank 1 passes a tensor of
another size (``AR {...}``); then every rank sums its rank (``SUM x``): is the group still
usable?
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import aioreduce.torch  # noqa: F401  (registers "aioreduce")


def main() -> None:
    backend, absent = sys.argv[1], int(sys.argv[2])
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    if rank != absent:
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=2))
            print("MB " + json.dumps({"ok": True}), flush=True)
        except Exception as exc:  # torch's type differs by backend; the message is the point
            print("MB " + json.dumps({"ok": False, "type": type(exc).__name__,
                                      "message": str(exc)}), flush=True)
    try:
        dist.all_reduce(torch.ones(3 if rank == 1 else 4))
        print("AR " + json.dumps({"ok": True}), flush=True)
    except Exception as exc:
        print("AR " + json.dumps({"ok": False, "type": type(exc).__name__,
                                  "message": str(exc)}), flush=True)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    print(f"SUM {t.item()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
