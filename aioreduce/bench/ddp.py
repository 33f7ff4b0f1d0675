"""``aioreduce-bench ddp``: one torch model trained by Gloo DDP, aioreduce's ring (stock DDP
with our communication hook) and coded-tree (coded mini-batches), side by side in one run.

The same ranks train three replicas of one MLP, one per scheme, alternating step by step
(ABBA order, so they share the machine's noise), each step starting from a barrier. A step is
forward, backward, the gradient sum and the optimizer's update; its time is the makespan from
the common start until the last rank that is not an injected straggler has updated. Gloo and
the ring split every global batch evenly (1/N each); coded-tree computes each rank's weighted
share of the same global batch (``CodedSampler``) and decodes from the first sufficient set.

Stragglers are injected per step, the same for every scheme: ``delay=D`` sleeps D seconds
before the backward pass; ``slow=K`` sleeps (K-1) times the rank's measured compute. Each
straggler setting (``--straggle``, several separated by ``|``; ``none`` for none) is its own
launch of the ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

SCHEMES = ("gloo", "ring", "coded-tree")


@dataclass
class DdpConfig:
    nodes: int = 13
    fanout: int = 3
    levels: int = 2
    stragglers: int = 1
    hidden: int = 1024  # three hidden layers: ~2.2M parameters at 1024
    batch: int = 416  # global mini-batch (32 per rank on 13)
    iters: int = 20
    warmup: int = 3
    straggle: str = ""
    schemes: tuple[str, ...] = SCHEMES


def _model(hidden: int) -> Any:
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def _worker(cfg: DdpConfig) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import aioreduce as ar
    import aioreduce.torch as art
    from aioreduce.straggle import parse_straggle

    from .allreduce import makespans

    torch.set_num_threads(1)
    model_of_straggle = parse_straggle(cfg.straggle)
    node = ar.connect(scheme=ar.Ring(), straggle=ar.StraggleModel())  # injected here instead
    rank, world = node.rank, node.world_size
    ring, tree = ar.Ring(), ar.CodedTree(cfg.fanout, cfg.levels, cfg.stragglers)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(5)
    data = torch.randn(4096, 256, generator=gen)
    labels = torch.randint(0, 10, (4096,), generator=gen)
    models: dict[str, Any] = {}
    if "gloo" in cfg.schemes:
        models["gloo"] = DistributedDataParallel(_model(cfg.hidden))
    pg = art.ProcessGroupAioreduce(node)
    if "ring" in cfg.schemes:
        models["ring"] = art.DistributedDataParallel(_model(cfg.hidden), pg)
    if "coded-tree" in cfg.schemes:
        models["coded-tree"] = _model(cfg.hidden)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    sampler = art.CodedSampler(len(labels), cfg.batch, scheme=tree, rank=rank, seed=1)
    coded_batches: Iterator[tuple[np.ndarray, torch.Tensor]] = iter(sampler)
    current = "ring"
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in models}
    per_rank = cfg.batch // world
    for it in range(cfg.warmup + cfg.iters):
        names = list(models) if it % 2 == 0 else list(models)[::-1]
        start = (it * cfg.batch) % (len(labels) - cfg.batch)
        for name in names:
            if name != "gloo" and current != name:  # the node's session for this scheme
                node.use(tree if name == "coded-tree" else ring, keep=True)
                current = name
            node.barrier(timeout=300)
            t0 = time.monotonic()
            opt, model = opts[name], models[name]
            opt.zero_grad()
            if name == "coded-tree":
                try:
                    idx, w = next(coded_batches)
                except StopIteration:
                    sampler.set_epoch(it)
                    coded_batches = iter(sampler)
                    idx, w = next(coded_batches)
                c0 = time.monotonic()
                out = model(data[idx])
                extra = model_of_straggle.extra_delay(rank, it, time.monotonic() - c0, world)
                time.sleep(extra)
                loss = art.weighted_loss(F.cross_entropy, out, labels[idx], w)
                loss.backward()  # type: ignore[no-untyped-call]
                res = node.aggregate(art.flat_grad(model))
                art.apply_flat(model, res.value)
            else:
                lo = start + rank * per_rank
                x, y = data[lo:lo + per_rank], labels[lo:lo + per_rank]
                c0 = time.monotonic()
                out = model(x)
                time.sleep(model_of_straggle.extra_delay(rank, it, time.monotonic() - c0,
                                                        world))
                F.cross_entropy(out, y).backward()  # type: ignore[no-untyped-call]
            opt.step()
            if it >= cfg.warmup:
                times[name].append((t0, time.monotonic()))
    for name, model in models.items():
        every = node.allgather(np.array(times[name], np.float64)).value  # (ranks, iters, 2)
        if rank == 0:
            spans = makespans(cfg.straggle, every, cfg.warmup)
            print("RESULT " + json.dumps({
                "scheme": name, "straggle": cfg.straggle or "none", "nodes": world,
                "parameters": sum(p.numel() for p in model.parameters()),
                "global_batch": cfg.batch, "iters": cfg.iters,
                "median_s": float(np.median(spans)), "p99_s": float(np.quantile(spans, 0.99)),
                "steps_s": [round(float(s), 5) for s in spans]}), flush=True)
    pg.shutdown()
    dist.destroy_process_group()
    node.close()


def run_ddp(cfg: DdpConfig, settings: list[str], timeout: float = 3600.0
            ) -> list[dict[str, Any]]:
    """One launch of ``cfg.nodes`` local ranks per straggler setting; rank 0's results."""
    rows: list[dict[str, Any]] = []
    for setting in settings:
        one = DdpConfig(**{**asdict(cfg), "straggle": "" if setting == "none" else setting})
        worker = [sys.executable, "-m", "aioreduce.bench.ddp", "--worker",
                  json.dumps(asdict(one))]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "aioreduce_launch.cli", "-n", str(cfg.nodes), "--",
               *worker]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout, env=env)
        if proc.returncode:
            raise RuntimeError(f"benchmark ranks failed (exit code {proc.returncode})")
        rows += [json.loads(line[len("[0] RESULT "):]) for line in proc.stdout.splitlines()
                 if line.startswith("[0] RESULT ")]
    base = {r["scheme"]: r["median_s"] for r in rows if r["straggle"] == "none"}
    gloo = {r["straggle"]: r["median_s"] for r in rows if r["scheme"] == "gloo"}
    for r in rows:
        if r["straggle"] in gloo:
            r["vs_gloo"] = r["median_s"] / gloo[r["straggle"]]
        if r["scheme"] in base:
            r["vs_no_straggler"] = r["median_s"] / base[r["scheme"]]
    return rows


def print_ddp(rows: list[dict[str, Any]]) -> None:
    first = rows[0]
    print(f"{first['nodes']} ranks, an MLP of {first['parameters'] / 1e6:.1f}M parameters, "
          f"global batch {first['global_batch']}, {first['iters']} steps per scheme "
          "(makespan of a training step: median, p99)")
    print(f"{'straggler':>22} {'scheme':>11} {'median ms':>10} {'p99 ms':>9} {'vs gloo':>8} "
          f"{'vs none':>8}")
    for r in rows:
        vs_g = f"{r['vs_gloo']:8.2f}" if "vs_gloo" in r else f"{'-':>8}"
        vs_n = f"{r['vs_no_straggler']:8.2f}" if "vs_no_straggler" in r else f"{'-':>8}"
        print(f"{r['straggle']:>22} {r['scheme']:>11} {r['median_s'] * 1e3:10.1f} "
              f"{r['p99_s'] * 1e3:9.1f} {vs_g} {vs_n}")


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    raw = json.loads(sys.argv[2])
    raw["schemes"] = tuple(raw["schemes"])
    _worker(DdpConfig(**raw))
