"""A group of steps (``Node.allreduce(rerun=False)``) in which rank 3 dies, and which rank 1
leaves one step further than the others, as a rank does that finished a step the others
failed (its last segments were on their way when rank 3 died): every live rank's
``replace_lost()`` raises ``GroupMismatch``, naming each rank's step (see test_heal)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import numpy as np

import aioreduce as ar


async def main() -> None:
    node = ar.Node.from_env(scheme=ar.Ring(), rejoin_wait=60)
    await node.start()
    try:
        if node.mesh.incarnations.rejoined:  # rank 3's replacement: nothing to run again
            print("REPLACEMENT", node.rank, flush=True)
            return
        for _ in range(3):
            await node.allreduce(np.ones(1000), rerun=False)
        if node.rank == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        with contextlib.suppress(ar.PeerLost):
            await node.allreduce(np.ones(1000), rerun=False)
            raise AssertionError("the step rank 3 died in succeeded")
        if node.rank == 1:
            with contextlib.suppress(ar.PeerLost):  # fails at once: the group failed
                await node.allreduce(np.ones(1000), rerun=False)
        try:
            await node.replace_lost()
        except ar.GroupMismatch as exc:
            print("MISMATCH", exc, flush=True)
    finally:
        await node.close(wait_for_peers=False)


asyncio.run(main())
