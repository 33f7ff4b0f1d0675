"""Groups of steps (``Node.allreduce(rerun=False)``, the last of each with ``last=True``), 4
ranks on the ring. In group 1's last step rank 3 is killed as it is about to send its last
all-gather segment, to rank 0: its part of every other segment is out, so ranks 1 and 2 can
finish that step and go on to group 2, while rank 0 cannot. Rank 0 takes the step's result
from a rank that finished it and goes on with them; group 2 then fails at once on every rank
(rank 3 is gone), they wait for its replacement, which heals the group's number (the state
hooks) and runs group 2 with them (see test_heal).

With ``ROLL_SILENT_OLD_PORT=<file>`` the dying rank 3 leaves its TCP listener behind, held
by a child that accepts connections and answers nothing until the launcher exits (it creates
``<file>`` at its first): a rank dialing rank 3's old address then meets silence, as CI once did
when another process's listener had taken a dead rank's port.

With ``ROLL_PLAIN=1`` the same steps are plain ones (``Node.allreduce`` as it runs again by
itself, ``rerun=True``), each its own group: ranks 1 and 2 finish step 5 and go on to step 6,
rank 0 fails step 5 and takes it from one of them, as above.

Prints, per rank: ``GROUP <g> <sum of each step's result>`` for every group that completed
(its last run), and ``ROLLED <n>``: the steps this rank took from a peer.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket

import numpy as np

import aioreduce as ar
from aioreduce.schemes.links import LaneLinks

GROUPS, STEPS, SIZE = 4, 3, 1000
DIE_GROUP = 1


def _hold_port(listen_fd: int, marker: str) -> None:
    """Fork a child that keeps ``listen_fd`` (this process's listener) and whatever it
    accepts there open and silent until the launcher, our parent, exits; it creates
    ``marker`` when it accepts a connection. It leaves our session, so the launcher's
    teardown of this process does not take it, and closes every other descriptor, so our
    connections still break when we die."""
    watch = os.pidfd_open(os.getppid())
    if os.fork() == 0:
        os.setsid()
        low, high = sorted((listen_fd, watch))
        os.closerange(0, low)
        os.closerange(low + 1, high)
        os.closerange(high + 1, 65536)
        while True:
            ready, _w, _x = select.select([listen_fd, watch], [], [], 120)
            if watch in ready or not ready:
                os._exit(0)
            _accept(listen_fd)  # (its descriptor stays open, silent, until we exit)
            open(marker, "w").close()
    os.close(watch)


def _accept(listen_fd: int) -> int:
    """One connection from the listener ``listen_fd`` (its descriptor, kept open)."""
    sock = socket.socket(fileno=os.dup(listen_fd))
    try:
        conn, _addr = sock.accept()
    finally:
        sock.close()
    return conn.detach()


def _arm(world: int, step: int, hold: tuple[int, str] | None) -> None:
    """Rank 3: die as the ring's last all-gather send of ``step`` (to rank 0) is made
    (leaving its listener to a silent child if ``hold``: its descriptor, the marker)."""
    send = LaneLinks.send
    last = 2 * world - 2  # the ring's indices: reduce-scatter 0..n-2, all-gather n..2n-2

    def dying(self: LaneLinks, dst: int, array: np.ndarray, step_: int, index: int,
              *args: object, **kwargs: object) -> bool:
        if step_ == step and index == last:
            if hold is not None:
                _hold_port(*hold)
            os.kill(os.getpid(), signal.SIGKILL)
        return send(self, dst, array, step_, index, *args, **kwargs)  # type: ignore[arg-type]

    LaneLinks.send = dying  # type: ignore[method-assign]


async def main() -> None:
    group = [0]
    hooks = ar.StateHooks(lambda: str(group[0]).encode(),
                          lambda blob: group.__setitem__(0, int(bytes(blob))))
    plain = os.environ.get("ROLL_PLAIN") == "1"
    node = ar.Node.from_env(scheme=ar.Ring(), rejoin_wait=5 if plain else 60, state=hooks)
    await node.start()
    try:
        if node.rank == 3 and not node.mesh.incarnations.rejoined:
            # The group's steps are numbered from 0, one per call: group 1's last is 5.
            hold = None
            if marker := os.environ.get("ROLL_SILENT_OLD_PORT"):
                assert node.mesh._server is not None
                hold = (node.mesh._server.sockets[0].fileno(), marker)
            _arm(node.world_size, DIE_GROUP * STEPS + STEPS - 1, hold)
        while plain and group[0] < GROUPS * STEPS:  # one step a "group", run again by itself
            g, k = divmod(group[0], STEPS)
            x = np.full(SIZE, float((node.rank + 1) * (g + 1) * (k + 1)))
            await node.allreduce(x, in_place=True)
            print(f"STEP {group[0]} {float(x.sum())}", flush=True)
            group[0] += 1
        while not plain and group[0] < GROUPS:
            g = group[0]
            sums: list[float] = []
            try:
                for k in range(STEPS):
                    x = np.full(SIZE, float((node.rank + 1) * (g + 1) * (k + 1)))
                    res = await node.allreduce(x, in_place=True, rerun=False,
                                               last=k == STEPS - 1)
                    assert res.value is not None
                    sums.append(float(x.sum()))
            except (ar.PeerLost, ar.StragglerError):
                if not await node.replace_lost():
                    raise
                continue  # the whole group again, with the replacement
            print(f"GROUP {g} {sums}", flush=True)
            group[0] += 1
        print(f"ROLLED {node.healer.rolled}", flush=True)
    finally:
        await node.close(wait_for_peers=False)


asyncio.run(main())
