"""Stock ``DistributedDataParallel`` with every gradient bucket summed by aioreduce.

    node = aioreduce.connect(scheme=aioreduce.Ring())
    model = aioreduce.torch.DistributedDataParallel(model, node)

The model is wrapped by torch's own DDP over a process group of ours that spans the job
(:class:`~aioreduce.torch.ProcessGroupAioreduce` on the node), and a communication hook hands
each bucket to the node. DDP keeps doing what it does with a process group, through our
transport: it broadcasts the parameters and buffers exactly from rank 0 at construction, checks
parameter shapes across ranks, agrees on the bucket order it rebuilds after the first step, and
broadcasts buffers before every forward when the module has any. With ``rejoin_wait`` (ranks
that die come back, see :mod:`aioreduce.heal`) the membership changes, and DDP runs over a
world-size-1 stand-in group instead, as torchft's does, with all of the above done by us
(:mod:`.ddp_heal`).

The hook does not block the backward pass: it queues the bucket on the node's event loop and
returns a future that a thread of ours completes (never the event loop's thread, where a user
callback chained on the future could stall every collective).

Under a bounded-time scheme (``Transpose``) replicas may drift; when a result asks for a re-sync
(``Result.resync`` with ``drifted`` ranks) the parameters are broadcast from rank 0 before the
next forward.
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations as
# objects (``dist.GradBucket``, ``torch.futures.Future[torch.Tensor]``), not as strings.

import hashlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.utils import parameters_to_vector

from ..sync import SyncNode
from . import ddp_heal
from .process_group import ProcessGroupAioreduce, group_of


def _value(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return fut.value()


def aioreduce_hook(state: ProcessGroupAioreduce,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
    """DDP communication hook: the bucket's mean over the ranks, summed by the node.

    A failed sum reaches ``backward()`` as a ``RuntimeError`` carrying our message: the future
    our thread completes holds a Python exception that only Python's ``wait()`` raises (DDP's
    C++ side would try to cast it to a tensor), so the hook returns a chained future, which
    torch marks as failed when the chained ``value()`` raises."""
    return state.future_sum(bucket.buffer(), average=True).then(_value)


def _signature(module: torch.nn.Module) -> bytes:
    """A digest of the parameters' names, shapes and dtypes, in order."""
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.digest()[:8]


def check_same_model(module: torch.nn.Module, pg: ProcessGroupAioreduce) -> None:
    """Raise the same ``ValueError`` on every rank when the ranks' parameters (names, shapes,
    dtypes, order) differ, naming the ranks that differ from rank 0."""
    mine = np.frombuffer(_signature(module), np.int64).copy()
    every = pg.node.allgather(mine).value.reshape(pg.node.world_size)
    odd = [r for r in range(pg.node.world_size) if every[r] != every[0]]
    if odd:
        raise ValueError(f"rank {pg.node.rank}: ranks {odd} hold a model whose parameters "
                         "(names, shapes, dtypes or order) differ from rank 0's; every rank "
                         "must build the same model")


def register(ddp_model: TorchDDP, pg: ProcessGroupAioreduce) -> None:
    """Send ``ddp_model``'s gradient buckets through ``pg``'s node (once, before the first
    backward). Also re-syncs parameters from rank 0 when a bounded-time result asks for it."""
    ddp_model.register_comm_hook(pg, aioreduce_hook)

    def resync(module: torch.nn.Module, _inputs: Any) -> None:
        if not pg.needs_resync:
            return
        pg.needs_resync = False
        params = list(module.parameters())
        with torch.no_grad():  # one broadcast of all parameters, flat, copied back in place
            flat = parameters_to_vector(params)
            pg.broadcast([flat], dist.BroadcastOptions()).wait()
            offset = 0
            for p in params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    ddp_model.register_forward_pre_hook(resync)


def DistributedDataParallel(module: torch.nn.Module,
                            node: SyncNode | ProcessGroupAioreduce | None = None,
                            **ddp_kwargs: Any) -> TorchDDP:
    """``torch.nn.parallel.DistributedDataParallel(module)`` over ``node`` (a blocking node
    from :func:`aioreduce.connect` with an allreduce scheme, or a process group of ours; by
    default the one ``init_process_group(backend="aioreduce")`` made), every gradient bucket
    through aioreduce. ``ddp_kwargs`` go to torch's DDP."""
    pg = group_of(node)
    if pg.node.node.healer.rejoin_wait > 0:  # ranks may come back: see ddp_heal
        return _healing(module, pg, ddp_kwargs)
    check_same_model(module, pg)
    ddp = TorchDDP(module, process_group=pg, **ddp_kwargs)
    register(ddp, pg)
    return ddp


def _healing(module: torch.nn.Module, pg: ProcessGroupAioreduce, ddp_kwargs: dict[str, Any]
             ) -> TorchDDP:
    """DDP whose iterations run again with a replacement (see :mod:`.ddp_heal`)."""
    if ddp_kwargs.get("find_unused_parameters"):
        raise ValueError(f"rank {pg.node.rank}: find_unused_parameters=True does not heal "
                         "(the ranks would have to agree on the parameters used); leave it "
                         "off, or run without rejoin_wait")
    iterations = ddp_heal.Iterations(module, pg)
    if not iterations.joining:  # a replacement healed its parameters instead
        check_same_model(module, pg)
        ddp_heal.broadcast_state(module, pg)
    ddp = TorchDDP(module, process_group=ddp_heal.Alone(), init_sync=False, **ddp_kwargs)
    ddp.register_comm_hook(iterations, ddp_heal.healing_hook)
    ddp.register_forward_pre_hook(lambda m, _inputs: ddp_heal.sync_buffers(m, iterations))
    return ddp
