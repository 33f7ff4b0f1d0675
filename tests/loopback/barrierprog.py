"""A rank of the barrier test: ``python barrierprog.py ABSENT TIMEOUT``.

Every rank but ABSENT calls ``node.barrier(TIMEOUT)`` and prints how it ended (``BARRIER
{...}``); then every rank, ABSENT too, sums its rank over the ring (``SUM [...]``): the job is
still usable after a barrier that failed.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import aioreduce as ar


async def main(absent: int, timeout: float) -> None:
    async with ar.Node.from_env(scheme=ar.Ring()) as node:
        if node.rank != absent:
            try:
                await node.barrier(timeout)
                print("BARRIER " + json.dumps({"ok": True}), flush=True)
            except ar.RendezvousError as exc:
                print("BARRIER " + json.dumps({"ok": False, "message": str(exc),
                                               "missing": exc.missing}), flush=True)
        res = await node.allreduce(np.full(4, float(node.rank)))
        print("SUM " + json.dumps(res.value.tolist()), flush=True)


if __name__ == "__main__":
    ar.run(main(int(sys.argv[1]), float(sys.argv[2])))
