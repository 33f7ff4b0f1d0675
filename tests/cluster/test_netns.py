"""The emulated cluster: namespaces as hosts, shaped links, guaranteed teardown (root only)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aioreduce.bench import cpushare
from aioreduce.bench.cluster import Cluster, available
from aioreduce.bench.flows import Bursts

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(available() is not None,
                                 reason=f"emulated cluster unavailable: {available()}")]

RECEIVER = """
import socket, sys, time
s = socket.create_server((sys.argv[1], 5000)); c, _ = s.accept()
n, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t0 = t0 or time.monotonic(); n += len(b)
print(n / (time.monotonic() - t0))
"""
SENDER = """
import socket, sys, time
for _ in range(100):
    try: c = socket.create_connection((sys.argv[1], 5000)); break
    except OSError: time.sleep(0.05)
c.sendall(b"x" * (4 << 20)); c.close()
"""


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


def test_hosts_reach_each_other_and_links_are_shaped() -> None:
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
    before = allowed.read_text()
    with Cluster(3, rate_mbit=100) as cl:
        names = set(cl.names)
        assert names <= _namespaces()
        # Every host runs cubic, whatever this machine's default (BBR here): a namespace
        # may pick it only once it is allowed, which the cluster does for its life.
        for i in range(3):
            got = subprocess.run(cl.exec_argv(i, ["sysctl", "-n",
                                                  "net.ipv4.tcp_congestion_control"]),
                                 capture_output=True, text=True, check=True).stdout.strip()
            assert got == "cubic", (i, got)
            # ... and keeps a connection's window across idle time (see Cluster.idle_restart)
            idle = subprocess.run(cl.exec_argv(i, ["sysctl", "-n",
                                                   "net.ipv4.tcp_slow_start_after_idle"]),
                                  capture_output=True, text=True, check=True).stdout.strip()
            assert idle == "0", (i, idle)
        recv = subprocess.Popen(cl.exec_argv(1, [sys.executable, "-c", RECEIVER, cl.addr(1)]),
                                stdout=subprocess.PIPE, text=True)
        subprocess.run(cl.exec_argv(0, [sys.executable, "-c", SENDER, cl.addr(1)]),
                       check=True, timeout=60)
        rate = float(recv.communicate(timeout=60)[0])
        assert rate < 100e6 / 8 * 1.5, rate  # shaped: not the GB/s of an unshaped veth
        assert rate > 100e6 / 8 * 0.3, rate
        # The machine's own namespace has no route into the test subnet.
        route = subprocess.run(["ip", "route", "get", cl.addr(1)], capture_output=True,
                               text=True)
        assert "dev br0" not in route.stdout
    assert not names & _namespaces()
    assert allowed.read_text() == before  # the machine's list as it was


def test_overlapping_clusters_share_the_allowed_algorithm_and_the_last_one_out_restores() -> None:
    # Two benches at once (pytest workers, two users): the first out used to put the list
    # back while the second still set up its hosts, whose sysctl then failed.
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
    before = allowed.read_text()
    with Cluster(1) as first, Cluster(1) as second:
        first.teardown()  # the first one out (teardown is idempotent: `with` calls it again)
        got = subprocess.run(second.exec_argv(0, ["sysctl", "-w",
                                                  "net.ipv4.tcp_congestion_control=cubic"]),
                             capture_output=True, text=True)
        assert got.returncode == 0, got.stderr  # still allowed: the second holds it
    assert allowed.read_text() == before  # the last one out put the machine's list back


def test_teardown_kills_what_runs_inside() -> None:
    cl = Cluster(2)
    with cl:
        sleeper = subprocess.Popen(cl.exec_argv(0, ["sleep", "300"]))
        time.sleep(0.2)
    assert sleeper.wait(timeout=10) != 0
    assert not set(cl.names) & _namespaces()


def test_background_flows_in_bursts_start_as_asked_and_go_at_teardown() -> None:
    with Cluster(2, rate_mbit=100) as cl:
        procs = cl.background(1, bursts=Bursts(0.01, 0.01))
        sink, source = procs
        assert "source" in source.args and "--on" in source.args, source.args
        on = list(source.args)
        assert (on[on.index("--on") + 1], on[on.index("--off") + 1]) == ("0.01", "0.01")
        assert source.poll() is None and sink.poll() is None  # sending, not failed
    assert source.wait(timeout=10) is not None and sink.wait(timeout=10) is not None
    assert not set(cl.names) & _namespaces()


def test_a_run_with_bursty_background_flows_is_exact() -> None:
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "allreduce", "--scheme",
                          "transpose,ring", "--nodes", "3", "--size", "256K", "--iters", "5",
                          "--verify", "--netns", "--link-mbit", "1000", "--background", "2",
                          "--background-burst", "0.01,0.02", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in res.stdout.splitlines()][:-1]
    assert {r["scheme"] for r in rows} == {"transpose", "ring"}
    assert all(r["max_rel_err"] < 1e-6 for r in rows)


def test_ring_and_coded_tree_are_exact_across_emulated_hosts() -> None:
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "allreduce", "--scheme",
                          "coded-tree,ring", "--fanout", "2", "--levels", "2", "--size", "256K",
                          "--iters", "3", "--verify", "--netns", "--link-mbit", "1000",
                          "--json"], capture_output=True, text=True, timeout=600)
    # The ranks' log lines (not their tracebacks) say which connection failed first.
    logged = [x for x in res.stderr.splitlines() if x and not x.startswith((" ", "Traceback"))]
    assert res.returncode == 0, "\n".join(logged[:40]) + "\n...\n" + res.stderr[-1500:]
    rows = [json.loads(x) for x in res.stdout.splitlines()][:-1]
    assert {r["scheme"] for r in rows} == {"coded-tree", "ring"}
    assert all(r["max_rel_err"] < 1e-6 and r["nodes"] == 7 for r in rows)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (Gloo)")
def test_gloo_runs_side_by_side_on_the_emulated_hosts() -> None:
    # Gloo used to dial 127.0.0.1 inside the namespaces ("connectFullMesh failed").
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "allreduce", "--scheme",
                          "ring", "--nodes", "4", "--size", "256K", "--iters", "3", "--verify",
                          "--netns", "--link-mbit", "1000", "--vs-gloo", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in res.stdout.splitlines()]
    assert sorted(r["scheme"] for r in rows) == ["gloo", "ring"]
    assert all(r["max_rel_err"] < 1e-6 and r["nodes"] == 4 for r in rows)


def test_a_failed_rank_ends_the_cluster_run_and_is_named() -> None:
    # Rank 2 fails at once; the others would wait for it (as ranks wait for a peer that died).
    # The run must stop them and name rank 2, not wait for rank 0 until the timeout.
    from aioreduce.bench.allreduce import run_on_cluster

    worker = [sys.executable, "-c", "import os, sys, time\n"
              "sys.exit(3) if os.environ['RANK'] == '2' else time.sleep(600)"]
    with pytest.raises(RuntimeError, match=r"rank 2 failed \(exit code 3\)"):
        run_on_cluster(4, None, 0, worker, dict(os.environ), timeout=300)
    assert not {n for n in _namespaces() if n.startswith(f"arx{os.getpid()}")}


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    """``aioreduce-bench ARGS``, which must succeed."""
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", *args],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_sweep_runs_resumes_and_plots(tmp_path: Path) -> None:
    # The short version of `aioreduce-bench sweep` (the full grid is a script-length run).
    args = ("sweep", "--out", str(tmp_path), "--nodes", "7", "--sizes", "40K", "--stragglers",
            "none,pause", "--iters", "3", "--no-gloo")
    _bench(*args)
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    cells = {(r["cell"], r["scheme"]) for r in rows}
    assert cells == {(f"7/40960/{m}", s) for m in ("none", "pause")
                     for s in ("ring", "coded-tree", "gc", "tree")}
    assert all(len(r["steps_s"]) == 3 and r["netns"] for r in rows)
    assert "0 cells run, 2 already" in _bench(*args).stdout  # resumed
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(rows)
    for png in ("median_p99.png", "speedup_vs_ring.png", "cdf_7.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_fits_the_sweep_and_advise_measures_the_cluster(tmp_path: Path) -> None:
    # The simulator fitted to a short sweep writes its report; advise --measure runs every
    # scheme on emulated hosts, fits, saves the costs and ranks the options.
    _bench("sweep", "--out", str(tmp_path), "--nodes", "4", "--sizes", "40K", "--stragglers",
           "none,slow3", "--iters", "3", "--no-gloo")
    _bench("sim", "--sweep", str(tmp_path))
    report = (tmp_path / "sim.md").read_text()
    assert "right in **" in report and "| 4 | 40K | slow3 | coded-tree |" in report
    costs = tmp_path / "measured.json"
    adv = _bench("advise", "--measure", "--costs", str(costs), "--nodes", "4", "--size", "40K",
                 "--straggle", "rank=3:slow=3", "--iters", "3")
    assert adv.stdout.splitlines()[-1].startswith("advice: ")
    assert set(json.loads(costs.read_text())) == {"4"}


BUSY = """
import time
print([line for line in open('/proc/self/cgroup').read().splitlines()
       if line.split(':')[1] in ('cpu', 'cpu,cpuacct', '')][0], flush=True)
t = time.process_time()
while time.process_time() - t < 0.2:
    pass
"""


@pytest.mark.skipif(cpushare.unavailable() is not None,
                    reason=f"no CPU groups here: {cpushare.unavailable()}")
def test_each_host_is_held_to_its_cpu_share_and_the_groups_go_at_teardown() -> None:
    with Cluster(2, cpus_per_host=0.1) as cl:
        assert cl.shares is not None
        groups = [cl.shares.group(i) for i in range(2)]
        out = subprocess.run(cl.rank_argv(1, [sys.executable, "-c", BUSY]),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        # The process ran in host 1's group (the cgroup as its own /proc names it) ...
        assert out.stdout.split(":")[-1].strip().endswith(f"{cl.tag}/h1"), out.stdout
        # ... and 0.2 s of CPU at 0.1 CPU a period ran out of its quota, host 0 never did.
        assert cl.shares.throttled(1) > 0
        assert cl.shares.throttled(0) == 0
        assert all(g.is_dir() for g in groups)
    assert not any(g.exists() for g in groups)
    assert not groups[0].parent.exists()


@pytest.mark.skipif(cpushare.unavailable() is not None,
                    reason=f"no CPU groups here: {cpushare.unavailable()}")
def test_the_cpu_groups_of_a_run_that_died_are_removed_as_stale() -> None:
    from aioreduce.bench.cluster import PREFIX, remove_stale

    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names a cluster whose creating process is gone
    shares = cpushare.CpuShares(f"{PREFIX}{gone.pid}-test", 2, 0.5)
    shares.create()
    assert shares.base.is_dir()
    assert str(shares.base) in remove_stale()
    assert not shares.base.exists()
