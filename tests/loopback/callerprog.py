"""A trainer that makes caller mistakes (loopback test): ``python callerprog.py``.

Rank 1 passes a list, then a wrong shape: both are refused before a step is taken, and its
corrected retry joins the same step as everyone else. Then, under the ring and under a tree,
rank 1 passes a vector one element longer than everyone else's: every rank gets the same
VectorMismatch naming rank 1, and the retry with the right vector is exact everywhere; an
in-place mean lands in each rank's array (rank 1 first passes an integer array: refused).
Rank 2 then fails in its own code inside ``with ar.connect()``: the node closes at once
instead of waiting out the closing barrier.
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
        for scheme in (ar.Ring(), ar.Tree(2, deadline=30)):
            name = type(scheme).__name__
            node.use(scheme)
            step = node.node.step
            mine = vec(me, step)
            try:
                node.allreduce(np.append(mine, 1.0) if me == 1 else mine)
                print(f"NO ERROR {name}", flush=True)
            except ar.VectorMismatch as exc:
                print(f"MISMATCH {name} {exc.ranks} {exc}", flush=True)
            step = node.node.step
            res = node.allreduce(vec(me, step))
            assert np.allclose(res.value, sum(vec(r, step) for r in range(world))), (me, name)
            print(f"RETRY {name} OK", flush=True)
            # In place: the ring sums into the array itself, the tree copies its result in;
            # an array it cannot write into is refused before the step is taken.
            step = node.node.step
            if me == 1:
                try:
                    node.allreduce(np.arange(3), in_place=True)
                except TypeError as exc:
                    print(f"REJECTED IN PLACE {name}: {exc}", flush=True)
            mine = vec(me, step)
            res = node.allreduce(mine, op="mean", in_place=True)
            mean = sum(vec(r, step) for r in range(world)) / world
            assert res.value is mine and np.allclose(mine, mean), (me, name)
            print(f"IN PLACE {name} OK", flush=True)
        if me == 2:
            print(f"RAISING {time.time()}", flush=True)
            raise RuntimeError("the trainer failed")
    print("CLOSED", flush=True)


if __name__ == "__main__":
    sys.exit(main())
