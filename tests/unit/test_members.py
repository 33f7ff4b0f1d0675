"""A comm over some of the ranks (``schemes/members.py``): positions to ranks and back, also
for its bulk links, so a re-formed transpose opens lanes with the members by position."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from aioreduce.schemes.members import MembersComm
from aioreduce.transport.memory import MemoryNetwork


class Links:
    """Bulk links underneath: what they were asked for, in ranks."""

    def __init__(self) -> None:
        self.asked: list[tuple[list[int], list[int], int]] = []
        self.moved: list[tuple[int, int]] = []
        self.spans_hosts = True

    async def open_links(self, send_to: Sequence[int], recv_from: Sequence[int], step: int,
                         *, partial: bool = False) -> tuple[dict[int, Any], dict[int, Any]]:
        self.asked.append((list(send_to), list(recv_from), step))
        return ({r: f"to {r}" for r in send_to if r != 3},  # rank 3's did not open
                {r: f"from {r}" for r in recv_from if r != 3})

    def count_moved(self, step: int, sent: int, src: int, received: int, frames: int) -> None:
        self.moved.append((step, src))


def test_the_members_bulk_links_number_their_ends_by_position() -> None:
    async def main() -> None:
        net, links = MemoryNetwork(6), Links()
        comm = net.comms[4]
        comm.bulk_links = lambda: links  # type: ignore[method-assign]
        members = MembersComm(comm, [0, 3, 4, 5])  # rank 4 is position 2
        bulk = members.bulk_links()
        assert bulk is not None and bulk.spans_hosts
        outs, ins = await bulk.open_links([0, 1, 3], [0, 1, 3], 9, partial=True)
        assert links.asked == [([0, 3, 5], [0, 3, 5], 9)]
        assert outs == {0: "to 0", 3: "to 5"} and ins == {0: "from 0", 3: "from 5"}
        bulk.count_moved(9, 10, 3, 20, 1)
        assert links.moved == [(9, 5)]

    asyncio.run(main())
