"""aioreduce-bench runs end to end and reports the fields it promises (no timing asserted)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from aioreduce.bench.cli import parse_size

pytestmark = pytest.mark.loopback


def test_parse_size() -> None:
    assert parse_size("64K") == 65536 and parse_size("16M") == 16 << 20
    assert parse_size("1G") == 1 << 30 and parse_size("100") == 100
    for bad in ("", "M", "12Q", "0"):
        with pytest.raises(Exception, match="size"):
            parse_size(bad)


def test_p2p_json_has_every_field() -> None:
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "p2p", "--sizes",
                          "64K,2M", "--trials", "1", "--min-bytes", "4M", "--rtt-rounds", "5",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    sizes = [r["size_bytes"] for r in rows if r["kind"] == "throughput"]
    assert sizes == [65536, 2 << 20]
    for r in rows[:2]:  # both drivers, each against raw
        assert r["aioreduce_gbps"] > 0 and r["lanes_gbps"] > 0 and r["raw_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["aioreduce_gbps"] / r["raw_gbps"])
        assert r["lanes_ratio"] == pytest.approx(r["lanes_gbps"] / r["raw_gbps"])
    assert rows[2]["kind"] == "latency" and rows[2]["rounds"] == 25  # 5 rounds of five
    assert rows[2]["aioreduce_rtt_us"] > 0 and rows[2]["lanes_rtt_us"] > 0
    assert rows[2]["loop_floor_rtt_us"] > 0 and rows[2]["framed_floor_rtt_us"] > 0
    # Rank 0's CPU per round trip, every driver's (each made at least a send and a receive)
    assert set(rows[2]["cpu_us"]) == {"raw", "aioreduce", "lanes", "loop", "framed"}
    assert all(v > 0 for v in rows[2]["cpu_us"].values())


def test_allreduce_bench_json_verify() -> None:
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "allreduce", "--scheme",
                          "ring", "--nodes", "3", "--size", "64K", "--iters", "3", "--verify",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    last = json.loads(res.stdout.splitlines()[-1])
    assert last["scheme"] == "ring" and last["nodes"] == 3 and last["size_bytes"] == 65536
    assert last["median_s"] > 0 and last["p99_s"] >= last["median_s"]
    assert last["max_rel_err"] < 1e-6 and len(last["steps_s"]) == 3


def test_single_scheme_vs_gloo_ends_with_the_scheme_and_its_ratio() -> None:
    pytest.importorskip("torch", reason="torch is an optional extra (pip install torch)")
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "allreduce", "--scheme",
                          "ring", "--nodes", "3", "--size", "64K", "--iters", "3", "--verify",
                          "--vs-gloo", "--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    last = json.loads(res.stdout.splitlines()[-1])
    assert last["scheme"] == "ring" and last["max_rel_err"] < 1e-6
    assert last["ratio_vs_gloo"] == pytest.approx(last["median_s"] / last["gloo_median_s"])


def test_in_place_sums_into_a_fresh_copy_every_step_and_only_for_uncoded_schemes() -> None:
    """--in-place: the ring sums into a copy made before each step (exact at every step, so the
    rank's own vector was never summed into); the coded scheme beside it writes its own."""
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "allreduce", "--scheme",
                          "ring,gc", "--nodes", "4", "--size", "64K", "--iters", "4",
                          "--verify", "--in-place", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = {r["scheme"]: r for r in map(json.loads, res.stdout.splitlines()) if "scheme" in r}
    assert rows["ring"]["in_place"] is True and rows["gc"]["in_place"] is False
    assert rows["ring"]["max_rel_err"] < 1e-6 and rows["gc"]["max_rel_err"] < 1e-6


def test_allreduce_bench_compares_schemes_and_gloo() -> None:
    pytest.importorskip("torch", reason="torch is an optional extra (pip install torch)")
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "allreduce", "--scheme",
                          "coded-tree,ring", "--fanout", "2", "--levels", "1", "--size", "32K",
                          "--iters", "3", "--verify", "--vs-gloo", "--straggle",
                          "rank=2:delay=0.05", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(x) for x in res.stdout.splitlines()]
    by = {r["scheme"]: r for r in rows[:-1]}
    assert rows[0]["scheme"] == "gloo"
    assert set(by) == {"coded-tree", "ring", "gloo"}
    for name in ("coded-tree", "ring"):
        assert by[name]["max_rel_err"] < 1e-6
        assert by[name]["ratio_vs_gloo"] == pytest.approx(by[name]["median_s"]
                                                          / by["gloo"]["median_s"])
    assert rows[-1]["median_s"]["ring"] == by["ring"]["median_s"]
    for name in ("coded-tree", "ring", "gloo"):  # CPU per rank per step, from getrusage
        assert 0 < by[name]["cpu_s"] <= by[name]["cpu_max_s"]
        assert by[name]["bound_s"] > 0
        assert by[name]["of_bound"] == pytest.approx(by[name]["bound_s"] / by[name]["median_s"])
        # The ranks share this machine's cores: a step takes at least their CPU over them.
        cores = min(by[name]["nodes"], len(os.sched_getaffinity(0)))
        assert by[name]["cpu_floor_s"] == pytest.approx(
            sum(by[name]["cpu_per_rank_s"]) / cores, rel=1e-4)
        # How late the last rank started against the first: measured, never compared with a
        # step's time (on a loaded host it can be longer than a fast step).
        assert by[name]["start_skew_s"] >= 0 and math.isfinite(by[name]["start_skew_s"])


def test_bound_flag_prints_the_bound_beside_the_median() -> None:
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "allreduce", "--scheme",
                          "tree,transpose", "--size", "64K", "--iters", "2", "--bound",
                          "--link-mbit", "1000", "--latency", "0.0002"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    header = next(line for line in res.stdout.splitlines() if "median ms" in line)
    assert "bound ms" in header and "of bound" in header and "cpu ms" in header
    assert header.split()[-4:] == ["skew", "ms", "cpu", "floor"]
    rows = {line.split()[0]: line.split() for line in res.stdout.splitlines()
            if line.split()[:1] in (["tree"], ["transpose"])}
    # 4 ranks, 64 KiB at 125 MB/s: the tree's root (fan-out 3) has 3 children, V each way,
    # one level up and down at 200 us; the transpose 2V x 3/4, two rounds
    assert float(rows["tree"][-4]) == pytest.approx((3 * 65536 / 125e6 + 2 * 2e-4) * 1e3,
                                                    abs=0.01)
    assert float(rows["transpose"][-4]) == pytest.approx(
        (2 * 65536 * 3 / 4 / 125e6 + 2 * 2e-4) * 1e3, abs=0.01)



def test_profile_writes_one_profile_per_scheme_and_rank_and_counts_calls(tmp_path) -> None:
    env = {**os.environ, "AIOREDUCE_BENCH_PROFILE": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "allreduce", "--scheme",
                          "tree,ring", "--size", "4K", "--iters", "3", "--json"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    rows = {r["scheme"]: r for r in map(json.loads, res.stdout.splitlines())}
    for scheme in ("tree", "ring"):
        assert sorted(p.name for p in (tmp_path / scheme).iterdir()) == [
            f"rank{r}.prof" for r in range(4)]
        calls = rows[scheme]["calls_per_rank_step"]
        # (every rank ran its steps under the profiler: a step is tens of calls at least)
        assert len(calls) == 4 and all(c > 10 for c in calls), calls


def test_transpose_bench_reports_loss_and_each_ranks_own_time() -> None:
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "allreduce", "--scheme",
                          "transpose,ring", "--nodes", "3", "--size", "64K", "--iters", "4",
                          "--verify", "--options", '{"deadline": 0.2, "max_loss": 1}', "--json",
                          "--straggle", "rank=1:delay=0.5"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = {r["scheme"]: r for r in (json.loads(x) for x in res.stdout.splitlines()[:-1])}
    t, ring = rows["transpose"], rows["ring"]
    assert t["lost"] > 0.1 and ring["lost"] == 0.0  # rank 1 is cut every step
    # The ranks that were not delayed finish long before the delayed one: bounded time.
    assert t["rank_p50_s"] < 0.5 < ring["rank_p50_s"]
    assert {"rank_p99_s", "raised", "steps_s"} <= set(t)
    # Rank 1 is late by the same delay every step: the ranks' completion times pooled have a
    # tail, each rank's own (the column beside them) much less of one.
    assert t["own_tail_max"] < t["rank_p99_s"] / t["rank_p50_s"]
    # The ranks on time (0 and 2, rank 1 is delayed on purpose) waited within the bound; under
    # the ring they waited for rank 1 every step.
    assert t["on_time_p99_s"] < 0.5 < ring["on_time_p50_s"]
    assert t["on_time_p99_s"] < t["rank_p99_s"]
    # The makespan leaves out the delayed rank; its late sends come after it, and are waited
    # for before the next step (so the ring's step after it does not pay for them).
    assert t["tail_s"] > 0


@pytest.mark.parametrize("extra", [[], ["--fsdp", "--batch", "8"]])
def test_ddp_bench_json_has_gloo_and_ours(extra: list[str]) -> None:
    pytest.importorskip("torch")
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "ddp", "--nodes", "2",
                          "--hidden", "64", "--iters", "2", "--warmup", "1", "--straggle",
                          "none", "--json", *extra], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    ours = "aioreduce" if extra else "ring"
    assert [r["scheme"] for r in rows] == ["gloo", ours]
    for r in rows:
        assert r["median_s"] > 0 and r["p99_s"] >= r["median_s"] and r["nodes"] == 2
        assert r["fsdp"] if extra else "vs_gloo" in r


def test_advise_runs_without_costs_from_a_fresh_directory(tmp_path) -> None:
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "advise", "--nodes",
                          "13", "--size", "160K", "--top", "3"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("costs: the ones shipped with aioreduce")
    assert lines[1].split()[0] == "option" and len(lines) == 6
    assert lines[-1].startswith("advice: ")


def test_every_option_of_every_tool_has_help() -> None:
    import argparse

    from aioreduce.bench.cli import build_parser as bench
    from aioreduce_launch.cli import build_parser as launch

    def bare(parser: argparse.ArgumentParser, name: str) -> list[str]:
        out = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    out += bare(p, sub)
            elif action.option_strings and not action.help:
                out.append(f"{name} {action.option_strings[0]}")
        return out

    assert bare(bench(), "bench") + bare(launch(), "launch") == []
    trace = subprocess.run([sys.executable, "-m", "aioreduce.telemetry", "--help"],
                           capture_output=True, text=True, timeout=60)
    assert "'aioreduce[plot]'" in trace.stdout and "'.[plot]'" in trace.stdout


def test_dose_runs_every_cell_every_repeat_and_tabulates_them(tmp_path) -> None:
    res = subprocess.run([sys.executable, "-m", "aioreduce.bench.cli", "dose", "--nodes", "7",
                          "--delays", "0,0.02", "--repeats", "2", "--iters", "2", "--warmup",
                          "1", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    cells = sorted((r["dose"], r["repeat"], r["scheme"]) for r in rows)
    assert cells == sorted((d, k, s) for d in (0.0, 0.02) for k in (0, 1)
                           for s in ("coded-tree", "tree", "ring"))
    assert all(r["nodes"] == 7 and r["median_s"] > 0 for r in rows)
    table = (tmp_path / "table.md").read_text().splitlines()
    assert table == res.stdout.splitlines() and len(table) == 4
    assert table[2].startswith("| 7 | 0 | ") and table[3].startswith("| 7 | 0.02 | ")
    assert all(line.count("±") == 3 for line in table[2:])  # two runs: an interval each
