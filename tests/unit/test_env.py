"""Rank/world/rendezvous discovery from the environment of each supported launcher."""

from __future__ import annotations

import pytest

from aioreduce.env import ConfigError, discover, expand_hostlist

BASE = {"AIOREDUCE_SECRET": "s"}


def test_aioreduce_variables() -> None:
    env = discover({"AIOREDUCE_SECRET": "hunter2-secret", "AIOREDUCE_RANK": "2",
                    "AIOREDUCE_WORLD_SIZE": "4",
                    "AIOREDUCE_LOCAL_RANK": "1", "AIOREDUCE_MASTER_ADDR": "10.1.2.3",
                    "AIOREDUCE_MASTER_PORT": "4000", "AIOREDUCE_JOB": "j1",
                    "AIOREDUCE_ADDR": "10.9.9.9", "AIOREDUCE_MAX_FRAME": "1024"})
    assert (env.rank, env.world_size, env.local_rank) == (2, 4, 1)
    assert (env.master_addr, env.master_port, env.job) == ("10.1.2.3", 4000, "j1")
    assert env.advertise_addr == "10.9.9.9" and env.max_frame == 1024
    assert env.secret == b"hunter2-secret" and env.source == "aioreduce"
    assert "hunter2" not in repr(env) and "hunter2" not in str(env)


def test_torchrun_variables_use_the_next_port() -> None:
    env = discover({**BASE, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                    "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
                    "TORCHELASTIC_RUN_ID": "run7"})
    assert (env.rank, env.world_size, env.master_addr) == (1, 2, "node0")
    assert env.master_port == 29501 and env.job == "run7" and env.source == "torchrun"


def test_slurm_variables() -> None:
    env = discover({**BASE, "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                    "SLURM_JOB_NODELIST": "gpu[07-09],login1", "SLURM_JOB_ID": "123456"})
    assert (env.rank, env.world_size, env.local_rank) == (5, 8, 1)
    assert env.master_addr == "gpu07"
    assert env.master_port == 20000 + 123456 % 20000 and env.job == "123456"


def test_openmpi_variables() -> None:
    env = discover({**BASE, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "0", "MASTER_ADDR": "h0",
                    "AIOREDUCE_MASTER_PORT": "5000"})
    assert (env.rank, env.world_size, env.master_port, env.source) == (3, 4, 5000, "openmpi")


def test_secret_file(tmp_path) -> None:
    f = tmp_path / "secret"
    f.write_bytes(b"from-file\n")
    env = discover({"AIOREDUCE_SECRET_FILE": str(f), "RANK": "0", "WORLD_SIZE": "1",
                    "MASTER_ADDR": "x", "MASTER_PORT": "1000"})
    assert env.secret == b"from-file"


@pytest.mark.parametrize("environ, message", [
    ({}, "cannot tell this process's rank"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "no rendezvous address"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "no rendezvous port"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
      "AIOREDUCE_SECRET": "s"}, "outside"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1",
      "AIOREDUCE_SECRET": ""}, "no job secret"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "AIOREDUCE_MASTER_PORT": "70000",
      "AIOREDUCE_SECRET": "s"}, "not a valid TCP port"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1",
      "AIOREDUCE_SECRET_FILE": "/nonexistent/secret"}, "AIOREDUCE_SECRET_FILE"),
])
def test_errors_say_what_is_missing(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        discover(environ)


def test_expand_hostlist() -> None:
    assert expand_hostlist("a[1-3]") == ["a1", "a2", "a3"]
    assert expand_hostlist("gpu[007-009,12],login") == ["gpu007", "gpu008", "gpu009", "gpu12",
                                                         "login"]
    assert expand_hostlist("single") == ["single"]
