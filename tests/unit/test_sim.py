"""The simulator: its engine's rules (k-of-n joins, shared ports, CPUs), the step graphs'
closed forms where there is one, and the straggler draws shared with the benchmark."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from aioreduce.codes import TreeTopology
from aioreduce.costmodel import Costs, Platform, simulate
from aioreduce.costmodel.config import Config, chunking
from aioreduce.costmodel.engine import Graph, run
from aioreduce.costmodel.steps import _frames, ring, tree
from aioreduce.schemes.base import HOSTS_MAX_CHUNKS, MAX_CHUNKS, StepOptions, chunk_bounds
from aioreduce.sim.calibrate import Measured, compare, emulation_start, fit
from aioreduce.topology import heap_children

FREE = Costs(alpha=0.0, bandwidth=1e6, msg_cpu=0.0, byte_cpu=0.0, cores=None)


def test_a_k_of_n_join_fires_when_the_kth_predecessor_finishes() -> None:
    g = Graph()
    slow = g.add("delay", 0, 5.0)  # started first, finishes last
    fast = [g.add("delay", i, float(i)) for i in (1, 2, 3)]
    join = g.add("delay", 0, 0.0, after=[slow, *fast], need=2)
    run(g, 4, None)
    assert join.done == 2.0


def test_streams_into_one_port_share_it_and_one_stream_is_in_order() -> None:
    g = Graph()
    a = g.add("wire", 1, 1.0, dst=0)
    b = g.add("wire", 2, 1.0, dst=0)
    run(g, 3, None)
    assert a.done == pytest.approx(2.0) and b.done == pytest.approx(2.0)  # half rate each
    g = Graph()
    first = g.add("wire", 1, 1.0, dst=0, latency=0.5)
    second = g.add("wire", 1, 1.0, dst=0, latency=0.5)
    run(g, 2, None)
    assert (first.done, second.done) == (pytest.approx(1.5), pytest.approx(2.5))


@pytest.mark.parametrize("shared, short_end, long_end", [(1.0, 2.0, 4.0), (0.5, 4.0, 6.0)])
def test_a_stream_speeds_up_when_the_one_it_shared_with_ends(shared: float, short_end: float,
                                                              long_end: float) -> None:
    g = Graph()
    short = g.add("wire", 1, 1.0, dst=0)
    long = g.add("wire", 2, 3.0, dst=0)
    run(g, 3, None, shared=shared)
    # both at shared/2 of the rate until short is done, then long alone at the whole rate
    # (shared 1: half rate each until t=2, 1 s of long's 3 left; shared 0.5: a quarter each
    # until t=4, 2 s left)
    assert short.done == pytest.approx(short_end) and long.done == pytest.approx(long_end)


def test_a_port_several_streams_share_delivers_only_its_shared_fraction() -> None:
    g = Graph()
    a = g.add("wire", 1, 1.0, dst=0)
    b = g.add("wire", 2, 1.0, dst=0)
    run(g, 3, None, shared=0.8)
    assert a.done == pytest.approx(2.5) and b.done == pytest.approx(2.5)  # 0.4 of the rate each
    # one stream each way through rank 0's port: the whole rate both ways
    g = Graph()
    into = g.add("wire", 1, 1.0, dst=0)
    out = g.add("wire", 0, 1.0, dst=1)
    run(g, 2, None, shared=0.8)
    assert into.done == pytest.approx(1.0) and out.done == pytest.approx(1.0)


def test_the_fit_never_gives_a_shared_port_more_than_its_rate() -> None:
    cells = [_cfg(nodes=7, fanout=2, size_bytes=s) for s in (40_000, 4_000_000)]
    truth = emulation_start()
    # every step measured twice as fast as the start: a fit free to raise shared_port
    # past 1 does (checked by emptying CEILING)
    measured = [Measured(name, cfg, 0.5 * float(np.median(simulate(name, cfg, truth))))
                for cfg in cells for name in ("ring", "tree", "gc")]
    fitted = fit(measured, truth, rounds=2)
    assert fitted.ours.shared_port <= 1.0 and fitted.gloo.shared_port <= 1.0


@pytest.mark.parametrize("cores, end", [(None, 1.0), (1, 2.0), (2, 1.0)])
def test_cpu_work_of_two_ranks_overlaps_only_on_free_cores(cores: int | None,
                                                           end: float) -> None:
    g = Graph()
    ops = [g.add("cpu", r, 1.0) for r in (0, 1)]
    run(g, 2, cores)
    assert max(o.done or 0.0 for o in ops) == end


def test_one_rank_does_its_cpu_work_one_piece_at_a_time() -> None:
    g = Graph()
    ops = [g.add("cpu", 0, 1.0) for _ in range(3)]
    run(g, 1, None)
    assert sorted(o.done or 0.0 for o in ops) == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("lockstep", [False, True])
@pytest.mark.parametrize("n", [2, 4, 13])
def test_ring_moves_2_n_minus_1_over_n_of_the_vector(n: int, lockstep: bool) -> None:
    v = 1e6
    g, done = ring(FREE, [0.5] * n, v, lockstep=lockstep)
    run(g, n, None)
    expected = 0.5 + 2 * (n - 1) * (v / n) / FREE.bandwidth
    assert [d.done for d in done] == [pytest.approx(expected)] * n


def test_glooish_lockstep_ring_cannot_work_ahead_of_a_paused_rank() -> None:
    """Gloo's ring (lockstep) pays a pause and then nearly its whole calm step, as measured
    on 40 emulated hosts (GC pause: 590 ms against 329 calm, pauses of 100-500 ms); in ours
    the ranks that do not wait for the paused one do much of their work meanwhile (here, on
    2 shared cores: the per-message CPU)."""
    n, pause = 8, 1.0
    costs = Costs(alpha=1e-4, bandwidth=1e12, msg_cpu=1e-2, byte_cpu=0.0, cores=2)

    def cost_of_pause(lockstep: bool) -> float:
        ends = []
        for p in (0.0, pause):
            g, done = ring(costs, [0.0] * (n - 1) + [p], 8.0, lockstep=lockstep)
            run(g, n, 2)
            ends.append(max(d.done or 0.0 for d in done))
        return ends[1] - ends[0]

    gloo, ours = cost_of_pause(True), cost_of_pause(False)  # calm step: 1.12 s either way
    assert gloo > 0.8 * pause  # (0.88 s)
    assert ours < 0.2 * pause  # the calm step's work was mostly done during the pause (0.16)


def test_coded_tree_does_not_wait_for_one_slow_child_per_family() -> None:
    compute = [0.0] + [0.1] * 12
    kids = [TreeTopology(3, 2).children(r) for r in range(13)]
    base, done = tree(FREE, compute, 1000.0, kids, stragglers=1, root_computes=False)
    run(base, 13, None)
    t0 = max(d.done or 0.0 for d in done)
    slowed = list(compute)
    slowed[4] = slowed[10] = 100.0  # one leaf in two families
    g, done = tree(FREE, slowed, 1000.0, kids, stragglers=1, root_computes=False)
    run(g, 13, None)
    assert max(d.done or 0.0 for r, d in enumerate(done) if r not in (4, 10)) <= t0
    g, done = tree(FREE, slowed, 1000.0, kids, stragglers=0)
    run(g, 13, None)  # the uncoded tree waits
    assert min(d.done or 0.0 for d in done) > 100.0


@pytest.mark.parametrize("spans_hosts, nbytes, chunks", [
    (False, 40_000, 1), (False, 4 << 20, 4), (False, 16 << 20, 16), (False, 64 << 20, 16),
    (False, (64 << 20) + 4, 16),
    (True, 40_000, 1), (True, 4 << 20, 16), (True, 16 << 20, 64), (True, 64 << 20, 64)])
def test_messages_travel_in_at_most_max_chunks_in_the_runtime_and_the_simulator(
        spans_hosts: bool, nbytes: int, chunks: int) -> None:
    chunk, most = StepOptions().chunking(spans_hosts)
    assert most == (HOSTS_MAX_CHUNKS if spans_hosts else MAX_CHUNKS)
    bounds = chunk_bounds(nbytes // 4, 4, chunk, most)  # float32
    assert len(bounds) == chunks <= most
    assert bounds[0][0] == 0 and bounds[-1][1] == nbytes // 4
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))  # contiguous, no gap
    costs = Costs(chunk_bytes=chunk, max_chunks=most)
    assert _frames(nbytes, costs) == len(bounds)


def test_chunking_follows_the_hosts_unless_the_caller_chose() -> None:
    assert StepOptions().chunking(False) == (1 << 20, MAX_CHUNKS)
    assert StepOptions().chunking(True) == (256 << 10, HOSTS_MAX_CHUNKS)
    assert StepOptions(chunk_bytes=4096).chunking(True) == (4096, HOSTS_MAX_CHUNKS)
    assert StepOptions(max_chunks=8).chunking(False) == (1 << 20, 8)
    # The simulator cuts as the runtime would: emulated hosts span hosts.
    assert chunking(Config(["tree"], 7, 1 << 20, netns=True)) == (256 << 10, HOSTS_MAX_CHUNKS)
    assert chunking(Config(["tree"], 7, 1 << 20, options={"max_chunks": 4})) == (1 << 20, 4)


def test_tree_chunks_overlap_the_levels() -> None:
    costs = Costs(alpha=0.0, bandwidth=1e6, msg_cpu=0.0, byte_cpu=0.0, cores=None,
                  chunk_bytes=1000)
    whole = Costs(**{**costs.__dict__, "chunk_bytes": 10**9})
    times = []
    for c in (costs, whole):
        g, done = tree(c, [0.0] * 7, 1e5, [heap_children(r, 2, 7) for r in range(7)])
        run(g, 7, None)
        times.append(max(d.done or 0.0 for d in done))
    assert times[0] < 0.6 * times[1]


def _cfg(**kw: object) -> Config:
    base: dict[str, object] = dict(schemes=[], nodes=13, size_bytes=40_000, iters=20, fanout=3,
                                   levels=2, compute=0.05)
    return Config(**{**base, **kw})  # type: ignore[arg-type]


def test_a_pause_costs_ring_the_pause_and_coded_tree_nothing() -> None:
    plat = emulation_start()
    pause = "all:pause=0.1,0.5"
    for name, grows in (("ring", True), ("gloo", True), ("coded-tree", False)):
        calm = np.median(simulate(name, _cfg(), plat))
        paused = simulate(name, _cfg(straggle=pause), plat)
        assert len(paused) == 20
        if grows:
            assert np.median(paused) > calm + 0.1
        else:
            assert np.median(paused) == pytest.approx(calm, rel=0.05)


def test_fit_recovers_the_costs_it_was_made_with() -> None:
    truth = Platform(Costs(alpha=1e-3, bandwidth=1.25e8, msg_cpu=200e-6, byte_cpu=2e-9,
                           decode_cpu=300e-6, cores=2),
                     Costs(alpha=1e-3, bandwidth=1.25e8, msg_cpu=50e-6, byte_cpu=0.1e-9,
                           cores=2))
    cells = [_cfg(nodes=7, fanout=2, size_bytes=s) for s in (40_000, 4_000_000)]
    measured = [Measured(name, cfg, float(np.median(simulate(name, cfg, truth))))
                for cfg in cells for name in ("ring", "tree", "coded-tree", "gc", "gloo")]
    fitted = fit(measured, emulation_start(), rounds=5)
    worst = max(abs(c.error) for c in compare(measured, fitted))
    assert worst < 0.1


def test_the_ring_over_lanes_has_costs_of_its_own() -> None:
    """Our ring moves its segments over lanes, the trees through the event loop: a message
    costs them differently, and the fit finds both (a single cost for both missed the 40-rank
    cells of the sweep by up to half)."""
    ours = Costs(alpha=1e-3, bandwidth=1.25e8, msg_cpu=300e-6, byte_cpu=1e-9,
                 decode_cpu=100e-6, cores=2)
    truth = Platform(ours, Costs(alpha=1e-3, bandwidth=1.25e8, msg_cpu=50e-6,
                                 byte_cpu=0.1e-9, cores=2),
                     replace(ours, msg_cpu=20e-6))
    cfg = _cfg(nodes=7, fanout=2, size_bytes=40_000)
    assert (np.median(simulate("ring", cfg, truth))
            < np.median(simulate("ring", cfg, replace(truth, lanes=None))))  # the path taken
    cells = [_cfg(nodes=7, fanout=2, size_bytes=s) for s in (40_000, 4_000_000)]
    measured = [Measured(name, c, float(np.median(simulate(name, c, truth))))
                for c in cells for name in ("ring", "tree", "coded-tree", "gc", "gloo")]
    fitted = fit(measured, emulation_start(), rounds=5)
    assert max(abs(c.error) for c in compare(measured, fitted)) < 0.1
    assert fitted.ring.msg_cpu < fitted.ours.msg_cpu


def test_costs_saved_before_lanes_were_fitted_apart_still_load(tmp_path) -> None:
    import json
    from dataclasses import asdict

    from aioreduce.costmodel import load_platforms, save_platforms

    plat = emulation_start()
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"13": {"ours": asdict(plat.ours), "gloo": asdict(plat.gloo)}}))
    loaded = load_platforms(old)[13]
    assert loaded.lanes is None and loaded.ring == plat.ours
    save_platforms({13: plat}, tmp_path / "new.json")
    assert load_platforms(tmp_path / "new.json")[13] == plat


def test_unknown_scheme_is_named() -> None:
    with pytest.raises(ValueError, match="transpose"):
        simulate("transpose", _cfg(), emulation_start())


def test_tree_shapes_and_candidates_cover_every_full_tree() -> None:
    from aioreduce.costmodel.advise import candidates, tree_shapes

    assert tree_shapes(13) == [(3, 2)]
    assert tree_shapes(157) == [(12, 2)]
    assert tree_shapes(15) == [(2, 3)]  # not (14, 1): that is the star, which gc covers
    names = [o.label for o in candidates(7)]
    assert names[:2] == ["ring", "gloo"]
    assert "coded-tree (fanout=2, levels=2, stragglers=1)" in names
    assert "gc (stragglers=3)" in names


def test_advice_follows_the_stragglers() -> None:
    from aioreduce.costmodel.advise import advise

    plat = emulation_start()
    calm = advise(_cfg(size_bytes=4 << 20), plat)
    paused = advise(_cfg(iters=5, straggle="all:pause=0.1,0.5"), plat)
    assert calm[0].median <= calm[-1].median
    assert paused[0].scheme in ("coded-tree", "gc")  # only codes skip a paused rank


def test_sim_report_on_a_sweep_the_simulator_made(tmp_path) -> None:
    from aioreduce.bench.sweep import row_config
    from aioreduce.costmodel import load_platforms
    from aioreduce.sim.report import COSTS, REPORT, write

    truth = emulation_start()
    rows = []
    for straggler, spec in (("none", ""), ("slow3", "rank=6:slow=3")):
        for name in ("ring", "tree", "coded-tree", "gc"):
            cfg = _cfg(nodes=7, fanout=2, straggle=spec)
            rows.append({"scheme": name, "nodes": 7, "size_bytes": cfg.size_bytes,
                         "iters": cfg.iters, "median_s": float(np.median(
                             simulate(name, cfg, truth))),
                         "straggler": straggler, "compute_s": cfg.compute,
                         "link_mbit": 1000.0, "netns": True})
    path, _ = write(tmp_path, rows, row_config)
    text = path.read_text()
    assert path.name == REPORT and "right in **2 of 2** cells" in text
    assert "8 of 8 within 25 %" in text
    assert set(load_platforms(tmp_path / COSTS)) == {7}


def test_cli_predicts_and_advises_from_saved_costs(tmp_path, capsys) -> None:
    from aioreduce.bench.cli import main
    from aioreduce.costmodel import save_platforms

    costs = tmp_path / "costs.json"
    save_platforms({13: emulation_start()}, costs)
    assert main(["sim", "--costs", str(costs), "--nodes", "157", "--fanout", "12",
                 "--scheme", "ring,coded-tree", "--host-per-rank", "--alpha", "50e-6",
                 "--link-mbit", "10000"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["scheme", "ring", "coded-tree"]
    assert main(["advise", "--costs", str(costs), "--nodes", "13", "--iters", "3",
                 "--straggle", "all:pause=0.1,0.5", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("advice: coded-tree") or \
        out.splitlines()[-1].startswith("advice: gc"), out


def test_cli_says_where_costs_come_from(tmp_path) -> None:
    from aioreduce.bench.cli import main

    with pytest.raises(SystemExit, match="sim --sweep"):
        main(["sim", "--costs", str(tmp_path / "missing.json")])


def test_auto_reads_the_costs_of_the_nearest_cluster_size(tmp_path) -> None:
    from aioreduce.costmodel import auto, save_platforms

    a, b = emulation_start(), emulation_start(link_mbit=10.0)
    save_platforms({13: a, 40: b}, tmp_path / "c.json")
    env = {"AIOREDUCE_COSTS": str(tmp_path / "c.json")}
    assert auto.platform_for(30, env) == b and auto.platform_for(16, env) == a
    assert auto.platform_for(30, {}) == auto.GENERIC
    assert [o.label for o in auto.options(3)] == ["ring", "tree (fanout=2)"]


def test_node_refuses_a_scheme_name_other_than_auto() -> None:
    from aioreduce.env import NodeEnv
    from aioreduce.node import Node

    env = NodeEnv(rank=3, world_size=4, master_addr="127.0.0.1", master_port=1, secret=b"s",
                  job="j")
    with pytest.raises(ValueError, match="rank 3: scheme must be a Scheme or 'auto'"):
        Node(env, scheme="ring")  # type: ignore[arg-type]


def test_latency_a_run_injected_is_wire_latency_for_our_schemes_not_gloos() -> None:
    plat = emulation_start()

    def ring(name: str, latency: float) -> float:
        cfg = Config(schemes=[], nodes=7, size_bytes=4096, iters=1, latency=latency)
        return float(simulate(name, cfg, plat)[0])

    # Once latency dominates, every 10 ms more costs 2(N-1) hops one after another (at 0 the
    # 7 ranks' CPU work on 2 cores does not overlap the wire as much: not linear from there).
    assert ring("ring", 0.02) - ring("ring", 0.01) == pytest.approx(2 * 6 * 0.01, rel=1e-6)
    assert ring("ring", 0.01) > ring("ring", 0.0) + 0.1
    assert ring("gloo", 0.01) == ring("gloo", 0.0)


@pytest.mark.parametrize("cores, floor", [(None, 1.0), (2, 4.0)])
def test_every_ranks_fixed_step_cpu_sets_a_floor_on_shared_cores(cores: int | None,
                                                                  floor: float) -> None:
    """8 ranks, no compute, free messages: a tree's step ends when the last rank has paid its
    step CPU; on 2 shared cores they pay it two at a time (8 x 1 s / 2)."""
    costs = Costs(alpha=0.0, bandwidth=1e12, msg_cpu=0.0, byte_cpu=0.0, step_cpu=1.0,
                  cores=cores)
    children = [heap_children(r, 2, 8) for r in range(8)]
    g, done = tree(costs, [0.0] * 8, 8.0, children)
    run(g, 8, cores)
    assert max(d.done or 0.0 for d in done) == pytest.approx(floor)
    g, done = ring(costs, [0.0] * 8, 8.0)
    run(g, 8, cores)
    assert max(d.done or 0.0 for d in done) == pytest.approx(floor)


def test_the_shipped_costs_are_the_sweeps() -> None:
    from pathlib import Path

    from aioreduce.sim.report import SHIPPED_COSTS
    sweep = Path(__file__).parents[2] / "docs" / "sweep" / "costs.json"
    assert SHIPPED_COSTS.read_bytes() == sweep.read_bytes()


def test_a_bench_variant_adds_its_options_to_that_scheme_only() -> None:
    from aioreduce.costmodel.config import Config, build_scheme, variant
    from aioreduce.schemes import Ring, Tree

    assert variant("tree") == ("tree", {})
    assert variant("tree+lanes") == ("tree", {"lanes": True})
    assert variant("ring+lanes=false+bidirectional") == ("ring", {"lanes": False,
                                                                  "bidirectional": True})
    cfg = Config(schemes=["tree", "tree+lanes", "ring+lanes=false"], nodes=4,
                 size_bytes=1 << 20, iters=1)
    plain, laned, ring = (build_scheme(name, cfg) for name in cfg.schemes)
    assert isinstance(plain, Tree) and isinstance(laned, Tree) and isinstance(ring, Ring)
    assert not plain.lanes and laned.lanes and not ring.lanes
    # A gradient code by name per variant: m = 1 and m = 2 side by side in one launch.
    cfg = Config(schemes=['gc+code="cyclic"', 'gc+code="gaussian"'], nodes=13,
                 size_bytes=40960, iters=1)
    one, two = (build_scheme(name, cfg) for name in cfg.schemes)
    assert (one.code.n, one.code.m) == (12, 1) and (two.code.n, two.code.m) == (12, 2)
    with pytest.raises(ValueError, match="unknown code"):
        build_scheme('gc+code="lt"', cfg)


def test_a_sweep_row_is_simulated_with_the_chunks_it_was_measured_with() -> None:
    from aioreduce.bench.sweep import row_config

    row = {"scheme": "tree", "nodes": 13, "size_bytes": 64 << 20, "iters": 5,
           "straggler": "none", "compute_s": 0.0, "link_mbit": 1000.0, "netns": True}
    # Rows from before the chunking followed the hosts were cut as on one host.
    assert chunking(row_config(row)) == (1 << 20, MAX_CHUNKS)
    assert chunking(row_config({**row, "chunk_bytes": 256 << 10, "max_chunks": 64})) == (
        256 << 10, 64)
