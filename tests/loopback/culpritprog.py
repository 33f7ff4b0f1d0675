"""A job where one rank fails and the others die of it (loopback test of the launcher's
culprit): ``python culpritprog.py MODE``, 4 ranks under ``aioreduce-launch``, the ring.

At step 3 rank 2 either passes a 19-float vector where earlier steps had 20 (``caller``: a
``ValueError`` of its own, raised before the step) or is killed by SIGKILL (``signal``). The
other ranks wait in step 3 and die of ``PeerLost`` when rank 2's connections close, often
before rank 2 itself has exited.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

import aioreduce as ar


def main() -> None:
    mode = sys.argv[1]
    with ar.connect(scheme=ar.Ring(), timeout=60) as node:
        for step in range(6):
            n = 19 if (node.rank == 2 and step == 3) else 20
            if n == 19 and mode == "signal":
                os.kill(os.getpid(), signal.SIGKILL)
            node.allreduce(np.ones(n))
            print(f"STEP {step}", flush=True)


if __name__ == "__main__":
    main()
