"""A rank of the barrier test: ``python barrierprog.py LATE TIMEOUT``.

Every rank but LATE calls ``node.barrier(TIMEOUT)`` (barrier 1) and prints how it ended
(``BARRIER1 {...}``); then every rank sums its rank over the ring (``SUM [...]``): the job is
still usable after a barrier that failed. LATE comes to barrier 1 only after that sum, so
once the others have given up on it; then every rank calls barrier 2 (``BARRIER2``). LATE's
arrival at barrier 1 must not count at barrier 2 (nor barrier 2's release answer barrier 1).
"""

from __future__ import annotations

import json
import sys

import numpy as np

import aioreduce as ar


async def _barrier(node: ar.Node, name: str, timeout: float) -> None:
    try:
        await node.barrier(timeout)
        print(f"{name} " + json.dumps({"ok": True}), flush=True)
    except ar.RendezvousError as exc:
        print(f"{name} " + json.dumps({"ok": False, "message": str(exc),
                                       "missing": exc.missing}), flush=True)


async def main(late: int, timeout: float) -> None:
    async with ar.Node.from_env(scheme=ar.Ring()) as node:
        if node.rank != late:
            await _barrier(node, "BARRIER1", timeout)
        res = await node.allreduce(np.full(4, float(node.rank)))
        print("SUM " + json.dumps(res.value.tolist()), flush=True)
        if node.rank == late:
            await _barrier(node, "BARRIER1", timeout)
        await _barrier(node, "BARRIER2", 60.0)


if __name__ == "__main__":
    ar.run(main(int(sys.argv[1]), float(sys.argv[2])))
