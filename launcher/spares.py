"""Where ``--restart`` starts a dead rank again: on its host while that host is up, else on a
spare host (``spare=yes`` in the hostfile) with a free slot. Pure: no processes, no SSH."""

from __future__ import annotations

from aioreduce.jobplan import HostSlots, RankSpec, moved


class NoSpare(RuntimeError):
    """A rank's host was lost and no spare host has a free slot."""


class Spares:
    """The spare hosts' free slots, taken in hostfile order."""

    def __init__(self, spares: list[HostSlots], first_node_rank: int) -> None:
        # (host, its node rank, its free local slots)
        self._hosts = [(h, first_node_rank + i, list(range(h.slots)))
                       for i, h in enumerate(spares)]

    def place(self, spec: RankSpec, host_lost: bool) -> RankSpec:
        """Where ``spec``'s rank runs again: where it ran, unless its host was lost (rank 0
        cannot move: every rank dials it at the job's rendezvous address)."""
        if not host_lost:
            return spec
        if spec.rank == 0:
            raise NoSpare(f"its host {spec.host.name} was lost, and rank 0 comes back only at "
                          "the job's rendezvous address, on that host")
        for host, node_rank, free in self._hosts:
            if free:
                return moved(spec, host, node_rank, free.pop(0))
        raise NoSpare(f"its host {spec.host.name} was lost and no spare host has a free slot "
                      "(add hosts with spare=yes to the hostfile)")

    @property
    def names(self) -> list[str]:
        return [h.name for h, _n, _f in self._hosts]
