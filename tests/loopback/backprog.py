"""Groups of steps that never mark their last (``Node.allreduce(rerun=False)`` alone), 4
ranks on a ring that can re-form (``AIOREDUCE_REJOIN_WAIT``): rank 2's first process dies in
group 3 and nothing restarts it, so the group runs again over ranks 0, 1 and 3; the test
starts a replacement later, which heals, asks to be taken back, and is: the group where that
happens fails on every member and runs again over all four (see test_heal).

The state hooks carry the group number and whether a group ran without a rank; every rank
stops after the first group over all four once one ran without (the replacement learns it
from its heal), so all stop at the same group, however late the replacement comes (at most
``CAP`` groups).

Prints, per rank: ``GROUP {"g": g, "used": [...], "sums": [...]}`` for every group that
completed (its last run), ``LEFT`` and ``TAKEN`` counts at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import numpy as np

import aioreduce as ar

STEPS, SIZE, CAP, PACE = 3, 1000, 3000, 0.02
DIE_GROUP, DIE_STEP = 3, 1


async def main() -> None:
    state = {"group": 0, "without": False}
    hooks = ar.StateHooks(lambda: json.dumps(state).encode(),
                          lambda blob: state.update(json.loads(bytes(blob))))
    node = ar.Node.from_env(scheme=ar.Ring(), state=hooks)
    await node.start()
    dies = node.rank == 2 and not node.mesh.incarnations.rejoined
    try:
        while state["group"] < CAP:
            g = state["group"]
            sums: list[float] = []
            used: list[int] = []
            try:
                for k in range(STEPS):
                    if dies and g == DIE_GROUP and k == DIE_STEP:
                        os.kill(os.getpid(), signal.SIGKILL)
                    x = np.full(SIZE, float((node.rank + 1) * (g + 1) * (k + 1)))
                    res = await node.allreduce(x, in_place=True, rerun=False)
                    sums.append(float(x.sum()))
                    used = sorted(res.used)
                    await asyncio.sleep(PACE)  # (pacing, so a late replacement finds the job)
            except (ar.PeerLost, ar.StragglerError):
                if not await node.replace_lost():
                    raise
                continue  # the whole group again
            print("GROUP " + json.dumps({"g": g, "used": used, "sums": sums}), flush=True)
            state["group"] += 1
            if len(used) < node.world_size:
                state["without"] = True
            elif state["without"]:
                break
        print(f"END {state['group']} taken_back={node.healer.taken_back}", flush=True)
    finally:
        await node.close(wait_for_peers=False)


asyncio.run(main())
