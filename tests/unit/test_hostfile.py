"""Hostfile parsing: the common format round-trips; every error names the file and line."""

from __future__ import annotations

import pytest

from aioreduce_launch.hostfile import (
    HostEntry,
    HostfileError,
    filter_hosts,
    format_hostfile,
    parse_hostfile,
    parse_hosts_arg,
    read_hostfile,
)

GOOD = """\
# two GPU boxes and a login node
worker-0 slots=4
alice@worker-1 slots=2 max_slots=2 ssh_port=2222   # trailing comment

10.0.0.7 addr=192.168.5.7
localhost slots=3
worker-9 slots=2 spare=yes  # takes the ranks of a lost host under --restart
"""


def test_parse_the_common_format() -> None:
    hosts = parse_hostfile(GOOD, "hosts.txt")
    assert [(h.host, h.slots, h.user, h.ssh_port, h.addr, h.max_slots) for h in hosts] == [
        ("worker-0", 4, None, None, None, None),
        ("worker-1", 2, "alice", 2222, None, 2),
        ("10.0.0.7", 1, None, None, "192.168.5.7", None),
        ("localhost", 3, None, None, None, None),
        ("worker-9", 2, None, None, None, None),
    ]
    assert hosts[1].where == "hosts.txt:3"
    assert [h.is_local for h in hosts] == [False, False, False, True, False]
    assert [h.spare for h in hosts] == [False] * 4 + [True]
    assert hosts[2].data_addr == "192.168.5.7" and hosts[3].data_addr == "127.0.0.1"


def test_round_trip() -> None:
    hosts = parse_hostfile(GOOD)
    again = parse_hostfile(format_hostfile(hosts))
    assert [h.to_line() for h in again] == [h.to_line() for h in hosts]
    assert [(h.host, h.slots, h.user, h.ssh_port, h.addr, h.max_slots, h.spare)
            for h in again] == [(h.host, h.slots, h.user, h.ssh_port, h.addr, h.max_slots,
                                 h.spare) for h in hosts]


@pytest.mark.parametrize("text, message", [
    ("a slots=2\nb slots=two\n", "hf:2: slots='two' is not a whole number"),
    ("a slots=0\n", "hf:1: slots=0 is out of range"),
    ("a\n\n# c\nb gpus=4\n", "hf:4: unknown key 'gpus'"),
    ("a slots=2\nb\na slots=1\n", "hf:3: host 'a' is already listed at hf:1"),
    ("a slots\n", "hf:1: expected key=value"),
    ("a slots=2 slots=3\n", "hf:1: slots given twice"),
    ("a slots=4 max_slots=2\n", "hf:1: max_slots=2 is below slots=4"),
    ("a ssh_port=70000\n", "hf:1: ssh_port=70000 is out of range"),
    ("bad/host slots=1\n", "hf:1: 'bad/host' is not a host name"),
    ("a spare=maybe\n", "hf:1: spare='maybe': give yes or no"),
    ("# only a comment\n\n", "hf: no hosts"),
])
def test_errors_name_file_and_line(text: str, message: str) -> None:
    with pytest.raises(HostfileError, match=message.replace("(", r"\(")):
        parse_hostfile(text, "hf")


def test_read_missing_file(tmp_path) -> None:
    with pytest.raises(HostfileError, match="No such file"):
        read_hostfile(str(tmp_path / "nope"))


def test_hosts_arg() -> None:
    assert [(h.host, h.slots) for h in parse_hosts_arg("h1:2,h2,bob@h3:4")] == [
        ("h1", 2), ("h2", 1), ("h3", 4)]
    with pytest.raises(HostfileError, match="twice"):
        parse_hosts_arg("h1:2,h1:3")
    with pytest.raises(HostfileError, match="-H item 2: slots='x'"):
        parse_hosts_arg("h1:2,h2:x")


def test_include_exclude_deepspeed_syntax() -> None:
    hosts = [HostEntry("w0", 4), HostEntry("w1", 4), HostEntry("w2", 2)]
    assert [(h.host, h.slots) for h in filter_hosts(hosts, include="w0@w1:0,2")] == [
        ("w0", 4), ("w1", 2)]
    assert [(h.host, h.slots) for h in filter_hosts(hosts, exclude="w2@w0:1")] == [
        ("w0", 3), ("w1", 4)]
    with pytest.raises(HostfileError, match="cannot be used together"):
        filter_hosts(hosts, include="w0", exclude="w1")
    with pytest.raises(HostfileError, match="'w9' is not in the host list"):
        filter_hosts(hosts, include="w9")
    with pytest.raises(HostfileError, match=r"slots 0..1, not \[5\]"):
        filter_hosts(hosts, exclude="w2:5")
