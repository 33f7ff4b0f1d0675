"""Command line of ``aioreduce-bench``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from .flows import Bursts
from .sizes import fmt_size, parse_size


def _sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s]


def _bursts(text: str) -> Bursts:
    try:
        return Bursts.parse(text)
    except ValueError as e:  # argparse words it as "invalid value" and drops the reason
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aioreduce-bench",
                                description="aioreduce benchmarks (comparisons in one run)")
    sub = p.add_subparsers(dest="command", required=True)
    p2p = sub.add_parser("p2p", help="two processes on 127.0.0.1: aioreduce vs a raw socket")
    p2p.add_argument("--sizes", type=_sizes, default=_sizes("64K,1M,16M,64M"),
                     help="message sizes (default 64K,1M,16M,64M)")
    p2p.add_argument("--trials", type=int, default=12,
                     help="alternating trials per transport and size (default 12)")
    p2p.add_argument("--min-bytes", type=parse_size, default=parse_size("64M"),
                     help="bytes streamed per trial (default 64M)")
    p2p.add_argument("--rtt-rounds", type=int, default=300,
                     help="round trips per latency measurement (default 300)")
    p2p.add_argument("--json", action="store_true", help="one JSON object per line")

    ar = sub.add_parser("allreduce", help="schemes (and Gloo) side by side on local ranks")
    ar.add_argument("--scheme", default="ring",
                    help="one or more of coded-tree,gc,ring,tree,star (comma-separated: "
                         "alternated in the same run); NAME+OPTION or NAME+OPTION=JSON "
                         "adds a scheme option to that one, e.g. tree,tree+lanes")
    ar.add_argument("--nodes", type=int, help="ranks (default: the tree's size for "
                                              "coded-tree, else 4)")
    ar.add_argument("--fanout", type=int, default=3, help="children per parent in the trees "
                    "(default 3)")
    ar.add_argument("--levels", type=int, default=2, help="levels below the root in the coded "
                    "tree (default 2: 13 ranks at fan-out 3)")
    ar.add_argument("--stragglers", type=int, default=1,
                    help="tolerated stragglers per family (coded-tree, gc)")
    ar.add_argument("--code", default="default",
                    choices=["default", "frc", "cyclic", "random", "gaussian"],
                    help="gradient code for gc")
    ar.add_argument("--size", type=parse_size, default=parse_size("1M"),
                    help="bytes of the vector (default 1M)")
    ar.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                    help="the vector's dtype (default float32)")
    ar.add_argument("--iters", type=int, default=20, help="timed steps per scheme (default 20)")
    ar.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ar.add_argument("--compute", type=float, default=0.0, metavar="SECONDS",
                    help="emulated compute: seconds one rank needs for the whole data set")
    ar.add_argument("--straggle", default="", metavar="SPEC",
                    help="e.g. 'rank=4:delay=0.5', 'rank=4:slow=3', "
                         "'all:shifted-exp=0.01,20' (';' separates several)")
    ar.add_argument("--chunk", type=parse_size, default=None,
                    help="pipelining chunk for tree schemes (default: 1M on one host, "
                         "256K with --netns, as the runtime chooses)")
    ar.add_argument("--verify", action="store_true", help="check every result (rank 0)")
    ar.add_argument("--vs-gloo", action="store_true",
                    help="also run torch.distributed Gloo all_reduce in the same run")
    ar.add_argument("--in-place", action="store_true",
                    help="uncoded schemes sum in place into a copy of the vector made before "
                         "the clock starts, as Gloo's all_reduce does (default: they write a "
                         "result of their own)")
    ar.add_argument("--model-alpha", type=float, default=200e-6,
                    help="cost model: seconds per message (default 200e-6)")
    ar.add_argument("--model-bandwidth", type=float, default=1e9,
                    help="cost model: bytes per second per link (default 1e9)")
    ar.add_argument("--netns", action="store_true",
                    help="run every rank on its own emulated host (network namespace; root)")
    ar.add_argument("--link-mbit", type=float, metavar="MBIT",
                    help="with --netns: shape every host's link to MBIT in both directions")
    ar.add_argument("--latency", type=float, default=0.0, metavar="SECONDS",
                    help="emulated one-way latency added to every frame our ranks receive "
                         "(AIOREDUCE_LATENCY; not applied to Gloo)")
    ar.add_argument("--background", type=int, default=0, metavar="FLOWS",
                    help="with --netns: bulk TCP flows between hosts, as other tenants")
    ar.add_argument("--background-burst", type=_bursts, default=None, metavar="ON,OFF",
                    help="with --background: each flow sends in bursts of ON seconds, then "
                         "pauses OFF (exponential about those means, seeded); default steady")
    ar.add_argument("--cpus-per-host", type=float, default=None, metavar="CPUS",
                    help="with --netns: hold each emulated host to CPUS CPUs (a cgroup "
                         "quota), equal shares whatever the number of hosts")
    ar.add_argument("--gc-every", type=int, default=0, metavar="N",
                    help="Python's garbage collection after every N-th step, on every rank "
                         "at once (Node(gc_every=N), see aioreduce.stepgc); 0: left alone")
    ar.add_argument("--bound", action="store_true",
                    help="also print each scheme's own bound (bytes through its busiest link "
                    "direction / link rate + depth x --latency; rate: --link-mbit, else "
                    "--model-bandwidth) and the fraction of it reached; the median spread "
                    "of the ranks' starts (skew: the last rank out of the barrier after the "
                    "first); and, where the ranks share this machine's cores, the CPU floor "
                    "(every rank's CPU per step over the cores)")
    ar.add_argument("--json", action="store_true", help="JSON lines; the last is the summary")
    ar.add_argument("--options", type=json.loads, default={}, metavar="JSON",
                    help='more scheme options, e.g. \'{"slack": 1.3, "max_loss": 1}\'')
    ddp = sub.add_parser("ddp", help="one torch model: Gloo DDP, aioreduce ring (DDP hook) and "
                                     "coded-tree (coded mini-batches) side by side")
    ddp.add_argument("--fanout", type=int, default=3, help="coded tree's fan-out (default 3)")
    ddp.add_argument("--levels", type=int, default=2, help="coded tree's levels (default 2)")
    ddp.add_argument("--stragglers", type=int, default=1,
                     help="stragglers the coded tree tolerates per family (default 1)")
    ddp.add_argument("--hidden", type=int, default=1024,
                     help="width of the MLP's three hidden layers (1024: 2.2M parameters)")
    ddp.add_argument("--batch", type=int, default=416, help="global mini-batch (default 416)")
    ddp.add_argument("--iters", type=int, default=20, help="timed steps per scheme")
    ddp.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ddp.add_argument("--straggle", default="none|rank=4:delay=0.3|rank=4:slow=3",
                     help="straggler settings, '|'-separated, one launch each ('none': none)")
    ddp.add_argument("--nodes", type=int, default=0,
                     help="ranks (default: the tree's size, 13; another count drops coded-tree)")
    ddp.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                     help="where the models live (cuda: LOCAL_RANK picks the GPU; ranks share "
                          "GPUs when there are more ranks)")
    ddp.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                     help="the models' dtype (bfloat16: model.to(torch.bfloat16); with "
                          "--fsdp, a bfloat16 mixed-precision policy)")
    ddp.add_argument("--fsdp", action="store_true",
                     help="FSDP2 over Gloo and over aioreduce instead (a 4-layer transformer)")
    ddp.add_argument("--json", action="store_true", help="one JSON object per line")
    sw = sub.add_parser("sweep", help="schemes x ranks x vector sizes x straggler models on the "
                                      "emulated cluster; resumable JSON lines and plots")
    sw.add_argument("--out", default="sweep", help="directory for results.jsonl and the PNGs")
    sw.add_argument("--scheme", default="ring,coded-tree,gc,tree",
                    help="schemes per cell (coded-tree where the ranks form a full tree)")
    sw.add_argument("--nodes", type=lambda t: [int(x) for x in t.split(",")], default=[13, 40],
                    help="cluster sizes, comma-separated (default 13,40)")
    sw.add_argument("--sizes", type=_sizes, default=_sizes("40K,4M,64M"),
                    help="vector sizes, comma-separated (default 40K,4M,64M)")
    sw.add_argument("--stragglers", default="none,slow3,pause,shifted-exp,heavy-tail",
                    help="straggler models by name (see the module docstring)")
    sw.add_argument("--iters", default=None, metavar="N[,SIZE=N...]",
                    help="timed steps per cell, by vector size (default "
                         "'20,64M=10': what fits the default grid in an hour on 2 cores)")
    sw.add_argument("--skip", default=None, metavar="RANKSxSIZE,...",
                    help="cells of the grid not to run (default '40x64M': see the module "
                         "docstring; '' runs the whole grid)")
    sw.add_argument("--compute", type=float, default=0.05, metavar="SECONDS",
                    help="emulated compute: seconds one rank needs for the whole data set")
    sw.add_argument("--link-mbit", type=float, default=1000.0,
                    help="each emulated host's link, both directions (default 1000)")
    sw.add_argument("--latency", type=float, default=0.0, metavar="SECONDS",
                    help="emulated one-way latency per frame (our schemes only, not Gloo)")
    sw.add_argument("--no-netns", action="store_true",
                    help="ranks on 127.0.0.1 instead of emulated hosts (no shaping)")
    sw.add_argument("--no-gloo", action="store_true", help="leave Gloo out")
    sw.add_argument("--plot", action="store_true", help="only draw the PNGs from --out")
    do = sub.add_parser("dose", help="dose-response: coded tree, tree and ring as one leaf's "
                                     "delay (or slowdown) grows, with repeats and 95 %% CIs")
    do.add_argument("--out", default="dose",
                    help="directory for results.jsonl, table.md and dose.png")
    do.add_argument("--plot", nargs="*", metavar="ROWS.jsonl",
                    help="only draw: OUT/dose.png from OUT/results.jsonl, or each ROWS.jsonl "
                         "given to ROWS.png")
    do.add_argument("--nodes", type=lambda t: [int(x) for x in t.split(",")], default=[7, 13],
                    help="cluster sizes with a full tree: 7, 13, 21, 31, 40 (default 7,13)")
    dose_kind = do.add_mutually_exclusive_group()
    dose_kind.add_argument("--delays", type=lambda t: [float(x) for x in t.split(",")],
                           help="the last rank's delay per step, seconds (default "
                                "0,0.05,0.1,0.2,0.5)")
    dose_kind.add_argument("--slow", type=lambda t: [float(x) for x in t.split(",")],
                           help="the last rank's compute slowdowns instead, e.g. 1,2,3,5 "
                                "(give --compute)")
    do.add_argument("--repeats", type=int, default=3, help="launches per cell (default 3)")
    do.add_argument("--scheme", default="coded-tree,tree,ring", help="schemes per cell")
    do.add_argument("--size", type=parse_size, default=parse_size("40K"),
                    help="vector size (default 40K, the papers')")
    do.add_argument("--iters", type=int, default=10, help="timed steps per scheme and launch")
    do.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    do.add_argument("--compute", type=float, default=0.0, metavar="SECONDS",
                    help="emulated compute: seconds one rank needs for the whole data set")
    do.add_argument("--netns", action="store_true",
                    help="every rank on its own emulated host (root, iproute2)")
    do.add_argument("--link-mbit", type=float, default=None,
                    help="shape each emulated host's link (with --netns)")
    do.add_argument("--latency", type=float, default=0.0, metavar="SECONDS",
                    help="emulated one-way latency per frame")
    do.add_argument("--cpus-per-host", type=float, default=None, metavar="CPUS",
                    help="with --netns: hold each emulated host to CPUS CPUs (a cgroup "
                         "quota), the same share at every cluster size")
    do.add_argument("--straggle", default="", metavar="SPEC",
                    help="a straggler model for every cell beside the dose, e.g. "
                         "'all:load-exp=2'")
    sim = sub.add_parser("sim", help="the simulator: fit it to a sweep (--sweep), or predict "
                                     "schemes on a cluster we cannot run (--costs)")
    sim.add_argument("--sweep", metavar="DIR", help="fit costs to DIR/results.jsonl; write "
                     "DIR/costs.json and DIR/sim.md (every cell, measured and simulated)")
    _cluster_args(sim)
    sim.add_argument("--scheme", default="ring,tree,coded-tree,gc,gloo",
                     help="schemes to simulate, comma-separated (default all five)")
    adv = sub.add_parser("advise", help="rank every scheme and setting for a cluster by "
                                        "simulated step time on measured costs")
    _cluster_args(adv)
    adv.add_argument("--measure", action="store_true", help="first measure this machine's "
                     "costs: a short run of every scheme on --nodes emulated hosts (or "
                     "127.0.0.1 with --no-netns), fitted; saved to --costs")
    adv.add_argument("--no-netns", action="store_true",
                     help="with --measure: ranks on 127.0.0.1 instead of emulated hosts")
    adv.add_argument("--hostfile", metavar="FILE",
                     help="with --measure: measure your cluster instead, --nodes ranks "
                          "started on FILE's hosts by aioreduce-launch over SSH (give "
                          "--link-mbit, their links' rate: the fit keeps it fixed)")
    adv.add_argument("--launch-args", default="", metavar="ARGS",
                     help="with --hostfile: more aioreduce-launch options, e.g. "
                          "'-I ~/.ssh/cluster_key'")
    adv.add_argument("--top", type=int, default=10, help="how many options to print")
    return p


def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", default=None, help="fitted costs (from sim --sweep or advise "
                   "--measure; the entry for the nearest cluster size is used); default: "
                   "./costs.json if there is one, else the costs shipped with aioreduce "
                   "(fitted to docs/sweep)")
    p.add_argument("--nodes", type=int, default=13, help="ranks in the cluster (default 13)")
    p.add_argument("--fanout", type=int, default=3, help="coded tree's fan-out (default 3)")
    p.add_argument("--levels", type=int, default=2, help="coded tree's levels (default 2)")
    p.add_argument("--stragglers", type=int, default=1, help="tolerance of the coded schemes")
    p.add_argument("--size", type=parse_size, default=parse_size("40K"),
                   help="vector size, e.g. 40K, 4M (default 40K)")
    p.add_argument("--compute", type=float, default=0.05, metavar="SECONDS",
                   help="each rank's compute per step (default 0.05)")
    p.add_argument("--straggle", default="", help="straggler model (see aioreduce.straggle)")
    p.add_argument("--iters", type=int, default=20, help="simulated steps")
    p.add_argument("--link-mbit", type=float, default=None,
                   help="links of this speed instead of the measured ones")
    p.add_argument("--alpha", type=float, default=None, metavar="SECONDS",
                   help="wire latency instead of the fitted one (a real network's)")
    p.add_argument("--host-per-rank", action="store_true", help="every rank has its own "
                   "host's CPU (a real cluster) instead of sharing the measured machine's")


def _sim_config(opts: argparse.Namespace) -> tuple[Any, Any]:
    """The Config and Platform a sim or advise command describes."""
    from pathlib import Path

    from ..costmodel import load_platforms
    from ..costmodel.config import Config
    from ..sim.report import SHIPPED_COSTS

    if opts.costs is not None:
        path = Path(opts.costs)
        if not path.exists():
            raise SystemExit(f"no costs at {path}: fit some with 'aioreduce-bench sim --sweep "
                             "DIR' or 'aioreduce-bench advise --measure'")
    elif Path("costs.json").exists():
        path = Path("costs.json")
        print("costs: ./costs.json")
    else:
        path = SHIPPED_COSTS
        print("costs: the ones shipped with aioreduce, fitted to the sweep of docs/sweep (a "
              "2-core host's emulated cluster); --measure fits this machine's")
    platforms = load_platforms(path)
    near = min(platforms, key=lambda n: abs(n - opts.nodes))
    platform = platforms[near]
    if opts.link_mbit is not None or opts.host_per_rank or opts.alpha is not None:
        platform = platform.on_cluster(opts.link_mbit, opts.alpha,
                                       None if opts.host_per_rank else platform.ours.cores)
    cfg = Config(schemes=[], nodes=opts.nodes, size_bytes=opts.size, iters=opts.iters,
                 fanout=opts.fanout, levels=opts.levels, stragglers=opts.stragglers,
                 compute=opts.compute, straggle=opts.straggle)
    return cfg, platform


def _sim(opts: argparse.Namespace) -> int:
    import numpy as np

    from ..costmodel import simulate

    if opts.sweep:
        from pathlib import Path

        from ..sim import report
        from . import sweep

        path, _ = report.write(Path(opts.sweep), sweep.load(Path(opts.sweep)), sweep.row_config)
        print(path)
        return 0
    cfg, platform = _sim_config(opts)
    print(f"{'scheme':>12} {'median ms':>10} {'p99 ms':>9}")
    for name in (s.strip() for s in opts.scheme.split(",") if s.strip()):
        times = simulate(name, cfg, platform)
        print(f"{name:>12} {np.median(times) * 1e3:>10.1f} "
              f"{np.quantile(times, 0.99) * 1e3:>9.1f}")
    return 0


def _advise(opts: argparse.Namespace) -> int:
    from ..costmodel.advise import advise

    if opts.hostfile is not None and not opts.measure:
        raise SystemExit("aioreduce-bench advise: --hostfile is where --measure runs; give "
                         "--measure too")
    if opts.hostfile is not None and opts.link_mbit is None:
        raise SystemExit("aioreduce-bench advise: --hostfile needs --link-mbit, the rate of "
                         "your hosts' links in Mbit/s (the fit keeps the links' rate fixed "
                         "and fits what the software costs)")
    if opts.measure:
        import shlex
        from pathlib import Path

        from ..costmodel import save_platforms
        from .allreduce import Hosts
        from .measure import measure_costs

        hosts = None
        if opts.hostfile is not None:
            hosts = Hosts(opts.hostfile, tuple(shlex.split(opts.launch_args)))
        save_platforms({opts.nodes: measure_costs(opts.nodes, netns=not opts.no_netns,
                                                  link_mbit=opts.link_mbit, hosts=hosts)},
                       Path(opts.costs or "costs.json"))
    cfg, platform = _sim_config(opts)
    ranked = advise(cfg, platform)
    print(f"{'option':<44} {'median ms':>10} {'p99 ms':>9}")
    for o in ranked[:opts.top]:
        print(f"{o.label:<44} {o.median * 1e3:>10.1f} {o.p99 * 1e3:>9.1f}")
    print(f"advice: {ranked[0].label}")
    return 0


def _ddp(opts: argparse.Namespace) -> list[dict[str, Any]]:
    from ..codes import TreeTopology
    from .ddp import DdpConfig, run_ddp

    tree = TreeTopology(opts.fanout, opts.levels).size
    nodes = opts.nodes or tree
    schemes = ("gloo", "ring", "coded-tree") if nodes == tree else ("gloo", "ring")
    cfg = DdpConfig(nodes=nodes, fanout=opts.fanout, levels=opts.levels,
                    stragglers=opts.stragglers, hidden=opts.hidden, batch=opts.batch,
                    iters=opts.iters, warmup=opts.warmup, schemes=schemes, device=opts.device,
                    dtype=opts.dtype, fsdp=opts.fsdp)
    settings = [s.strip() for s in opts.straggle.split("|") if s.strip()]
    return run_ddp(cfg, ["none"] if opts.fsdp else settings)


def _allreduce(opts: argparse.Namespace) -> list[dict[str, Any]]:
    from ..codes import TreeTopology
    from ..costmodel.config import Config, variant
    from .allreduce import SCHEMES, calls_per_step, run_allreduce

    names = [s.strip() for s in opts.scheme.split(",") if s.strip()]
    bases = [variant(name)[0] for name in names]
    if opts.cpus_per_host is not None and not opts.netns:
        raise SystemExit("aioreduce-bench: --cpus-per-host holds emulated hosts to a share: "
                         "it needs --netns")
    for name in bases:
        if name not in SCHEMES:
            raise SystemExit(f"aioreduce-bench: unknown scheme {name!r} "
                             f"(choose from {', '.join(SCHEMES)})")
    tree_size = TreeTopology(opts.fanout, opts.levels).size
    nodes = opts.nodes or (tree_size if "coded-tree" in bases else 4)
    if "coded-tree" in bases and nodes != tree_size:
        raise SystemExit(f"aioreduce-bench: coded-tree with fanout {opts.fanout} and "
                         f"{opts.levels} levels needs --nodes {tree_size}")
    cfg = Config(schemes=names, nodes=nodes, size_bytes=opts.size, iters=opts.iters,
                 warmup=opts.warmup, dtype=opts.dtype, fanout=opts.fanout, levels=opts.levels,
                 stragglers=opts.stragglers, code=opts.code, compute=opts.compute,
                 straggle=opts.straggle, verify=opts.verify, vs_gloo=opts.vs_gloo,
                 chunk_bytes=opts.chunk, model_alpha=opts.model_alpha,
                 model_bandwidth=(opts.link_mbit * 1e6 / 8 if opts.link_mbit
                                  else opts.model_bandwidth),
                 netns=opts.netns, link_mbit=opts.link_mbit, options=opts.options,
                 background=opts.background,
                 background_burst=([opts.background_burst.on, opts.background_burst.off]
                                   if opts.background_burst else None),
                 latency=opts.latency, in_place=opts.in_place,
                 gc_every=opts.gc_every, cpus_per_host=opts.cpus_per_host)
    results = run_allreduce(cfg)
    where = os.environ.get("AIOREDUCE_BENCH_PROFILE")
    if where:  # (the ranks wrote their profiles where they ran: this host, or its netns)
        for r in results:
            counts = calls_per_step(where, r["scheme"], nodes, opts.iters)
            if counts is not None:
                r["calls_per_rank_step"] = [round(c, 1) for c in counts]
    gloo = next((r for r in results if r["scheme"] == "gloo"), None)
    rows = [r for r in results if r["scheme"] != "gloo"]
    if gloo is not None:
        for r in rows:
            r["gloo_median_s"] = gloo["median_s"]
            r["ratio_vs_gloo"] = r["median_s"] / gloo["median_s"]
    # Gloo first: with one scheme, the last line is that scheme's object (with the ratio).
    return ([gloo] if gloo else []) + rows


def _print_allreduce(rows: list[dict[str, Any]], *, bound: bool = False) -> None:
    rows = [r for r in rows if r["scheme"] != "gloo"] + [r for r in rows
                                                          if r["scheme"] == "gloo"]
    first = rows[0]
    print(f"{first['nodes']} ranks, {fmt_size(first['size_bytes'])}B vector, "
          f"{first['iters']} iterations (median and p99 of the per-step makespan; of each "
          "rank's own completion time: rank p50, rank p99, pooled over the ranks, and the "
          "largest of each rank's own p99/p50; on time: p99/p50 of the ranks not delayed on "
          "purpose at that step; CPU per rank per step: the mean rank's and the busiest "
          "rank's)")
    extra = (f" {'bound ms':>9} {'of bound':>8} {'skew ms':>8} {'cpu floor':>9}" if bound
             else "")
    print(f"{'scheme':>11} {'median ms':>10} {'p99 ms':>9} {'model ms':>9} {'vs gloo':>8} "
          f"{'max rel err':>12} {'rank p50':>9} {'rank p99':>9} {'p99/p50':>8} {'own max':>7} "
          f"{'on time':>7} {'lost':>7} "
          f"{'raised':>6} {'cpu ms':>7} {'cpu max':>7}{extra}")
    for r in rows:
        model = f"{r['model_s'] * 1e3:9.1f}" if r.get("model_s") is not None else f"{'-':>9}"
        ratio = f"{r['ratio_vs_gloo']:8.2f}" if "ratio_vs_gloo" in r else f"{'-':>8}"
        err = f"{r['max_rel_err']:12.2e}" if "max_rel_err" in r else f"{'-':>12}"
        tail = r["rank_p99_s"] / r["rank_p50_s"] if r.get("rank_p50_s") else float("nan")
        own = r.get("own_tail_max", float("nan"))
        on_time = (r["on_time_p99_s"] / r["on_time_p50_s"] if r.get("on_time_p50_s")
                   else float("nan"))
        print(f"{r['scheme']:>11} {r['median_s'] * 1e3:10.2f} {r['p99_s'] * 1e3:9.2f} "
              f"{model} {ratio} {err} {r['rank_p50_s'] * 1e3:9.2f} "
              f"{r['rank_p99_s'] * 1e3:9.2f} {tail:8.2f} {own:7.2f} {on_time:7.2f} "
              f"{r['lost']:7.2%} "
              f"{r['raised']:6d} {r['cpu_s'] * 1e3:7.2f} {r['cpu_max_s'] * 1e3:7.2f}"
              f"{_bound_cells(r, bound)}")
    for r in rows:
        calls = r.get("calls_per_rank_step")
        if calls:
            print(f"{r['scheme']}: Python calls per rank-step (cProfile, builtins and "
                  f"coroutine resumptions counted): mean {sum(calls) / len(calls):.1f}, "
                  f"by rank {' '.join(f'{c:.0f}' for c in calls)}")


def _bound_cells(row: dict[str, Any], shown: bool) -> str:
    if not shown:
        return ""
    links = (f" {row['bound_s'] * 1e3:9.2f} {row['of_bound']:8.2f}" if "bound_s" in row
             else f" {'-':>9} {'-':>8}")
    skew = f" {row['start_skew_s'] * 1e3:8.2f}" if "start_skew_s" in row else f" {'-':>8}"
    floor = f" {row['cpu_floor_s'] * 1e3:9.2f}" if "cpu_floor_s" in row else f" {'-':>9}"
    return links + skew + floor


def _print_p2p(results: list[dict[str, Any]]) -> None:
    print("GB/s, and each driver's ratio to raw (event loop: Node.send/recv_into; "
          "blocking: the bulk links)")
    print(f"{'size':>6} {'event loop':>11} {'ratio':>6} {'blocking':>9} {'ratio':>6} "
          f"{'raw':>7}")
    for r in results:
        if r["kind"] == "throughput":
            print(f"{fmt_size(r['size_bytes']):>6} {r['aioreduce_gbps']:>11.2f} "
                  f"{r['ratio']:>6.2f} {r['lanes_gbps']:>9.2f} {r['lanes_ratio']:>6.2f} "
                  f"{r['raw_gbps']:>7.2f}")
        else:
            raw = r["raw_rtt_us"]
            print(f"round trip of {r['message_bytes']} B (median of {r['rounds']}), and its "
                  "ratio to raw: event loop "
                  f"{r['aioreduce_rtt_us']:.0f} us ({r['aioreduce_rtt_us'] / raw:.2f}), "
                  f"blocking {r['lanes_rtt_us']:.0f} ({r['lanes_rtt_us'] / raw:.2f}), raw "
                  f"{raw:.0f}; on the event loop, a bare protocol "
                  f"{r['loop_floor_rtt_us']:.0f} ({r['loop_floor_rtt_us'] / raw:.2f}) and a "
                  f"minimal framed one {r['framed_floor_rtt_us']:.0f} "
                  f"({r['framed_floor_rtt_us'] / raw:.2f})")
            cpu = r.get("cpu_us")
            if cpu:
                print("CPU per round trip on rank 0's thread (its send and receive, kernel "
                      f"time included): event loop {cpu['aioreduce']:.0f} us, blocking "
                      f"{cpu['lanes']:.0f}, raw {cpu['raw']:.0f}; bare protocol "
                      f"{cpu['loop']:.0f}, minimal framed {cpu['framed']:.0f}")


def _sweep(opts: argparse.Namespace) -> int:
    from pathlib import Path

    from . import sweep

    out = Path(opts.out)
    if not opts.plot:
        try:
            iters = sweep.Iterations.parse(opts.iters or sweep.DEFAULT_ITERS)
            skip = sweep.parse_skip(sweep.DEFAULT_SKIP if opts.skip is None else opts.skip)
        except ValueError as exc:
            raise SystemExit(f"aioreduce-bench sweep: {exc}") from None
        cells = sweep.grid(opts.nodes, opts.sizes,
                           [s.strip() for s in opts.stragglers.split(",") if s.strip()], skip)
        ran = sweep.sweep(cells, [s.strip() for s in opts.scheme.split(",") if s.strip()], out,
                          iters=iters, compute=opts.compute, netns=not opts.no_netns,
                          link_mbit=None if opts.no_netns else opts.link_mbit,
                          latency=opts.latency,
                          vs_gloo=not opts.no_gloo and sweep.gloo_available())
        print(f"{ran} cells run, {len(cells) - ran} already in {out / sweep.RESULTS}")
    for path in sweep.plot(out):
        print(path)
    return 0


def _dose(opts: argparse.Namespace) -> int:
    from pathlib import Path

    from . import dose

    if opts.plot is not None:
        sources = ([Path(p) for p in opts.plot] if opts.plot
                   else [Path(opts.out) / "results.jsonl"])
        for src in sources:
            png = (src.with_suffix(".png") if opts.plot else Path(opts.out) / "dose.png")
            print(dose.plot(dose.read_rows(src), png))
        return 0
    if opts.cpus_per_host is not None and not opts.netns:
        raise SystemExit("aioreduce-bench dose: --cpus-per-host needs --netns")
    kind, doses = (("slow", opts.slow) if opts.slow
                   else ("delay", opts.delays or [0.0, 0.05, 0.1, 0.2, 0.5]))
    try:
        path = dose.run_dose(opts.nodes, doses, kind, opts.repeats, Path(opts.out),
                             schemes=[s.strip() for s in opts.scheme.split(",") if s.strip()],
                             size_bytes=opts.size, iters=opts.iters, warmup=opts.warmup,
                             compute=opts.compute, netns=opts.netns,
                             link_mbit=opts.link_mbit, latency=opts.latency,
                             straggle=opts.straggle, cpus_per_host=opts.cpus_per_host)
    except ValueError as exc:
        raise SystemExit(f"aioreduce-bench dose: {exc}") from None
    print(path.read_text(), end="")
    return 0


def _json_lines(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(json.dumps(r))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``aioreduce-bench``."""
    opts = build_parser().parse_args(argv)
    if opts.command == "allreduce":
        rows = _allreduce(opts)
        if opts.json:
            _json_lines(rows)
            schemes = [r for r in rows if r["scheme"] != "gloo"]
            if len(schemes) > 1:  # the last line sums up the comparison
                print(json.dumps({"scheme": ",".join(r["scheme"] for r in rows),
                                  "nodes": rows[0]["nodes"],
                                  "size_bytes": rows[0]["size_bytes"],
                                  "median_s": {r["scheme"]: r["median_s"] for r in rows},
                                  "results": rows}))
        else:
            _print_allreduce(rows, bound=opts.bound)
        return 0
    if opts.command == "ddp":
        from .ddp import print_ddp

        rows = _ddp(opts)
        if opts.json:
            _json_lines(rows)
        else:
            print_ddp(rows)
        return 0
    if opts.command == "sweep":
        return _sweep(opts)
    if opts.command == "dose":
        return _dose(opts)
    if opts.command == "sim":
        return _sim(opts)
    if opts.command == "advise":
        return _advise(opts)
    if opts.command == "p2p":
        from .p2p import run_p2p

        results = run_p2p(opts.sizes, opts.trials, opts.min_bytes, opts.rtt_rounds)
        if opts.json:
            _json_lines(results)
        else:
            _print_p2p(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
