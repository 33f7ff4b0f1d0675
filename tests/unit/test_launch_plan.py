"""Rank placement, the env contract and the launcher's argument handling (no processes)."""

from __future__ import annotations

import pytest

from aioreduce.env import discover
from aioreduce.jobplan import HostSlots, JobConfig, free_ports, plan_ranks
from aioreduce_launch.cli import UsageError, split_argv, user_env
from aioreduce_launch.output import RankOutput


def job() -> JobConfig:
    return JobConfig(master_addr="10.0.0.1", master_port=29500, rendezvous_port=29600,
                     user_env={"WANDB_MODE": "offline"})


def test_ranks_fill_each_host_before_the_next() -> None:
    specs = plan_ranks([HostSlots("a", 2), HostSlots("b", 3, addr="192.0.2.7")], job())
    assert [(s.rank, s.host.name, s.node_rank, s.local_rank) for s in specs] == [
        (0, "a", 0, 0), (1, "a", 0, 1), (2, "b", 1, 0), (3, "b", 1, 1), (4, "b", 1, 2)]
    e = specs[3].env
    assert (e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) == ("3", "5", "1",
                                                                                  "3")
    assert e["NODE_RANK"] == "1" and e["AIOREDUCE_ADDR"] == "192.0.2.7"
    assert e["PYTHONUNBUFFERED"] == "1" and e["WANDB_MODE"] == "offline"


def test_every_rank_env_is_understood_by_the_runtime() -> None:
    j = job()
    for spec in plan_ranks([HostSlots("localhost", 4)], j):
        env = discover(spec.env)
        assert (env.rank, env.world_size, env.master_port) == (spec.rank, 4, 29600)
        assert env.secret == j.secret.encode() and env.job == j.job


def test_np_caps_and_overflows() -> None:
    assert len(plan_ranks([HostSlots("a", 4)], job(), np=2)) == 2
    with pytest.raises(ValueError, match="only 4 slots"):
        plan_ranks([HostSlots("a", 4)], job(), np=5)


def test_each_job_gets_a_fresh_secret() -> None:
    assert job().secret != job().secret and len(job().secret) == 64


def test_argv_split_and_env_options(tmp_path, monkeypatch) -> None:
    assert split_argv(["-n", "2", "--", "python", "-c", "x", "--", "y"]) == (
        ["-n", "2"], ["python", "-c", "x", "--", "y"])
    with pytest.raises(UsageError, match="separate the command"):
        split_argv(["-n", "2", "python"])
    f = tmp_path / "env"
    f.write_text("# comment\nexport A=1\nB='two'\n\n")
    monkeypatch.setenv("FROM_HERE", "h")
    assert user_env(["FROM_HERE", "C=3", "A=9"], str(f)) == {"A": "9", "B": "two",
                                                              "FROM_HERE": "h", "C": "3"}
    f.write_text("A=1\nnot a line\n")
    with pytest.raises(UsageError, match=r"env:2: expected VAR=VALUE"):
        user_env([], str(f))
    with pytest.raises(UsageError, match="NOT_SET_ANYWHERE"):
        user_env(["NOT_SET_ANYWHERE"], None)


def test_output_tags_lines_and_keeps_split_utf8(tmp_path) -> None:
    import io

    sink = io.BytesIO()
    out = RankOutput(7, "stdout", out=sink, copy_to=str(tmp_path))
    data = "héllo\nwörld\npartial".encode()
    for i in range(len(data)):  # byte by byte: multi-byte characters are split
        out.feed(data[i:i + 1])
    out.close()
    assert sink.getvalue().decode() == "[7] héllo\n[7] wörld\n[7] partial\n"
    assert (tmp_path / "rank.7.stdout").read_bytes() == data
    assert list(out.last_lines) == ["héllo", "wörld", "partial"]


def test_a_job_s_ports_differ() -> None:
    # torch's store and aioreduce's rendezvous both listen on the first host: two ports
    # picked one after the other by binding port 0 may be the same one
    ports = free_ports(50)
    assert len(set(ports)) == 50
