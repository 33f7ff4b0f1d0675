"""Rank placement and the environment contract every rank receives (the launcher's side;
:mod:`aioreduce.env` is the rank's side).

Each rank gets torchrun-compatible variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and aioreduce's own
(``AIOREDUCE_RANK``, ``AIOREDUCE_WORLD_SIZE``, ``AIOREDUCE_LOCAL_RANK``,
``AIOREDUCE_MASTER_ADDR``, ``AIOREDUCE_MASTER_PORT``, ``AIOREDUCE_JOB``, ``AIOREDUCE_SECRET``),
plus ``PYTHONUNBUFFERED=1`` so Python output is not held back in pipes. Ranks fill a host's
slots before moving on to the next host.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HostSlots:
    """One host of the job: where to reach it and how many ranks it runs."""

    name: str
    slots: int = 1
    addr: str | None = None  # data-plane address if it differs from the SSH name
    cores: int | None = None  # known core count: sets OMP_NUM_THREADS for the host's ranks


@dataclass(frozen=True)
class RankSpec:
    """One rank: where it runs and the environment it gets."""

    rank: int
    host: HostSlots
    node_rank: int
    local_rank: int
    env: dict[str, str] = field(repr=False)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel picks it)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` different TCP ports that were free a moment ago (each bound until all are
    picked: two calls of :func:`free_port` may give the same port)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(n):
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
        return ports


@dataclass(frozen=True)
class JobConfig:
    """What is shared by all ranks of one job."""

    master_addr: str
    master_port: int  # for torch.distributed, if the program uses it
    rendezvous_port: int  # aioreduce's own rendezvous
    secret: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    job: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    user_env: dict[str, str] = field(default_factory=dict)


def moved(spec: RankSpec, host: HostSlots, node_rank: int, local_rank: int) -> RankSpec:
    """``spec``'s rank placed on another host (a spare that replaces a lost one): the same
    job environment with that host's placement."""
    env = dict(spec.env)
    env.pop("AIOREDUCE_ADDR", None)  # the lost host's
    _place(env, host, node_rank, local_rank, host.slots)
    return RankSpec(spec.rank, host, node_rank, local_rank, env)


def _place(env: dict[str, str], host: HostSlots, node_rank: int, local_rank: int,
           local_world: int) -> None:
    """Set a rank's placement variables in ``env``: its host and its slot there."""
    env.update({"LOCAL_RANK": str(local_rank), "AIOREDUCE_LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(local_world), "NODE_RANK": str(node_rank),
                "GROUP_RANK": str(node_rank)})
    if host.addr:
        env["AIOREDUCE_ADDR"] = host.addr


def plan_ranks(hosts: list[HostSlots], job: JobConfig, np: int | None = None) -> list[RankSpec]:
    """Assign ranks host by host (filling slots); ``np`` caps the total."""
    total = sum(h.slots for h in hosts)
    world = total if np is None else np
    if world < 1:
        raise ValueError("a job needs at least one rank")
    if world > total:
        raise ValueError(f"{world} ranks requested but the hosts have only {total} slots")
    specs: list[RankSpec] = []
    rank = 0
    for node_rank, host in enumerate(hosts):
        local_world = min(host.slots, world - rank)
        for local_rank in range(local_world):
            env = dict(job.user_env)
            env.update({
                "RANK": str(rank), "WORLD_SIZE": str(world),
                "MASTER_ADDR": job.master_addr, "MASTER_PORT": str(job.master_port),
                "AIOREDUCE_RANK": str(rank), "AIOREDUCE_WORLD_SIZE": str(world),
                "AIOREDUCE_MASTER_ADDR": job.master_addr,
                "AIOREDUCE_MASTER_PORT": str(job.rendezvous_port),
                "AIOREDUCE_JOB": job.job, "AIOREDUCE_SECRET": job.secret,
                "PYTHONUNBUFFERED": "1",
            })
            _place(env, host, node_rank, local_rank, local_world)
            if host.cores and "OMP_NUM_THREADS" not in job.user_env:
                # Like torchrun: several ranks on one host must not each start a BLAS thread
                # per core (on 2 cores, 13 ranks ran 10x slower). The user's value wins.
                env["OMP_NUM_THREADS"] = str(max(1, host.cores // local_world))
            specs.append(RankSpec(rank, host, node_rank, local_rank, env))
            rank += 1
        if rank == world:
            break
    return specs
