"""DDP whose ranks may die and come back (see :mod:`aioreduce.heal`): an iteration's sums are
one group, run again as a whole with a replacement that healed.

Why DDP runs over a stand-in group here. A replacement starts in the middle of the job: its
DDP must not take part in collectives the live ranks ran long ago (the shape check and the
broadcast from rank 0 at construction, the bucket order agreed after the first iteration).
So, as torchft does, DDP's own process group is :class:`Alone` (world size 1: those stay on
each rank), and every collective the ranks share is ours, through the node:

* at construction, on a rank that is not a replacement: the model check and one broadcast of
  parameters and buffers from rank 0 (a replacement healed them from a live rank instead);
* before every forward, if DDP syncs buffers: rank 0's buffers, as a sum to which the others
  add zeros (one step of the iteration's group; if a death fails it, the buffers are synced
  again at the next forward);
* every gradient bucket: a mean, as :func:`~aioreduce.torch.ddp.aioreduce_hook` takes it, but
  DDP gets the results only once the iteration's last bucket is summed. If a rank died, the
  live ranks wait for its replacement (``Node.replace_lost``), which heals the iteration's
  starting state, and all ranks sum the iteration's gradient again as one vector in the
  parameters' order (the replacement's first iteration does only that): a layout that does
  not depend on DDP's buckets, which a replacement has not rebuilt yet.

Each rank orders its buckets on its own (the stand-in agrees with nobody), from its first
backward pass: the same model gives the same order; a graph that changes between ranks makes
a sum's sizes differ, and that step fails on every rank, named. ``find_unused_parameters`` is
refused: which parameters were used would have to be agreed on too. Cost: a copy of each
bucket's gradient per iteration (for a rerun), and DDP's gradients wait for the last bucket.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.

import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.utils import parameters_to_vector

from .work import completed

if TYPE_CHECKING:
    from .process_group import ProcessGroupAioreduce


class Alone(dist.ProcessGroup):
    """A world-size-1 stand-in: DDP's own collectives complete at once, on this rank."""

    def __init__(self) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]

    def getBackendName(self) -> str:
        return "aioreduce-alone"

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def broadcast(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:  # type: ignore[override]
        return completed(tensors)

    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:  # type: ignore[override]
        return completed(tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        for outs, t in zip(output_tensors, input_tensors, strict=True):
            outs[0].copy_(t)
        return completed(output_tensors)

    def barrier(self, opts: object = None) -> dist.Work:
        return completed([])


def _error(fut: torch.futures.Future[Any]) -> BaseException | None:
    """The exception of a completed future, or None."""
    try:
        fut.wait()
    except Exception as exc:
        return exc
    return None


def _value(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return fut.value()


class Iterations:
    """The hook's state: one iteration's buckets at a time (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, pg: "ProcessGroupAioreduce") -> None:
        self.pg = pg
        self.params = [p for p in module.parameters() if p.requires_grad]
        # A replacement's first iteration sums only the whole gradient (the live ranks' rerun).
        self.joining = pg.node.node.mesh.incarnations.rejoined
        self._buckets: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor],
                                  torch.futures.Future[Any], torch.futures.Future[Any]]] = []

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
        buf = bucket.buffer()
        # The copy before the sum starts: the sum lands in ``buf`` as it goes (a CPU tensor is
        # summed in place, chunk by chunk, on the loop's thread), and a rerun must add this
        # rank's own gradient, not a partial sum.
        keep = buf.clone()
        # On a GPU, the future DDP waits for carries the stream events of the copy back (set
        # after this thread's stream waited for them, see _settle), as the sum's own does.
        out: torch.futures.Future[Any] = (torch.futures.Future(devices=[buf.device])
                                          if buf.is_cuda else torch.futures.Future())
        if self.joining:  # (no sum: the whole gradient is summed at the last bucket)
            inner: torch.futures.Future[Any] = torch.futures.Future()
            inner.set_result(None)
        else:
            inner = self.pg.future_sum(buf, average=True, rerun=False, last=bucket.is_last())
        self._buckets.append((buf, keep, list(bucket.parameters()), inner, out))
        if bucket.is_last():
            buckets, self._buckets = self._buckets, []
            if self.joining:
                self.joining = False
                threading.Thread(target=self._rerun, args=(buckets, False),
                                 daemon=True).start()
            else:
                torch.futures.collect_all([b[3] for b in buckets]).then(
                    lambda _all: self._settle(buckets))
        return out.then(_value)

    def _settle(self, buckets: list[Any]) -> None:
        """Every bucket's sum is over: hand DDP the results, or run the iteration again."""
        # (_error waits for each sum: on a GPU this thread's stream then waits for its copy
        # back, and each bucket's future records that for DDP's stream)
        if all(_error(b[3]) is None for b in buckets):
            for buf, _keep, _params, _inner, out in buckets:
                out.set_result(buf)
            return
        # (not on the thread that completes our futures: the rerun waits for some)
        threading.Thread(target=self._rerun, args=(buckets, True), daemon=True).start()

    def _rerun(self, buckets: list[Any], failed: bool) -> None:
        """Wait for the dead ranks' replacements (``failed``), then sum the iteration's
        gradient as one vector in the parameters' order and land it in the buckets."""
        node = self.pg.node
        # Why the last sum failed: a bucket's, or the rerun's (whose buckets then hold none).
        last = next((e for b in buckets if (e := _error(b[3])) is not None), None)
        try:
            for _attempt in range(node.world_size):
                if failed and not node.replace_lost():
                    raise RuntimeError(
                        f"rank {node.rank}: {last or 'a rank was lost'}; the iteration was "
                        "not run again: no replacement came within rejoin_wait, or a live "
                        "rank did not answer (one that finished the iteration's last sum "
                        "goes on: see docs/heal.md, Not yet)")
                slices = self._slices(buckets)
                flat = torch.cat([keep[a:b] for keep, a, b, _buf in slices])
                try:
                    self.pg.future_sum(flat, average=True, rerun=False, last=True).wait()
                except Exception as exc:
                    failed, last = True, exc
                    continue
                offset = 0
                for _keep, a, b, buf in slices:
                    buf[a:b].copy_(flat[offset:offset + b - a])
                    offset += b - a
                for buf, _keep, _params, _inner, out in buckets:
                    out.set_result(buf)
                return
            raise RuntimeError(f"rank {node.rank}: ranks kept dying while an iteration ran "
                               "again")
        except Exception as exc:
            for *_rest, out in buckets:
                if not out.done():
                    out.set_exception(exc)

    def _slices(self, buckets: list[Any]) -> list[tuple[torch.Tensor, int, int, torch.Tensor]]:
        """(a bucket's gradient copy, start, end, its buffer) of every parameter, in the
        parameters' order."""
        where: dict[int, tuple[torch.Tensor, int, int, torch.Tensor]] = {}
        for buf, keep, params, _inner, _out in buckets:
            offset = 0
            for p in params:
                where[id(p)] = (keep, offset, offset + p.numel(), buf)
                offset += p.numel()
        return [where[id(p)] for p in self.params if id(p) in where]


def healing_hook(state: Iterations,
                 bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
    """DDP communication hook of :class:`Iterations`."""
    return state.hook(bucket)


def sync_buffers(ddp: TorchDDP, iterations: Iterations) -> None:
    """Before every forward: rank 0's buffers on every rank (a sum; see the module
    docstring), if DDP syncs buffers; not in a replacement's first iteration."""
    buffers = list(ddp.module.buffers())
    if not buffers or iterations.joining or not ddp.will_sync_module_buffers():  # type: ignore[no-untyped-call]
        return
    pg = iterations.pg
    with torch.no_grad():
        flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in buffers])
        if pg.node.rank != 0:
            flat.zero_()
        try:
            pg.future_sum(flat, average=False, rerun=False).wait()
        except Exception:  # a rank died: the iteration runs again, buffers next forward
            return
        _copy_back(flat, buffers)


def broadcast_state(module: torch.nn.Module, pg: "ProcessGroupAioreduce") -> None:
    """Rank 0's parameters and buffers on every rank (what DDP does at construction)."""
    tensors = [*module.parameters(), *module.buffers()]
    if not tensors:
        return
    with torch.no_grad():
        # (on the host: a model on the GPU is sent from host memory, like any state blob)
        flat = parameters_to_vector([t.detach().to("cpu", torch.float64) for t in tensors])
        got = pg.node.broadcast(flat.numpy(), root=0).value
        _copy_back(torch.from_numpy(np.array(got)), tensors)


def _copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """``flat`` (the tensors laid end to end, as float64) into the tensors, each in its own
    dtype."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t).to(t.dtype))
        offset += t.numel()
