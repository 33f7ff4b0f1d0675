"""A trainer that makes caller mistakes (loopback test): ``python callerprog.py``.

Rank 1 passes a list, then a wrong shape: both are refused before a step is taken, and its
corrected retry joins the same step as everyone else. Rank 2 then fails in its own code inside
``with ar.connect()``: the node closes at once instead of waiting out the closing barrier.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import aioreduce as ar


def vec(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng([rank, step]).standard_normal(100)


def main() -> None:
    with ar.connect(scheme=ar.Ring(), timeout=60) as node:
        me, world = node.rank, node.world_size
        for step in range(3):
            if me == 1 and step == 1:
                for bad in (vec(me, step).tolist(), np.zeros(7)):
                    try:
                        node.allreduce(bad)  # type: ignore[arg-type]
                    except (TypeError, ValueError) as exc:
                        print(f"REJECTED {type(exc).__name__}: {exc}", flush=True)
            res = node.allreduce(vec(me, step))
            want = sum(vec(r, step) for r in range(world))
            assert res.step == step and np.allclose(res.value, want), (me, step)
            print(f"STEP {step} OK", flush=True)
        if me == 2:
            print(f"RAISING {time.time()}", flush=True)
            raise RuntimeError("the trainer failed")
    print("CLOSED", flush=True)


if __name__ == "__main__":
    sys.exit(main())
