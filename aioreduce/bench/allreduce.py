"""``aioreduce-bench allreduce``: schemes (and Gloo) side by side, in one run.

All schemes run in the same rank processes, alternating iteration by iteration (ABBA order),
so they see the same machine noise. Each iteration starts from a barrier; its time is the
makespan from the common start until the last rank that is not an injected straggler has the
result. Compute is emulated by sleeping for the rank's share of ``--compute`` seconds (the time
one rank would need for the whole data set: 1/N for ring and uncoded schemes, the coded load for
coded ones), which is what the injected ``slow=K`` stretches. With ``--verify`` rank 0 checks
every result against the exact sum; with ``--vs-gloo`` torch.distributed's Gloo ``all_reduce``
runs on the same ranks and data, with the same emulated compute and stragglers.

Besides the makespan, each rank's own completion time (from the common start until *that*
rank has the result) is reported: ``rank_p50_s``, ``rank_p99_s``. A bounded-time scheme
(``transpose``) lets the ranks that were not delayed finish while a delayed rank is still
computing, which the makespan (it waits for the last rank) cannot show; a rank's own injected
delay always counts in its own time. ``on_time_p50_s``, ``on_time_p99_s``: the same over the
ranks not delayed on purpose at that step (named, paused or spiked), which is the tail a
straggler-tolerant scheme bounds. ``lost`` is the mean fraction of contributions missing
from a rank's result, ``raised`` the steps the safety valve refused. After each step every
rank waits, off the clock, until its peers' kernels have acknowledged every byte it sent: a
straggler-tolerant step can end with messages it did not need still on the links, and with the
schemes alternating, the next step (of another scheme) would otherwise pay for them. ``tail_s``
(median) is how long after the makespan the last rank's sends were all acknowledged; an
injected straggler's own late finish counts in it. Sessions are kept
across the alternation (``Node.use(keep=True)``), so an adaptive deadline learns from every
step of its scheme; warm-up iterations cover the transpose's warm-up stages.
"""

from __future__ import annotations

import asyncio
import cProfile
import json
import math
import os
import pstats
import queue
import resource
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from ..codes.model import ComputeModel, LinkModel, predict_ring, predict_star, predict_tree
from ..costmodel.config import (
    Config,
    build_scheme,
    chunking,
    load_fraction,
    variant,
    warmup_iterations,
)
from ..node import Node
from ..schemes import CodedTree, GradientCoding, Scheme, StragglerError, names
from ..schemes.base import chunk_step
from ..straggle import StraggleModel, parse_seeded, parse_straggle
from ..transport.loop import run
from .bound import bound
from .flows import Bursts

SCHEMES = tuple(names())  # every registered scheme


class _Data:
    """This rank's vector per scheme and the exact sums rank 0 checks against."""

    def __init__(self, cfg: Config, rank: int, world: int) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.n = max(1, cfg.size_bytes // np.dtype(cfg.dtype).itemsize)
        self._mine: dict[str, np.ndarray] = {}
        self._truth: dict[str, np.ndarray] = {}
        self._plain: np.ndarray | None = None  # this rank's uncoded vector
        self._plain_truth: np.ndarray | None = None

    def _vec(self, key: int) -> np.ndarray:
        rng = np.random.default_rng([self.cfg.seed, key])
        return rng.standard_normal(self.n).astype(self.cfg.dtype)

    def mine(self, name: str, scheme: Scheme | None) -> np.ndarray:
        if name not in self._mine:
            if isinstance(scheme, CodedTree | GradientCoding):
                num = _fit(scheme)
                ids, w = scheme.placement(self.rank, num)
                acc = np.zeros(self.n, np.float64)
                for x, wx in zip(ids, w, strict=True):
                    acc += wx * self._vec(1000 + int(x))
                self._mine[name] = acc.astype(self.cfg.dtype)
                if self.rank == 0 and self.cfg.verify:
                    self._truth[name] = sum((self._vec(1000 + x) for x in range(num)),
                                            np.zeros(self.n, np.float64))
            else:  # the uncoded schemes (and Gloo, which copies it) share one vector
                if self._plain is None:
                    self._plain = self._vec(self.rank)
                    if self.rank == 0 and self.cfg.verify:
                        self._plain_truth = sum((self._vec(r) for r in range(self.world)),
                                                np.zeros(self.n, np.float64))
                self._mine[name] = self._plain
                if self._plain_truth is not None:
                    self._truth[name] = self._plain_truth
        return self._mine[name]

    def rel_err(self, name: str, value: np.ndarray) -> float:
        truth = self._truth[name]
        return float(np.linalg.norm(value.astype(np.float64) - truth) / np.linalg.norm(truth))


def _fit(scheme: CodedTree | GradientCoding) -> int:
    """The smallest data set the scheme's placement fits."""
    return scheme.code.k if isinstance(scheme, GradientCoding) else scheme.min_samples


async def _worker(cfg: Config) -> None:
    # The bench injects the straggler model itself, by iteration, so every scheme (and Gloo)
    # sees the same delays at the same iteration (the node would draw them by its own step
    # number, which differs between the alternating schemes).
    model = parse_seeded(cfg.straggle)
    node = Node.from_env(close_timeout=30.0, straggle=StraggleModel(), gc_every=cfg.gc_every)
    async with node:
        rank, world = node.rank, node.world_size
        schemes = {name: build_scheme(name, cfg) for name in cfg.schemes}
        names = list(cfg.schemes) + (["gloo"] if cfg.vs_gloo else [])
        dist: Any = None
        torch: Any = None
        if cfg.vs_gloo:
            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=rank, world_size=world)
        data = _Data(cfg, rank, world)
        # Every vector made before the first step, off the event loop: at 64 MiB a coded
        # scheme's rank sums several random vectors (seconds of CPU with 40 ranks on 2 cores),
        # and a loop blocked that long misses its peers' handshakes (they give up after 10 s).
        await asyncio.to_thread(lambda: [data.mine(n, schemes.get(n)) for n in names])
        # Per iteration: start, end, fraction of contributions received, 1 if refused, when
        # this rank's sends were all acknowledged, and this process's CPU seconds in the step.
        times: dict[str, list[tuple[float, ...]]] = {n: [] for n in names}
        errors: dict[str, float] = {n: 0.0 for n in names}
        current: str | None = None
        # Once, not per step: a coded tree's plan takes tens of milliseconds of CPU, and a
        # rank that spends them between steps starves the ranks still in one (2 cores).
        loads = {n: load_fraction(schemes.get(n), world) for n in names}
        warmup = warmup_iterations(cfg)
        profile = _Profile(rank)
        buffers: dict[str, np.ndarray] = {}  # the vectors summed in place, one per scheme
        for it in range(warmup + cfg.iters):
            order = names if it % 2 == 0 else names[::-1]
            for name in order:
                scheme = schemes.get(name)
                if scheme is not None and current != name:
                    await node.use(scheme, keep=True)
                    current = name
                vec = data.mine(name, scheme)
                sleep = loads[name] * cfg.compute
                # Gloo sums in place: its fresh copy of the vector is made before the clock
                # starts, as a trainer's gradients are there already (ours write a result of
                # their own, so Gloo is not charged a copy that ours do not make).
                tensor = (torch.from_numpy(_refill(buffers, name, vec)) if scheme is None
                          else None)
                # --in-place: ours get the same treatment (a copy made before the clock, summed
                # into), so the two are compared doing the same work.
                work = _refill(buffers, name, vec) if _in_place(cfg, scheme) else None
                # The injected delay is drawn before the clock (the bench's work, not ours).
                delay = sleep + model.extra_delay(rank, it, sleep, world)
                await node.barrier(timeout=300)
                t0 = time.monotonic()
                cpu0 = cpu_seconds()
                profile.start(name, it >= warmup)
                received, refused = 1.0, 0.0
                value: np.ndarray | None = None
                if scheme is None:
                    assert dist is not None and tensor is not None
                    await asyncio.sleep(delay)
                    dist.all_reduce(tensor)
                    value = tensor.numpy()
                else:
                    def compute(v: np.ndarray = vec, t: float = delay) -> np.ndarray:
                        time.sleep(t)
                        return v

                    call = node.aggregate if scheme.coded else node.allreduce
                    try:
                        if work is not None:
                            await asyncio.sleep(delay)
                            res = await node.allreduce(work, in_place=True)
                        else:
                            # Nothing to emulate: the vector itself (a thread hand-off for a
                            # sleep of 0 would be counted as the step's CPU).
                            res = await call(compute if delay > 0 else vec)
                        value, received = res.value, res.received
                    except StragglerError as exc:
                        if exc.received is None:
                            raise
                        received, refused = exc.received, 1.0  # the safety valve said no
                profile.stop()
                t1 = time.monotonic()
                cpu = cpu_seconds() - cpu0
                # A straggler-tolerant step can end with messages it did not need still on the
                # links (gradient coding's last leaf, a coded tree's late child); the step
                # after it, of another scheme when they alternate, would pay for them. Wait
                # here, off the clock, until the peers have every byte; when that was is kept.
                await node.mesh.drained(timeout=30)
                t2 = time.monotonic()
                if it >= warmup:
                    times[name].append((t0, t1, received, refused, t2, cpu))
                    if rank == 0 and cfg.verify and value is not None and received >= 1.0:
                        errors[name] = max(errors[name], data.rel_err(name, value))
        profile.dump()
        # Everyone's timings, one collective step per scheme (every rank ran the same steps).
        for name in names:
            every = (await node.allgather(np.array(times[name], np.float64))).value
            if rank == 0:
                _report(cfg, name, schemes.get(name), every, errors[name], world)
        if dist is not None:
            dist.destroy_process_group()


class _Profile:
    """``AIOREDUCE_BENCH_PROFILE=DIR``: each rank profiles its timed steps only (cProfile of
    the event loop's thread; barriers and drains between steps left out), one profile per
    scheme, and writes ``DIR/<scheme>/rank<N>.prof`` (read with ``python -m pstats``; the
    bench prints each rank's calls per step from them: :func:`calls_per_step`). Where a
    step's CPU goes, per rank: timed by the thread's CPU clock, as with many ranks per core a
    wall clock charges a call for the time its rank waited to run again (a send that woke a
    peer took 130 us)."""

    def __init__(self, rank: int) -> None:
        self.where = os.environ.get("AIOREDUCE_BENCH_PROFILE") or None
        self.rank = rank
        self.profilers: dict[str, cProfile.Profile] = {}
        self.on: cProfile.Profile | None = None

    def start(self, scheme: str, timed: bool) -> None:
        if self.where is not None and timed:
            profiler = self.profilers.get(scheme)
            if profiler is None:
                profiler = self.profilers[scheme] = cProfile.Profile(time.thread_time)
            profiler.enable()
            self.on = profiler

    def stop(self) -> None:
        if self.on is not None:
            self.on.disable()
            self.on = None

    def dump(self) -> None:
        if self.where is None:
            return
        for scheme, profiler in self.profilers.items():
            path = profile_path(self.where, scheme, self.rank)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            profiler.dump_stats(path)


def profile_path(where: str, scheme: str, rank: int) -> str:
    """Where rank ``rank`` writes its profile of ``scheme`` (see :class:`_Profile`)."""
    return os.path.join(where, scheme, f"rank{rank}.prof")


def calls_per_step(where: str, scheme: str, nodes: int, iters: int) -> list[float] | None:
    """Each rank's function calls per timed step of ``scheme`` in its profile (cProfile's
    count: builtins included, and a coroutine's every resumption counts as a call): a
    measure of a step's Python work that, unlike its CPU time, does not move with the
    machine's load (two runs agree within about 1 %). None if a profile is missing."""
    counts = []
    for rank in range(nodes):
        path = profile_path(where, scheme, rank)
        if not os.path.exists(path):
            return None
        stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
        counts.append(sum(entry[1] for entry in stats.values()) / max(1, iters))
    return counts


def cpu_seconds() -> float:
    """User and system CPU of this rank's process so far, every thread (its lanes' too)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _refill(buffers: dict[str, np.ndarray], name: str, vec: np.ndarray) -> np.ndarray:
    """``name``'s buffer, the same memory every step, holding ``vec`` again: as a trainer's
    gradients are (a fresh copy each step took fresh pages, and the kernel's zeroing of them,
    for some schemes and not others, by how the allocator reused memory). A scheme must let
    the caller change its array once a step is over: this holds it to that."""
    buf = buffers.get(name)
    if buf is None:
        buf = buffers[name] = vec.copy()
    else:
        np.copyto(buf, vec)
    return buf


def _in_place(cfg: Config, scheme: Scheme | None) -> bool:
    """Whether ``--in-place`` applies to ``scheme``: ours and uncoded (not Gloo, not coded)."""
    return cfg.in_place and scheme is not None and not scheme.coded


def makespans(straggle: str, t: np.ndarray, first_iter: int = 0) -> np.ndarray:
    """Per iteration, seconds from the common start until the last rank that is not an
    injected straggler at that iteration (a rank a rule names, or the one a pause rule
    picked) was done; ``t[rank, i]`` (iteration ``first_iter + i``) starts with (start, end).
    The draws are the run's (``AIOREDUCE_STRAGGLE_SEED``, as its ranks read it)."""
    model = parse_seeded(straggle)
    ranks = t.shape[0]
    spans = np.empty(t.shape[1])
    for i in range(t.shape[1]):
        slow = model.stragglers(first_iter + i, ranks)
        fast = [r for r in range(ranks) if r not in slow] or list(range(ranks))
        spans[i] = t[fast, i, 1].max() - t[:, i, 0].min()
    return spans


def late_on_purpose(straggle: str, ranks: int, iters: int, first_iter: int = 0) -> np.ndarray:
    """``late[rank, i]``: whether ``rank``'s own step at iteration ``first_iter + i`` was late
    by design (named, paused or spiked: :meth:`StraggleModel.late_on_purpose`), with the
    run's draws."""
    model = parse_seeded(straggle)
    return np.array([[model.late_on_purpose(r, first_iter + i, ranks) for i in range(iters)]
                     for r in range(ranks)], dtype=bool).reshape(ranks, iters)


def _report(cfg: Config, name: str, scheme: Scheme | None, t: np.ndarray, err: float,
            world: int) -> None:
    """t: (ranks, iters, 6) start, end, received, refused, sends acknowledged, CPU seconds.
    Print one RESULT line."""
    spans = makespans(cfg.straggle, t, warmup_iterations(cfg))
    # How long the step's messages kept the links busy after its makespan ended.
    tail = np.maximum(0.0, t[:, :, 4].max(axis=0) - t[:, :, 0].min(axis=0) - spans)
    out: dict[str, Any] = {"scheme": name, "nodes": world, "size_bytes": cfg.size_bytes,
                           "iters": cfg.iters, "median_s": float(np.median(spans)),
                           "p99_s": float(np.quantile(spans, 0.99)),
                           "steps_s": [round(float(x), 6) for x in spans],
                           "in_place": _in_place(cfg, scheme)}
    by_rank = t[:, :, 1] - t[:, :, 0].min(axis=0)  # each rank's own completion, per step
    own = by_rank.ravel()
    received = t[:, :, 2]
    # Over one rank's steps only: a rank that is late by the same amount every step (one
    # whose link carries another flow) makes the pooled ratio high and its own flat.
    own_tail = np.quantile(by_rank, 0.99, axis=1) / np.maximum(np.median(by_rank, axis=1), 1e-9)
    # The ranks that were on time, each step: how long they waited for the late ones (a
    # spiked rank's own step is late whatever the collective does; at a spike in 100 rank-steps
    # or more the pooled p99 is theirs).
    on_time = by_rank[~late_on_purpose(cfg.straggle, t.shape[0], t.shape[1],
                                       warmup_iterations(cfg))]
    if on_time.size:
        out.update({"on_time_p50_s": float(np.median(on_time)),
                    "on_time_p99_s": float(np.quantile(on_time, 0.99))})
    out.update({"rank_p50_s": float(np.median(own)), "rank_p99_s": float(np.quantile(own, 0.99)),
                "own_tail_max": float(own_tail.max()),
                # Which ranks those are: each rank's own median completion.
                "rank_p50_per_rank_s": [round(float(x), 6) for x in np.median(by_rank, axis=1)],
                "lost": float(1.0 - received.mean()), "raised": int(t[:, :, 3].sum()),
                "tail_s": float(np.median(tail))})
    # CPU per rank per step (getrusage over each timed step): the mean rank's and the
    # busiest rank's (a tree's root, a star's master).
    cpu = t[:, :, 5].mean(axis=1)
    out.update({"cpu_s": float(cpu.mean()), "cpu_max_s": float(cpu.max()),
                "cpu_per_rank_s": [round(float(c), 7) for c in cpu]})
    # Where a step's time goes besides the links: how long after the first rank the last one
    # left the barrier and started (on a host with fewer cores than ranks, the time the first
    # ones' work takes the cores from the others), and, where the ranks share this machine's
    # cores, the least a step can take on them (every rank's CPU over the cores).
    starts = t[:, :, 0]
    skew = starts.max(axis=0) - starts.min(axis=0)
    out["start_skew_s"] = float(np.median(skew))
    # The tail of that skew, and each rank's time from its own start (pooled): where the
    # pooled completion's P99 is a late start (a barrier message stuck in a queue that other
    # traffic fills) rather than a long step.
    spans_own = (t[:, :, 1] - starts).ravel()
    out.update({"start_skew_p99_s": float(np.quantile(skew, 0.99)),
                "own_span_p50_s": float(np.median(spans_own)),
                "own_span_p99_s": float(np.quantile(spans_own, 0.99))})
    if cfg.shared_cores:
        out["cpu_floor_s"] = float(cpu.sum()) / min(float(world), cfg.shared_cores)
    if cfg.verify:
        out["max_rel_err"] = err
    # The scheme's own bound on these links (see bound.py): the link rate shaped, else the
    # cost model's bandwidth; the emulated latency, else none.
    rate = cfg.link_mbit * 1e6 / 8 if cfg.link_mbit else cfg.model_bandwidth
    base = variant(name)[0]  # tree+lanes: the tree's bound and model
    limit = bound(base, scheme, world, float(cfg.size_bytes), rate=rate, latency=cfg.latency)
    if limit is not None:
        out.update({"bound_s": limit.seconds, "of_bound": limit.seconds / out["median_s"],
                    "bound_rate_bytes_s": rate})
    out["model_s"] = _predict(cfg, base, scheme, world)
    print("RESULT " + json.dumps(out), flush=True)


def _chunks(cfg: Config) -> int:
    """Chunks of a tree's message in this run, as the runtime cuts them."""
    chunk, most = chunking(cfg)
    return math.ceil(cfg.size_bytes / chunk_step(cfg.size_bytes, 1, chunk, most))


def _predict(cfg: Config, name: str, scheme: Scheme | None, world: int) -> float | None:
    """The cost model's median for this configuration (None where it has no model)."""
    link = LinkModel(cfg.model_alpha, cfg.model_bandwidth)
    comp = ComputeModel(cfg.compute, rate=1e9)  # emulated compute is deterministic
    slow: dict[int, float] = {}
    for rule in parse_straggle(cfg.straggle).rules:
        for r in rule.ranks or range(world):
            slow[r] = slow.get(r, 1.0) * rule.slow
    vb = float(cfg.size_bytes)
    if isinstance(scheme, CodedTree):
        return predict_tree(cfg.fanout, cfg.levels, cfg.stragglers, vector_bytes=vb, link=link,
                            compute=comp, slow=slow, chunks=_chunks(cfg)).median
    if isinstance(scheme, GradientCoding):
        return predict_star(world - 1, scheme.code.s, vector_bytes=vb, link=link, compute=comp,
                            m=scheme.code.m, slow=slow).median
    if name in ("ring", "gloo"):
        return predict_ring(world, vector_bytes=vb, link=link, compute=comp, slow=slow).median
    return None


@dataclass(frozen=True)
class Hosts:
    """Real hosts to run the ranks on: a hostfile for aioreduce-launch, which starts them over
    SSH, and more options for it (an identity file, known hosts)."""

    hostfile: str
    launch_args: tuple[str, ...] = ()


def run_allreduce(cfg: Config, timeout: float = 3600.0, *, hosts: Hosts | None = None
                  ) -> list[dict[str, Any]]:
    """Run ``cfg.nodes`` ranks (on ``hosts`` over SSH, else locally with aioreduce-launch, or
    one per emulated host with ``cfg.netns``); return rank 0's result objects."""
    if hosts is None:  # every rank on this machine's cores (a CPU quota per host caps them)
        cores = float(len(os.sched_getaffinity(0)))
        if cfg.netns and cfg.cpus_per_host:
            cores = min(cores, cfg.nodes * cfg.cpus_per_host)
        cfg = replace(cfg, shared_cores=cores)
    # -P: the ranks import aioreduce from PYTHONPATH or site-packages as this command did, not
    # from the current directory (-m puts it first): an A/B with PYTHONPATH on a worktree,
    # started in a checkout, ran the checkout's code in every rank.
    worker = [sys.executable, "-P", "-m", "aioreduce.bench.allreduce", "--worker",
              json.dumps(asdict(cfg))]
    env = dict(os.environ)
    if cfg.straggle:
        env["AIOREDUCE_STRAGGLE"] = cfg.straggle
    if cfg.latency > 0:
        env["AIOREDUCE_LATENCY"] = repr(cfg.latency)
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 cores shared by many ranks: no thread storms
    if cfg.netns and hosts is None:
        if cfg.nodes > (os.cpu_count() or 1):
            # Emulated hosts share this machine's cores: a rank that polled before blocking
            # (its own host looks like a core per rank) would take a waiting rank's core.
            env.setdefault("AIOREDUCE_LANE_SPIN", "0")
        out = run_on_cluster(cfg.nodes, cfg.link_mbit, cfg.background, worker, env, timeout,
                             cpus_per_host=cfg.cpus_per_host,
                             bursts=Bursts(*cfg.background_burst) if cfg.background_burst
                             else None)
        tag = "RESULT "
    else:  # the launcher: cfg.nodes ranks on this machine, or on the hostfile's slots
        where = [] if hosts is None else [hosts.hostfile, *hosts.launch_args]
        cmd = [sys.executable, "-m", "aioreduce_launch.cli", *where, "-n", str(cfg.nodes),
               "--", *worker]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout, env=env)
        if proc.returncode:
            on = "" if hosts is None else f" on {hosts.hostfile}"
            raise RuntimeError(f"benchmark ranks{on} failed (exit code {proc.returncode})")
        out, tag = proc.stdout, "[0] RESULT "
    return [json.loads(line[len(tag):]) for line in out.splitlines() if line.startswith(tag)]


def run_on_cluster(nodes: int, link_mbit: float | None, background: int, worker: list[str],
                   env: dict[str, str], timeout: float, *,
                   cpus_per_host: float | None = None, bursts: Bursts | None = None) -> str:
    """``worker`` as ``nodes`` ranks, every one in its own network namespace (an emulated
    host), links shaped to ``link_mbit``, ``background`` bulk flows between the hosts (steady,
    or in ``bursts``), each host held to ``cpus_per_host`` CPUs if given; returns rank 0's
    stdout.

    The first rank to fail ends the run: the others are killed and the error names it (a
    rank that died leaves the rest waiting for it, so waiting for rank 0 would hang)."""
    from ..jobplan import HostSlots, JobConfig, plan_ranks
    from .cluster import Cluster

    with Cluster(nodes, rate_mbit=link_mbit, cpus_per_host=cpus_per_host) as cluster:
        cluster.background(background, bursts=bursts)
        job = JobConfig(master_addr=cluster.addr(0), master_port=29500, rendezvous_port=29501)
        hosts = [HostSlots(cluster.ns(i), 1, addr=cluster.addr(i)) for i in range(nodes)]
        # Gloo picks its address from the hostname, which resolves to 127.0.0.1 inside a
        # namespace (then every rank dials itself: "connectFullMesh failed"); name the
        # emulated host's interface instead.
        env = {**env, "GLOO_SOCKET_IFNAME": "eth0"}
        procs: list[subprocess.Popen[str]] = []
        exits: queue.Queue[int] = queue.Queue()
        try:
            for i, spec in enumerate(plan_ranks(hosts, job)):
                procs.append(subprocess.Popen(
                    cluster.rank_argv(i, worker), env={**env, **spec.env,
                                                       "AIOREDUCE_BIND": cluster.addr(i)},
                    stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
                    start_new_session=True, text=True))
            out: list[str] = []
            stdout = procs[0].stdout
            assert stdout is not None
            reader = threading.Thread(target=lambda: out.append(stdout.read()), daemon=True)
            reader.start()
            for i, p in enumerate(procs):
                threading.Thread(target=_wait_then_put, args=(p, i, exits), daemon=True).start()
            deadline = time.monotonic() + timeout
            for _ in procs:
                i = exits.get(timeout=max(0.0, deadline - time.monotonic()))
                if procs[i].returncode:
                    raise RuntimeError(f"benchmark rank {i} failed (exit code "
                                       f"{procs[i].returncode}); the other ranks were stopped")
            reader.join(timeout=60)
            return "".join(out)
        except queue.Empty:
            raise RuntimeError(f"benchmark ranks still running after {timeout:.0f} s; "
                               "stopped") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()


def _wait_then_put(proc: subprocess.Popen[str], index: int, exits: queue.Queue[int]) -> None:
    proc.wait()
    exits.put(index)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    run(_worker(Config(**json.loads(sys.argv[2]))))
