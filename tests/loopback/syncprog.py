"""A trainer without asyncio: ``aioreduce.connect`` and blocking calls (loopback test)."""

from __future__ import annotations

import sys

import numpy as np

import aioreduce as ar


def main() -> None:
    with ar.connect(scheme=ar.Ring()) as node:
        for step in range(5):
            mine = np.random.default_rng([node.rank, step]).standard_normal(1000)
            total = node.allreduce(mine).value
            want = sum(np.random.default_rng([r, step]).standard_normal(1000)
                       for r in range(node.world_size))
            assert np.allclose(total, want, rtol=1e-12, atol=1e-12), step
            assert not total.flags.writeable
        node.barrier()
    with ar.connect(scheme=ar.CodedTree(2, 2, 1)) as node:  # 7 ranks: rank 0 plus 6
        g = np.random.default_rng(7).standard_normal((12, 50))  # 12 samples, same everywhere
        ids, w = node.placement(12)
        for step in range(3):
            res = node.aggregate(lambda s=step: (w @ g[ids] if len(ids) else np.zeros(50)) * s)
            assert res.exact and np.allclose(res.value, g.sum(axis=0) * step), step
    print("SYNC OK", node.rank, flush=True)


if __name__ == "__main__":
    sys.exit(main())
