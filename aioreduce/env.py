"""Who am I in this job? Rank, world size, rendezvous and secret from the environment.

Sources, in order of precedence for each value:

1. ``AIOREDUCE_*`` (set by ``aioreduce-launch``; any of them can be set by hand);
2. torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
3. SLURM: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, first host of
   ``SLURM_JOB_NODELIST``;
4. Open MPI: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``.

The rendezvous port is ``AIOREDUCE_MASTER_PORT``, else ``MASTER_PORT + 1`` (so that a
``torch.distributed`` store on ``MASTER_PORT`` in the same job does not collide), else, under
SLURM, a port derived from the job id. The job secret is never guessed: it comes from
``AIOREDUCE_SECRET`` or from the file named by ``AIOREDUCE_SECRET_FILE``.

Optional: ``AIOREDUCE_ADDR`` (address peers dial), ``AIOREDUCE_BIND`` (address to listen on),
``AIOREDUCE_TIMEOUT`` (rendezvous seconds, default 60), ``AIOREDUCE_MAX_FRAME`` (largest payload
in bytes a node accepts), ``AIOREDUCE_JOB`` (job id, part of every handshake).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError

DEFAULT_RENDEZVOUS_TIMEOUT = 60.0


@dataclass(frozen=True)
class NodeEnv:
    """Everything a node needs to join its job."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    secret: bytes
    job: str = "default"
    local_rank: int = 0
    advertise_addr: str | None = None  # data-plane address peers should dial
    bind_addr: str | None = None  # address to listen on
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT
    max_frame: int | None = None  # largest payload accepted, bytes (None: the default)
    source: str = "aioreduce"

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world size must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        # Port 0: rank 0 listens on a free port and publishes it itself (Node's on_listen).
        if not (0 < self.master_port < 65536 or (self.master_port == 0 and self.rank == 0)):
            raise ConfigError(f"rendezvous port {self.master_port} is not a valid TCP port")
        if not self.secret:
            raise ConfigError("the job secret is empty")

    def __repr__(self) -> str:  # never print the secret
        return (f"NodeEnv(rank={self.rank}, world_size={self.world_size}, "
                f"master={self.master_addr}:{self.master_port}, job={self.job!r}, "
                f"source={self.source})")


def expand_hostlist(spec: str) -> list[str]:
    """Expand a SLURM hostlist such as ``gpu[01-03,7],login1`` into host names."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", spec):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            width = len(lo)
            hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
    return hosts


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"{name}={env[name]!r} is not an integer") from None


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    for name in names:
        if env.get(name, "") != "":
            return name, env[name]
    return None


def _read_secret(env: Mapping[str, str]) -> bytes:
    if env.get("AIOREDUCE_SECRET"):
        return env["AIOREDUCE_SECRET"].encode()
    path = env.get("AIOREDUCE_SECRET_FILE")
    if path:
        try:
            with open(path, "rb") as fh:
                secret = fh.read().strip()
        except OSError as exc:
            raise ConfigError(f"AIOREDUCE_SECRET_FILE={path}: {exc.strerror}") from None
        if secret:
            return secret
        raise ConfigError(f"AIOREDUCE_SECRET_FILE={path} is empty")
    raise ConfigError(
        "no job secret: set AIOREDUCE_SECRET or AIOREDUCE_SECRET_FILE (aioreduce-launch sets "
        "it for you; under torchrun or SLURM, put a random secret in a file only you can read "
        "on a shared filesystem and export AIOREDUCE_SECRET_FILE)")


def discover(environ: Mapping[str, str] | None = None) -> NodeEnv:
    """Build a :class:`NodeEnv` from the environment; :class:`ConfigError` says what is missing."""
    env = dict(os.environ if environ is None else environ)
    sources = [
        ("aioreduce", "AIOREDUCE_RANK", "AIOREDUCE_WORLD_SIZE", "AIOREDUCE_LOCAL_RANK"),
        ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
        ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
        ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ]
    found = next((s for s in sources if s[1] in env and s[2] in env), None)
    if found is None:
        raise ConfigError("cannot tell this process's rank: set AIOREDUCE_RANK and "
                          "AIOREDUCE_WORLD_SIZE, or run under aioreduce-launch, torchrun, "
                          "SLURM (srun) or Open MPI (mpirun)")
    source, rank_var, size_var, local_var = found
    rank, world = _int(env, rank_var), _int(env, size_var)
    local_rank = _int(env, local_var) if env.get(local_var) else 0

    addr = _first(env, "AIOREDUCE_MASTER_ADDR", "MASTER_ADDR")
    if addr is None and env.get("SLURM_JOB_NODELIST"):
        addr = ("SLURM_JOB_NODELIST", expand_hostlist(env["SLURM_JOB_NODELIST"])[0])
    if addr is None:
        raise ConfigError("no rendezvous address: set AIOREDUCE_MASTER_ADDR (or MASTER_ADDR) "
                          "to the host of rank 0")

    if env.get("AIOREDUCE_MASTER_PORT"):
        port = _int(env, "AIOREDUCE_MASTER_PORT")
    elif env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT") + 1
    elif env.get("SLURM_JOB_ID"):
        port = 20000 + _int(env, "SLURM_JOB_ID") % 20000
    else:
        raise ConfigError("no rendezvous port: set AIOREDUCE_MASTER_PORT (or MASTER_PORT)")

    job_var = _first(env, "AIOREDUCE_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
    job = job_var[1] if job_var else "default"
    try:
        timeout = float(env.get("AIOREDUCE_TIMEOUT", DEFAULT_RENDEZVOUS_TIMEOUT))
    except ValueError:
        raise ConfigError(f"AIOREDUCE_TIMEOUT={env['AIOREDUCE_TIMEOUT']!r} is not a number"
                          ) from None
    max_frame = _int(env, "AIOREDUCE_MAX_FRAME") if env.get("AIOREDUCE_MAX_FRAME") else None
    return NodeEnv(rank=rank, world_size=world, master_addr=addr[1], master_port=port,
                   secret=_read_secret(env), job=job, local_rank=local_rank,
                   advertise_addr=env.get("AIOREDUCE_ADDR") or None,
                   bind_addr=env.get("AIOREDUCE_BIND") or None,
                   rendezvous_timeout=timeout, max_frame=max_frame, source=source)
