"""``scheme="auto"`` on real ranks (loopback test): ``python autoprog.py NBYTES``.

The first allreduce picks the scheme on rank 0 and every rank uses it; prints the chosen
scheme and checks three steps exactly.
"""

from __future__ import annotations

import sys

import numpy as np

import aioreduce as ar


def vec(rank: int, step: int, n: int) -> np.ndarray:
    return np.random.default_rng([rank, step]).standard_normal(n)


def main() -> None:
    n = int(sys.argv[1]) // 8
    with ar.connect(scheme="auto", timeout=120) as node:
        me, world = node.rank, node.world_size
        for step in range(3):
            res = node.allreduce(lambda s=step: vec(me, s, n))
            want = sum(vec(r, step, n) for r in range(world))
            assert np.allclose(res.value, want, rtol=0, atol=1e-9), (me, step)
        print(f"CHOSE {node.node.scheme!r}", flush=True)
        print("OK", flush=True)


if __name__ == "__main__":
    main()
