"""Where ``--restart`` starts a dead rank again: its host while up, else a spare's free slot."""

from __future__ import annotations

import pytest

from aioreduce.jobplan import HostSlots, JobConfig, plan_ranks
from aioreduce_launch.spares import NoSpare, Spares


def test_a_lost_hosts_ranks_take_the_spares_slots_in_order() -> None:
    job = JobConfig(master_addr="10.0.0.1", master_port=29500, rendezvous_port=29501)
    hosts = [HostSlots("a", 2, addr="10.0.0.1"), HostSlots("b", 2, addr="10.0.0.2")]
    specs = plan_ranks(hosts, job)
    spares = Spares([HostSlots("s", 1, addr="10.0.0.9"), HostSlots("t", 1, addr="10.0.0.8")],
                    len(hosts))
    assert spares.place(specs[2], host_lost=False) is specs[2]  # a crash: where it was
    moved = spares.place(specs[2], host_lost=True)
    assert (moved.rank, moved.host.name, moved.node_rank, moved.local_rank) == (2, "s", 2, 0)
    assert moved.env["AIOREDUCE_ADDR"] == "10.0.0.9" and moved.env["NODE_RANK"] == "2"
    assert moved.env["LOCAL_RANK"] == "0" and moved.env["RANK"] == "2"
    assert moved.env["AIOREDUCE_SECRET"] == specs[2].env["AIOREDUCE_SECRET"]  # the same job
    again = spares.place(specs[3], host_lost=True)
    assert (again.host.name, again.node_rank) == ("t", 3)
    with pytest.raises(NoSpare, match="its host b was lost and no spare host has a free slot"):
        spares.place(specs[3], host_lost=True)
    assert spares.names == ["s", "t"]
    assert spares.place(specs[0], host_lost=False) is specs[0]
    with pytest.raises(NoSpare, match="rank 0 comes back only at the job's rendezvous address"):
        spares.place(specs[0], host_lost=True)  # though a spare might be free
