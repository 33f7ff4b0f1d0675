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

``--device cuda``: the models and batches live on the GPU (``LOCAL_RANK`` picks it; ranks
share one GPU when there are more ranks than GPUs), and a step ends when the rank's GPU work is
done. Two more rows then measure the staging of GPU tensors: ``allreduce-cpu`` and
``allreduce-cuda`` sum a tensor of the model's size through our process group, alternating, and
``vs_cpu`` is the GPU tensor's median over the CPU tensor's (the cost of the copies through
pinned memory), in the models' dtype. ``--dtype bfloat16`` casts the models
(``model.to(torch.bfloat16)``). ``cpu_ms``: a rank's CPU per training step (every thread of
its process), the median over ranks and steps.

``--fsdp``: instead of the above, a 4-layer transformer under FSDP2 (``fully_shard`` per layer
and at the root, AdamW) over Gloo and over our backend, each on a one-dimensional device mesh
of every rank (ours built with ``new_group(backend="aioreduce")``), alternating step by step.
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
    device: str = "cpu"
    dtype: str = "float32"
    fsdp: bool = False


def _model(hidden: int) -> Any:
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def _device(kind: str) -> Any:
    """This rank's device: the CPU, or a GPU picked by LOCAL_RANK (shared when fewer)."""
    import torch
    if kind == "cpu":
        return torch.device("cpu")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _done(dev: Any) -> float:
    """The time a step ends: once this rank's GPU work is done."""
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.monotonic()


def _spans_row(name: str, straggle: str, every: np.ndarray, warmup: int,
               **extra: Any) -> dict[str, Any]:
    from .allreduce import makespans
    spans = makespans(straggle, every, warmup)
    return {"scheme": name, "straggle": straggle or "none", "nodes": every.shape[0],
            "median_s": float(np.median(spans)), "p99_s": float(np.quantile(spans, 0.99)),
            "steps_s": [round(float(s), 5) for s in spans], **extra}


def _staging_rows(pg: Any, node: Any, numel: int, dev: Any, iters: int, dtype: Any
                  ) -> list[dict[str, Any]]:
    """allreduce of ``numel`` elements of ``dtype``, a CPU tensor against a GPU tensor,
    through ``pg`` (ours) and through Gloo (the default group), alternating (each after a
    barrier): what staging through pinned memory costs us, beside what it costs Gloo in the
    same run; and, in bfloat16, our float32 sums of 16-bit parts beside Gloo's."""
    import torch
    import torch.distributed as dist
    # Zeros: summed in place again and again, ones would overflow to inf (same time, but
    # numpy warns on every rank).
    tensors = {"allreduce-cpu": torch.zeros(numel, dtype=dtype),
               "allreduce-cuda": torch.zeros(numel, dtype=dtype, device=dev)}
    calls = {f"{who}{name}": (who, t) for name, t in tensors.items() for who in ("", "gloo-")}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in calls}
    for it in range(iters + 2):
        for name in (list(calls) if it % 2 == 0 else list(calls)[::-1]):
            who, t = calls[name]
            node.barrier(timeout=300)
            t0 = time.monotonic()
            if who:
                dist.all_reduce(t)
            else:
                pg.allreduce([t], dist.AllreduceOptions()).wait()
            if it >= 2:
                times[name].append((t0, _done(dev)))
    rows = {}
    for name, spans in times.items():
        every = node.allgather(np.array(spans, np.float64)).value
        rows[name] = _spans_row(name, "", every, 2, size_bytes=numel * dtype.itemsize,
                                dtype=str(dtype).removeprefix("torch."))
    for who in ("", "gloo-"):
        gpu, cpu = rows[f"{who}allreduce-cuda"], rows[f"{who}allreduce-cpu"]
        gpu["vs_cpu"] = gpu["median_s"] / cpu["median_s"]
    return list(rows.values())


def _worker(cfg: DdpConfig) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import aioreduce as ar
    import aioreduce.torch as art
    from aioreduce.straggle import parse_straggle

    from .allreduce import cpu_seconds

    torch.set_num_threads(1)
    dev = _device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    model_of_straggle = parse_straggle(cfg.straggle)
    node = ar.connect(scheme=ar.Ring(), straggle=ar.StraggleModel())  # injected here instead
    rank, world = node.rank, node.world_size
    ring, tree = ar.Ring(), ar.CodedTree(cfg.fanout, cfg.levels, cfg.stragglers)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(5)
    data = torch.randn(4096, 256, generator=gen).to(dev, dtype)
    labels = torch.randint(0, 10, (4096,), generator=gen).to(dev)

    def new_model() -> Any:
        return _model(cfg.hidden).to(dev, dtype)

    ids = [dev] if dev.type == "cuda" else None
    models: dict[str, Any] = {}
    if "gloo" in cfg.schemes:
        models["gloo"] = DistributedDataParallel(new_model(), device_ids=ids)
    pg = art.ProcessGroupAioreduce(node)
    if "ring" in cfg.schemes:
        models["ring"] = art.DistributedDataParallel(new_model(), pg, device_ids=ids)
    if "coded-tree" in cfg.schemes:
        models["coded-tree"] = new_model()
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    sampler = art.CodedSampler(len(labels), cfg.batch, scheme=tree, rank=rank, seed=1)
    coded_batches: Iterator[tuple[np.ndarray, torch.Tensor]] = iter(sampler)
    current = "ring"
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in models}
    cpu: dict[str, list[float]] = {k: [] for k in models}  # this process's CPU per step
    per_rank = cfg.batch // world
    for it in range(cfg.warmup + cfg.iters):
        names = list(models) if it % 2 == 0 else list(models)[::-1]
        start = (it * cfg.batch) % (len(labels) - cfg.batch)
        for name in names:
            if name != "gloo" and current != name:  # the node's session for this scheme
                node.use(tree if name == "coded-tree" else ring, keep=True)
                current = name
            node.barrier(timeout=300)
            t0, cpu0 = time.monotonic(), cpu_seconds()
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
                out = model(data[torch.from_numpy(idx).to(dev)])
                extra = model_of_straggle.extra_delay(rank, it, time.monotonic() - c0, world)
                time.sleep(extra)
                loss = art.weighted_loss(F.cross_entropy, out.float(),
                                         labels[torch.from_numpy(idx).to(dev)], w.to(dev))
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
                F.cross_entropy(out.float(), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
            end = _done(dev)
            if it >= cfg.warmup:
                times[name].append((t0, end))
                cpu[name].append(cpu_seconds() - cpu0)
    rows = []
    for name, m in models.items():
        every = node.allgather(np.array(times[name], np.float64)).value  # (ranks, iters, 2)
        cpus = node.allgather(np.array(cpu[name], np.float64)).value  # (ranks, iters)
        rows.append(_spans_row(name, cfg.straggle, every, cfg.warmup,
                               parameters=sum(p.numel() for p in m.parameters()),
                               global_batch=cfg.batch, iters=cfg.iters, device=cfg.device,
                               dtype=cfg.dtype, cpu_ms=1e3 * float(np.median(cpus))))
    if dev.type == "cuda" and not cfg.straggle:
        node.use(ring)
        numel = sum(p.numel() for p in next(iter(models.values())).parameters())
        rows += _staging_rows(pg, node, numel, dev, cfg.iters, dtype)
    if rank == 0:
        for row in rows:
            print("RESULT " + json.dumps(row), flush=True)
    pg.shutdown()
    dist.destroy_process_group()
    node.close()


def _transformer(dev: Any) -> Any:
    import torch
    torch.manual_seed(0)
    layers = [torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
              for _ in range(4)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 10)).to(dev)


def _fsdp_worker(cfg: DdpConfig) -> None:
    """FSDP2 over Gloo and over our backend, alternating step by step (see the module doc)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import aioreduce.torch  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dev = _device(cfg.device)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": dist.group.WORLD, "aioreduce": dist.new_group(backend="aioreduce")}
    half = cfg.dtype == "bfloat16"
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
          if half else MixedPrecisionPolicy())
    models: dict[str, Any] = {}
    for name, group in groups.items():
        mesh = DeviceMesh.from_group(group, dev.type)
        m = _transformer(dev)
        for layer in list(m)[:-1]:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        models[name] = fully_shard(m, mesh=mesh, mp_policy=mp)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    gen = torch.Generator().manual_seed(5 + rank)
    per_rank = max(1, cfg.batch // world)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in models}
    for it in range(cfg.warmup + cfg.iters):
        x = torch.randn(per_rank, 16, 256, generator=gen).to(dev)
        y = torch.randint(0, 10, (per_rank, 16), generator=gen).to(dev)
        for name in (list(models) if it % 2 == 0 else list(models)[::-1]):
            dist.barrier()
            t0 = time.monotonic()
            opts[name].zero_grad()
            out = models[name](x)
            F.cross_entropy(out.float().reshape(-1, 10), y.reshape(-1)).backward()  # type: ignore[no-untyped-call]
            opts[name].step()
            end = _done(dev)
            if it >= cfg.warmup:
                times[name].append((t0, end))
    for name in models:
        every = [np.zeros(0)] * world
        dist.all_gather_object(every, np.array(times[name], np.float64))
        if rank == 0:
            params = sum(p.numel() for p in _transformer("cpu").parameters())
            row = _spans_row(name, "", np.stack(every), cfg.warmup, parameters=params,
                             global_batch=per_rank * world, iters=cfg.iters,
                             device=cfg.device, dtype=cfg.dtype, fsdp=True)
            print("RESULT " + json.dumps(row), flush=True)
    dist.destroy_process_group()


def run_ddp(cfg: DdpConfig, settings: list[str], timeout: float = 3600.0
            ) -> list[dict[str, Any]]:
    """One launch of ``cfg.nodes`` local ranks per straggler setting; rank 0's results."""
    rows: list[dict[str, Any]] = []
    for setting in settings:
        one = DdpConfig(**{**asdict(cfg), "straggle": "" if setting == "none" else setting})
        worker = [sys.executable, "-P", "-m", "aioreduce.bench.ddp", "--worker",
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
        if "parameters" not in r:  # the staging rows compare with each other only
            continue
        if r["straggle"] in gloo:
            r["vs_gloo"] = r["median_s"] / gloo[r["straggle"]]
        if r["scheme"] in base:
            r["vs_no_straggler"] = r["median_s"] / base[r["scheme"]]
    return rows


def print_ddp(rows: list[dict[str, Any]]) -> None:
    first = rows[0]
    what = "a transformer under FSDP2" if first.get("fsdp") else "an MLP"
    print(f"{first['nodes']} ranks, {what} of {first['parameters'] / 1e6:.1f}M parameters "
          f"({first['dtype']}, on {first['device']}), global batch {first['global_batch']}, "
          f"{first['iters']} steps per scheme (makespan of a training step: median, p99)")
    print(f"{'straggler':>22} {'scheme':>19} {'median ms':>10} {'p99 ms':>9} {'vs gloo':>8} "
          f"{'vs none':>8} {'CPU ms':>7}")
    for r in rows:
        vs_g = f"{r['vs_gloo']:8.2f}" if "vs_gloo" in r else f"{'-':>8}"
        vs_n = f"{r['vs_no_straggler']:8.2f}" if "vs_no_straggler" in r else f"{'-':>8}"
        cpu = f"{r['cpu_ms']:7.1f}" if "cpu_ms" in r else f"{'-':>7}"
        print(f"{r['straggle']:>22} {r['scheme']:>19} {r['median_s'] * 1e3:10.1f} "
              f"{r['p99_s'] * 1e3:9.1f} {vs_g} {vs_n} {cpu}")
        if "vs_cpu" in r:
            who = "Gloo" if r["scheme"].startswith("gloo-") else "ours"
            print(f"{'':>22} staging a GPU tensor of {r['size_bytes'] / 2**20:.1f} MiB ({who}): "
                  f"{r['vs_cpu']:.2f}x the same sum of a CPU tensor")


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    raw = json.loads(sys.argv[2])
    raw["schemes"] = tuple(raw["schemes"])
    config = DdpConfig(**raw)
    (_fsdp_worker if config.fsdp else _worker)(config)
