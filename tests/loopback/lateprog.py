"""Rank 2's first process dies after the job's last step, before it leaves: its replacement
comes when nobody is left to heal it (see test_launch_local's late-replacement test)."""

from __future__ import annotations

import os
import signal

import numpy as np

import aioreduce as ar

with ar.connect(ar.Ring()) as node:
    replacement = node.node.mesh.incarnations.rejoined
    for _ in range(5):
        node.allreduce(np.ones(1000))
    if node.rank == 2 and not replacement:
        os.kill(os.getpid(), signal.SIGKILL)
print("DONE", node.rank, flush=True)
