"""One rank of a generic torch.distributed program that makes every call trainers make.

    torchcalls.py BACKEND DTYPE[,DTYPE] OUT [--device cpu|cuda]

Runs under ``init_process_group(BACKEND)`` (``gloo`` or ``aioreduce``) with tensors of DTYPE
(``float32`` or ``bfloat16``), and saves every call's result on this rank to
``OUT/BACKEND.DTYPE.RANK.npz`` (each as float64), so a test can compare the backends value
for value; several dtypes run one after the other in one process group. The values are small
integers, exact in bfloat16 whatever the order of the sums.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import aioreduce.torch  # noqa: F401  (registers "aioreduce")

got: dict[str, np.ndarray] = {}


def keep(name: str, value: object) -> None:
    if os.environ.get("CALLS_TRACE"):
        print("DONE", name, flush=True)
    if isinstance(value, torch.Tensor):
        got[name] = value.detach().to("cpu", torch.float64).numpy().copy()
    elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        got[name] = np.stack([v.detach().to("cpu", torch.float64).numpy().reshape(-1)
                              for v in value])
    else:
        got[name] = np.asarray(value, dtype=np.float64)


def main() -> None:
    backend, dtype_names, out = sys.argv[1:4]
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    for dtype_name in dtype_names.split(","):  # one after the other, in one process group
        got.clear()
        calls(backend, dtype_name, out, device)
    dist.destroy_process_group()


def calls(backend: str, dtype_name: str, out: str, device: str) -> None:
    """Every call with tensors of ``dtype_name``; saves their results."""
    dtype = getattr(torch, dtype_name)
    r, n = dist.get_rank(), dist.get_world_size()

    def t(values: object) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    for op in ("SUM", "AVG", "MIN", "MAX", "PRODUCT"):
        x = t([float(r + 1), float(2 * r), 4.0 * (r % 2), -float(r)])
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
        keep(f"all_reduce_{op}", x)
    strided = torch.zeros(3, 2, dtype=dtype, device=device)[:, 0]  # not contiguous
    strided += r + 1
    dist.all_reduce(strided)
    keep("all_reduce_strided", strided)
    ints = torch.tensor([r, 1, -r], dtype=torch.int64, device=device)
    dist.all_reduce(ints)
    keep("all_reduce_int64", ints)
    works = [dist.all_reduce(t([float(r + i)] * (100 * (i + 1))), async_op=True)
             for i in range(3)]
    for i, w in enumerate(works):
        w.wait()
        keep(f"all_reduce_async{i}", w.result()[0])
    b = t([float(r), float(r + 10)])
    dist.broadcast(b, src=n - 1)
    keep("broadcast", b)
    outs = [t([0.0, 0.0]) for _ in range(n)]
    dist.all_gather(outs, t([float(r), float(-r)]))
    keep("all_gather", outs)
    flat = t([0.0] * (2 * n))
    dist.all_gather_into_tensor(flat, t([float(r), float(r + 1)]))
    keep("all_gather_into_tensor", flat)
    rs = t([0.0, 0.0])
    dist.reduce_scatter(rs, [t([float(i + r), float(i)]) for i in range(n)])
    keep("reduce_scatter", rs)
    rs = t([0.0, 0.0])
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * n, device=device).to(dtype) + r)
    keep("reduce_scatter_tensor", rs)
    rs = t([0.0, 0.0])
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * n, device=device).to(dtype) + 2 * r,
                               op=dist.ReduceOp.AVG)
    keep("reduce_scatter_tensor_avg", rs)
    red = t([float(r + 1), 2.0])
    dist.reduce(red, dst=1)
    keep("reduce", red)
    gathered = [t([0.0, 0.0]) for _ in range(n)] if r == 2 else None
    dist.gather(t([float(r), float(r * r)]), gathered, dst=2)
    keep("gather", gathered if gathered is not None else [])
    sc = t([0.0, 0.0, 0.0])
    dist.scatter(sc, [t([float(i), float(i + 1), 7.0]) for i in range(n)] if r == 1 else None,
                 src=1)
    keep("scatter", sc)
    # point to point: a ring with send/recv (even ranks send first), then isend/irecv
    right, left = (r + 1) % n, (r - 1) % n
    inbox = t([0.0, 0.0])
    if r % 2 == 0:
        dist.send(t([float(r), 1.0]), dst=right)
        dist.recv(inbox, src=left)
    else:
        dist.recv(inbox, src=left)
        dist.send(t([float(r), 1.0]), dst=right)
    keep("send_recv", inbox)
    first, second = t([0.0]), t([0.0])
    reqs = [dist.isend(t([float(r + 100)]), dst=right, tag=5),
            dist.isend(t([float(r + 200)]), dst=right, tag=5),
            dist.irecv(second, src=left, tag=6),
            dist.isend(t([float(r + 300)]), dst=right, tag=6),
            dist.irecv(first, src=left, tag=5)]
    reqs[2].wait()
    reqs[4].wait()
    keep("isend_irecv_tags", torch.cat([first, second]))
    again = t([0.0])
    dist.recv(again, src=left, tag=5)  # the second message with tag 5, in order
    keep("recv_in_order", again)
    for i in (0, 1, 3):  # a send may complete only once its receive is posted (Gloo's do)
        reqs[i].wait()
    a, c = t([0.0, 0.0]), t([0.0, 0.0])
    ops = [dist.P2POp(dist.isend, t([float(r), 2.0]), right),
           dist.P2POp(dist.irecv, a, left),
           dist.P2POp(dist.isend, t([float(r), 3.0]), left),
           dist.P2POp(dist.irecv, c, right)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    keep("batch_isend_irecv", torch.cat([a, c]))
    # recv without src: every other rank sends rank 0 one message with tag 9, and a second
    # one once rank 0 has taken the first (in order per sender); rank 0 takes them from
    # whichever rank comes first, and torch returns who sent each.
    if r == 0:
        came = []
        for _ in range(2 * (n - 1)):
            buf = t([0.0, 0.0])
            src = dist.recv(buf, tag=9)
            came.append([float(src), *buf.tolist()])
        came.sort()
        keep("recv_anysource", came)
    else:
        dist.send(t([float(r), 7.0]), dst=0, tag=9)
        dist.send(t([float(r), 8.0]), dst=0, tag=9)
        keep("recv_anysource", [])
    a2a_out = [t([0.0, 0.0]) for j in range(n)]
    try:
        dist.all_to_all(a2a_out, [t([float(10 * r + j), float(r)]) for j in range(n)])
        keep("all_to_all", torch.cat(a2a_out))
    except RuntimeError as exc:  # Gloo of torch 2.11 has no list form
        if "does not support alltoall" not in str(exc):
            raise
    single = t([0.0] * (2 * n))
    dist.all_to_all_single(single, torch.arange(2.0 * n, device=device).to(dtype) + 10 * r)
    keep("all_to_all_single", single)
    # split sizes: rank r sends j + 1 rows of 2 to rank j, receives r + 1 rows from each
    inp = torch.cat([t([[float(10 * r + j), 1.0]] * (j + 1)) for j in range(n)])
    uneven = torch.zeros((r + 1) * n, 2, dtype=dtype, device=device)
    dist.all_to_all_single(uneven, inp, output_split_sizes=[r + 1] * n,
                           input_split_sizes=[j + 1 for j in range(n)])
    keep("all_to_all_single_splits", uneven)
    c1, c2 = t([float(r)] * 3), t([1.0, float(r)])
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(c1)
        dist.all_reduce(c2)
    cm.wait()
    keep("all_reduce_coalesced", torch.cat([c1, c2]))
    g1, g2 = t([0.0] * n), t([0.0] * (2 * n))
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(g1, t([float(r)]))
        dist.all_gather_into_tensor(g2, t([float(r), 5.0]))
    cm.wait()
    keep("all_gather_coalesced", torch.cat([g1, g2]))
    dist.barrier()
    dist.barrier(device_ids=[0])  # what NCCL programs pass; a CPU backend ignores it
    dist.monitored_barrier(timeout=timedelta(seconds=60))
    objs: list[object] = [None] * n
    dist.all_gather_object(objs, {"rank": r, "sq": r * r})
    keep("all_gather_object", [[o["rank"], o["sq"]] for o in objs])  # type: ignore[index]
    blist: list[object] = [r, f"from {r}"] if r == 0 else [None, None]
    dist.broadcast_object_list(blist, src=0)
    keep("broadcast_object_list", [blist[0], len(str(blist[1]))])
    gobj: list[object] | None = [None] * n if r == 0 else None
    dist.gather_object(("g", r), gobj, dst=0)
    keep("gather_object", [o[1] for o in gobj] if gobj else [])  # type: ignore[index]
    sobj: list[object] = [None]
    dist.scatter_object_list(sobj, [i * 3 for i in range(n)] if r == 0 else None, src=0)
    keep("scatter_object_list", sobj)
    # subgroups: evens and odds, each reduces on its own
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = evens if r % 2 == 0 else odds
    x = t([float(r + 1)])
    dist.all_reduce(x, group=mine)
    keep("subgroup_all_reduce", x)
    dist.barrier(group=mine)
    # a 2-D device mesh: rows and columns reduce along their own dimension
    mesh = init_device_mesh(device, (2, n // 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        x = t([float(r + 1), float(r)])
        dist.all_reduce(x, group=mesh.get_group(dim))
        keep(f"mesh_{dim}", x)
    assert mesh.get_group("dp").group_name  # named groups, as DeviceMesh needs
    if device == "cuda":
        # Stream order: the producer's write is queued behind ~50 ms of GPU work; after
        # wait() the caller's stream reads the sum without any synchronize of ours.
        x = torch.zeros(1 << 20, device=device)
        torch.cuda._sleep(100_000_000)
        x.add_(r + 1)
        w = dist.all_reduce(x, async_op=True)
        w.wait()
        keep("stream_order", (x * 1)[:4])
        # Collectives in a coalescing block, read on the caller's stream right after wait():
        # every copy back must be ordered before the read, not only the last one's.
        c1, c2 = torch.zeros(1 << 20, device=device), torch.zeros(1 << 20, device=device)
        torch.cuda._sleep(50_000_000)
        c1.add_(r + 1)
        c2.add_(2 * r)
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_gather_into_tensor(g1 := torch.zeros(n << 20, device=device), c1)
            dist.all_gather_into_tensor(g2 := torch.zeros(n << 20, device=device), c2)
        cm.wait()
        keep("coalesced_stream_order", torch.stack([g1.view(n, -1)[:, -1],
                                                    g2.view(n, -1)[:, -1]]))
        torch.cuda.synchronize()
    np.savez(os.path.join(out, f"{backend}.{dtype_name}.{r}.npz"), **got)
    print(f"CALLS {len(got)} BACKEND {dist.get_backend()}", flush=True)


if __name__ == "__main__":
    main()
